#!/usr/bin/env python3
"""docs/operating.md's power-cap-and-pause log example, from a run on the simulated GPU (virtual time, seconds): a
0.5 target under a 300-W cap with the burn shape (the lean one draws too little for the cap to bind), SIGUSR1's
pause at 44 s and SIGUSR2 at 50 s (sent through the pause switch, as the signal handlers do). Prints the lines the
doc shows, each cut to the fields it names, then where the cap settled (the model's 1-s mean power before the
pause, as a share of the cap); the doc shows all of it, as printed (tests/test_operators.py checks). Nothing in the
example is typed.

    python3 scripts/log_example.py
"""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from forge_load.config.load import load_config  # noqa: E402
from forge_load.control.filler import Controls  # noqa: E402
from forge_load.service.loop import run_simulated  # noqa: E402
from forge_load.service.runtime import Runtime  # noqa: E402
from forge_load.steering.pause import PauseSwitch  # noqa: E402

CAP_W, PAUSE_S, RESUME_S = 300.0, 44.0, 50.0
FIELD_RE = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')
HEAD, SHORT = ("t", "event", "state", "target"), ("t", "event", "state")
# the event and which of its lines, the fields shown ("…" where fields are left out)
SHOWN: list[tuple[str, int, tuple[str, ...]]] = [
    ("power_capped", 0, (*HEAD, "…", "capped", "power_w", "max_power_w", "duty_limit")),
    ("status", 1, (*HEAD, "util", "own", "…", "power_w", "energy_j", "power_capped")),
    ("pause", 0, (*HEAD, "…", "multiplier", "…", "reason")),
    ("power_capped", 1, (*SHORT, "…", "capped", "power_w", "max_power_w", "duty_limit")),
    ("drained", 0, (*SHORT, "…", "last_kernel_end_t")),
    ("unpause", 0, (*SHORT, "…", "reason")),
]


def main() -> int:
    flags = f"--simulate --sim-speed 0 --duration 60 --shape burn --max-power-w {CAP_W:g}"
    config = load_config(flags.split(), env={})
    switch = PauseSwitch()
    pending = {PAUSE_S: lambda: switch.set(True, "SIGUSR1"), RESUME_S: lambda: switch.set(False, "SIGUSR2")}
    runtime: list[Runtime] = []

    def beat() -> None:  # about once a virtual second
        for t_s in [t for t in pending if t <= runtime[0].now()]:
            pending.pop(t_s)()

    out = io.StringIO()
    run = run_simulated(config, out, heartbeat=beat, on_start=runtime.append, keep_history=True,
                        controls=Controls(switch))
    lines = [dict(FIELD_RE.findall(line)) for line in out.getvalue().splitlines()]
    for event, occurrence, fields in SHOWN:
        line = [found for found in lines if found["event"] == event][occurrence]
        print(" ".join(f if f == "…" else f"{f}={line[f]}" for f in fields))
    power_w = run.gpu.energy_in_j(PAUSE_S - 11.0, PAUSE_S - 1.0) / 10.0  # the 10 s before the pause, by the model
    print(f"# before the pause: {power_w:.1f} W mean, {100 * power_w / CAP_W:.0f} % of the {CAP_W:g}-W cap")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
