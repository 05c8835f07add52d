"""Run a whole scenario on the simulated GPU in virtual time and give back what a test needs to judge it."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from forge_load.config.load import load_config
from forge_load.service.loop import SimRun, run_simulated
from forge_load.service.runtime import Runtime


class WallClock:
    """Drives the simulated GPU in real time (to exercise the threaded run loop without a GPU)."""

    def now(self) -> float:
        return time.monotonic()


@dataclass
class Scenario:
    run: SimRun
    events: list[dict[str, object]]

    def of(self, event: str) -> list[dict[str, object]]:
        return [e for e in self.events if e["event"] == event]

    def first(self, event: str) -> dict[str, object]:
        found = self.of(event)
        assert found, f"no {event!r} event in {[e['event'] for e in self.events]}"
        return found[0]


def simulate(flags: str) -> Scenario:
    config = load_config(f"--simulate --sim-speed 0 --log-format json {flags}".split(), env={})
    out = io.StringIO()
    run = run_simulated(config, out, keep_history=True)  # scored afterwards
    return Scenario(run, [json.loads(line) for line in out.getvalue().splitlines()])


def step_with(actions: list[tuple[float, Callable[[], object]]], after: Callable[[Runtime, float], None]
              ) -> Callable[[Runtime], None]:
    """An `on_start` for run_simulated: every filler step first takes the actions due by then (virtual seconds),
    then steps, then calls `after(runtime, now_s)`."""
    pending = sorted(actions, key=lambda a: a[0])

    def on_start(rt: Runtime) -> None:
        real = rt.filler.step

        def step(now_s: float) -> float:
            while pending and pending[0][0] <= now_s:
                pending.pop(0)[1]()
            due_s = real(now_s)
            after(rt, now_s)
            return due_s

        rt.filler.step = step  # type: ignore[method-assign]

    return on_start
