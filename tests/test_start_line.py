"""The start line a person can read (docs/operating.md, Reading the log): in key=value, the essentials on the
`start` line (signals= among them, which checks read) and the other settings on a `settings` line right after it;
in JSON, one `start` line with every field, essentials first. `hold_dir` is left out under --simulate unless set."""

from __future__ import annotations

import io
import json
import re
import shlex
import types

import pytest

from forge_load.config.load import load_config
from forge_load.gpu.clocks import WallLoopClock
from forge_load.service import runtime
from forge_load.service.loop import open_simulated, run_simulated
from forge_load.service.runtime import log_start
from tests.test_clock import OFFSET_S, Clocks

ESSENTIALS = ["t", "event", "time", "gpu", "state", "target", "gpu_mem_mib", "gpu_name", "controller",
              "metric", "shape", "resume_after_s", "signals", "wall_time", "version", "simulated", "uuid"]


def lines(*argv: str, fmt: str = "text") -> list[str]:
    config = load_config(["--simulate", "--sim-speed", "0", "--duration", "1", *argv], env={"FORGE_LOG_FORMAT": fmt})
    out = io.StringIO()
    run_simulated(config, out)
    return out.getvalue().splitlines()


def fields(line: str) -> list[str]:
    return [pair.split("=", 1)[0] for pair in shlex.split(line)]  # quoted values hold spaces


def test_the_key_value_start_line_holds_the_essentials_first() -> None:
    start, settings, *_ = lines()
    assert fields(start) == ESSENTIALS
    assert re.match(r"t=0\.00 event=start time=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d gpu=0 state=filling "
                    r"target=0\.500 gpu_mem_mib=512\.0 gpu_name=", start), start
    assert len(start) < 355, len(start)
    assert "signals=process,memory,utilization" in start
    assert " metric=utilization shape=lean " in start  # the default shape, named
    assert 'shape_layout="one sleeping warp"' in settings
    assert re.match(r"t=0\.00 event=settings time=\S+ gpu=0 ", settings) and settings.split()[-1].startswith("uuid=")
    assert " controller=" not in settings and " signals=" not in settings
    assert {"boost_target", "poll_interval_s", "sim_seed", "nvml_clock", "gpu_requested", "driver"} <= set(
        fields(settings))


def test_the_json_start_line_has_every_field_essentials_first() -> None:
    text_start, text_settings, *_ = lines()
    start = json.loads(lines(fmt="json")[0])
    assert start["event"] == "start"
    essentials = [k for k in ESSENTIALS if k not in ("time", "uuid")]  # time: key=value lines'; uuid: last
    assert [k for k in start if k != "ts"][:len(essentials)] == essentials and list(start)[-1] == "uuid"
    assert set(start) - {"ts"} == (set(fields(text_start)) | set(fields(text_settings))) - {"time"}


@pytest.mark.parametrize(("argv", "shape", "layout"), [
    ([], "lean", "one sleeping warp"),
    (["--shape", "burn"], "burn", "full waves of FMA blocks on every SM"),
])
def test_the_start_line_names_the_shape_and_how_its_kernels_are_laid_out(argv: list[str], shape: str,
                                                                         layout: str) -> None:
    start = json.loads(lines(*argv, fmt="json")[0])
    assert (start["shape"], start["shape_layout"]) == (shape, layout)


def test_hold_dir_is_not_on_a_simulated_start_unless_set() -> None:
    start, settings, *_ = lines()
    assert "hold_dir=" not in start + settings
    start, settings, *_ = lines("--hold-dir", "/tmp/forge-sim-holds")
    assert "hold_dir=/tmp/forge-sim-holds" in settings


PREEMPTED_S = 0.05


class PreemptedClock(WallLoopClock):
    """A real GPU's loop clock stood in for by tests/test_clock.py's Clocks: monotonic seconds from `mono_s` and a
    wall clock OFFSET_S ahead of it, the thread preempted for PREEMPTED_S right after its first read of the wall
    clock (a busy host, or another thread holding the GIL)."""

    def __init__(self, mono_s: float) -> None:
        super().__init__()
        self.clocks = Clocks(PREEMPTED_S, mono_s=mono_s)

    def now(self) -> float:
        return self.clocks.mono()

    def wall_s(self) -> float:
        return self.clocks.wall()

    @property
    def preempted(self) -> bool:
        return not self.clocks.preempted_s


def test_the_start_lines_wall_time_survives_a_preemption_between_its_clock_reads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # wall_time maps every line's t onto the Unix time (checks line the log up with the GPU's own record through
    # it): a wall and a monotonic read split by a preemption would shift every such time by the preemption's length.
    config = load_config(["--simulate", "--sim-speed", "0", "--duration", "1"], env={"FORGE_LOG_FORMAT": "json"})
    out = io.StringIO()
    rt = open_simulated(config, out).runtime
    clock = PreemptedClock(rt.start_s + 0.2)
    rt.clock = clock
    # The process's own wall clock too, wherever the start line reads it, is the stand-in's.
    monkeypatch.setattr(runtime, "time", types.SimpleNamespace(time=clock.wall_s))
    log_start(rt, {})
    assert clock.preempted
    start = next(line for line in map(json.loads, out.getvalue().splitlines()) if line["event"] == "start")
    assert abs(start["wall_time"] - (rt.start_s + OFFSET_S)) < 1e-4, start["wall_time"] - OFFSET_S
