"""Run a whole scenario on the simulated GPU in virtual time and give back what a test needs to judge it."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from forge_load.config.load import load_config
from forge_load.service.loop import SimRun, run_simulated
from forge_load.service.runtime import Runtime, log_start


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


def drive_storm(run: SimRun, storm_s: float, step_s: float, act: Callable[[int, float], None],
                check: Callable[[int, float], None]) -> None:
    """Step an open_simulated() run by hand through a storm, finer than its own loop would step: the start line,
    then at each step i (from 1, every `step_s` virtual seconds up to `storm_s`) the clock advances, the Monitor
    polls where its poll is due, `act(i, now_s)` tells the filler something (a signal, a hold), the filler steps,
    and `check(i, now_s)` judges the step. How the run ends (drain, stop line) is the caller's; the files it wrote
    for others to read (its status row, its acknowledgement) go at the end, as a filler's do when it stops."""
    rt, clock = run.runtime, run.clock
    log_start(rt, {})
    monitor_due_s = rt.monitor.step(0.0)
    try:
        for i in range(1, round(storm_s / step_s) + 1):
            now_s = i * step_s
            clock.advance_to(now_s)
            if monitor_due_s <= now_s:
                monitor_due_s = rt.monitor.step(now_s)
            act(i, now_s)
            rt.filler.step(now_s)
            check(i, now_s)
    finally:
        if rt.filler.report is not None:
            rt.filler.report.close()
        if rt.filler.holds is not None:
            rt.filler.holds.close()
