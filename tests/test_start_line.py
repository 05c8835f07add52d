"""The start line a person can read (docs/operating.md, Reading the log): in key=value, the essentials on the
`start` line (signals= among them, which checks read) and the other settings on a `settings` line right after it;
in JSON, one `start` line with every field, essentials first. `hold_dir` is left out under --simulate unless set."""

from __future__ import annotations

import io
import json

from forge_load.config.load import load_config
from forge_load.service.loop import run_simulated

ESSENTIALS = ["t", "event", "state", "target", "gpu_mem_mib", "gpu", "uuid", "gpu_name", "controller",
              "metric", "resume_after_s", "signals", "wall_time", "version", "simulated"]


def lines(*argv: str, fmt: str = "text") -> list[str]:
    config = load_config(["--simulate", "--sim-speed", "0", "--duration", "1", *argv], env={"FORGE_LOG_FORMAT": fmt})
    out = io.StringIO()
    run_simulated(config, out)
    return out.getvalue().splitlines()


def fields(line: str) -> list[str]:
    return [pair.split("=", 1)[0] for pair in line.replace('"Simulated GPU (132 SMs)"', "x").split(" ")]


def test_the_key_value_start_line_holds_the_essentials_first() -> None:
    start, settings, *_ = lines()
    assert fields(start) == ESSENTIALS
    assert start.startswith("t=0.00 event=start state=filling target=0.500 gpu_mem_mib=512.0 gpu=0 uuid=GPU-")
    assert len(start) < 300, len(start)
    assert "signals=process,memory,utilization" in start
    assert settings.startswith("t=0.00 event=settings gpu=0 uuid=GPU-")
    assert " controller=" not in settings and " signals=" not in settings
    assert {"boost_target", "poll_interval_s", "sim_seed", "nvml_clock", "gpu_requested", "driver"} <= set(
        fields(settings))


def test_the_json_start_line_has_every_field_essentials_first() -> None:
    text_start, text_settings, *_ = lines()
    start = json.loads(lines(fmt="json")[0])
    assert start["event"] == "start"
    assert [k for k in start if k != "ts"][:len(ESSENTIALS)] == ESSENTIALS
    assert set(start) - {"ts"} == set(fields(text_start)) | set(fields(text_settings)) - {"event"} | {"event"}


def test_hold_dir_is_not_on_a_simulated_start_unless_set() -> None:
    start, settings, *_ = lines()
    assert "hold_dir=" not in start + settings
    start, settings, *_ = lines("--hold-dir", "/tmp/forge-sim-holds")
    assert "hold_dir=/tmp/forge-sim-holds" in settings
