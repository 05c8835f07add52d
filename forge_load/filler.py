"""The control loop of one GPU: Monitor readings -> policy -> controller -> Worker, and the log lines."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from forge_load.controller import Controller
from forge_load.log import EventLog
from forge_load.monitor import Monitor, Reading
from forge_load.policy import Policy, State
from forge_load.quantity import UTILIZATION, Quantity
from forge_load.signals import ShareSample
from forge_load.status import GpuStatus
from forge_load.worker import IDLE_PLAN, Worker


@dataclass
class IntervalStats:
    """Means over the NVML samples of one status interval."""

    util_sum: float = 0.0
    own_sum: float = 0.0
    foreign_sum: float = 0.0
    count: int = 0

    def mean(self, total: float) -> float | None:
        return total / self.count if self.count else None


class Filler:
    def __init__(self, monitor: Monitor, worker: Worker, controller: Controller, policy: Policy,
                 log: EventLog, start_s: float, log_interval_s: float, stale_after_s: float = 2.0,
                 heartbeat: Callable[[], None] | None = None, quantity: Quantity = UTILIZATION) -> None:
        self.monitor = monitor
        self.quantity = quantity  # what the target is a target of
        self.worker = worker
        self.controller = controller
        self.policy = policy
        self.log = log
        self.start_s = start_s
        self.log_interval_s = log_interval_s
        self.stale_after_s = stale_after_s
        self.heartbeat = heartbeat
        self.yields = 0
        self.yielding_s = 0.0
        self.last: Reading | None = None
        self.last_share: ShareSample | None = None
        self._seq = 0
        self._stats = IntervalStats()
        self._next_status_s = start_s + log_interval_s
        self._last_beat_s = float("-inf")
        self._yield_since_s: float | None = None
        self._draining = False  # a yield's last kernels are still running
        controller.start(start_s)

    @property
    def state(self) -> State:
        return self.policy.state

    def step(self, now_s: float) -> float:
        """React to a new reading, drive the Worker, log; returns when to step again."""
        if self.monitor.failure is not None:
            raise self.monitor.failure
        reading = self.monitor.latest()
        if reading is not None and reading.seq != self._seq:
            self._seq = reading.seq
            self._react(now_s, reading)
        elif reading is None or now_s - reading.t_s > self.stale_after_s:
            self._decide(now_s, f"no reading from NVML for {self.stale_after_s:.0f} s")
        due_s = self.worker.step(now_s)
        if self._draining and not self.worker.in_flight:
            self._draining = False
            self.log.emit("drained", t=now_s - self.start_s, **self.fields(now_s),
                          last_kernel_end_t=round(self.worker.busy_log.last_end_s - self.start_s, 6))
        if now_s >= self._next_status_s:
            self._status(now_s)
        if self.heartbeat is not None and now_s - self._last_beat_s >= 1.0:
            self._last_beat_s = now_s
            self.heartbeat()
        return min(due_s, self._next_status_s)

    def _react(self, now_s: float, reading: Reading) -> None:
        self.last = reading
        if reading.samples:
            self.last_share = reading.samples[-1]
        for share in reading.samples:
            self._stats.util_sum += share.util_ratio
            self._stats.own_sum += share.own_ratio
            self._stats.foreign_sum += share.foreign_ratio
            self._stats.count += 1
        self._decide(now_s, reading.reason, reading)
        if self.policy.state is not State.YIELDING:
            plan = self.controller.update(self.policy.current_target, self.quantity.samples(reading),
                                          reading.window_s, self.worker.launch_s)
            self.worker.set_plan(plan)

    def _decide(self, now_s: float, reason: str | None, reading: Reading | None = None) -> None:
        transition = self.policy.update(now_s, reason)
        if transition is None:
            return
        if transition.event == "yield":
            self.worker.set_plan(IDLE_PLAN)
            self._draining = True
            self.yields += 1
            self._yield_since_s = now_s
        elif self._yield_since_s is not None:
            self.yielding_s += now_s - self._yield_since_s
            self._yield_since_s = None
        if transition.event == "resume":
            self.controller.start(now_s)
        extra: dict[str, object] = {}
        if reading is not None and reading.signals:
            extra["signals"] = ",".join(reading.signals)
        fields = self.fields(now_s)
        fields.update(reason=transition.reason, **extra)
        self.log.emit(transition.event, t=now_s - self.start_s, **fields)

    def seconds_yielding(self, now_s: float) -> float:
        open_s = now_s - self._yield_since_s if self._yield_since_s is not None else 0.0
        return self.yielding_s + open_s

    def _status(self, now_s: float) -> None:
        stats = self._stats
        extra: dict[str, object] = {}
        if self.last is not None and self.last.power_w is not None:
            extra["power_w"] = round(self.last.power_w, 1)
        fields = self.fields(now_s)
        fields.update(util=stats.mean(stats.util_sum), own=stats.mean(stats.own_sum),
                      foreign=stats.mean(stats.foreign_sum), samples=stats.count, **extra)
        self.log.emit("status", t=now_s - self.start_s, **fields)
        self._stats = IntervalStats()
        while self._next_status_s <= now_s:
            self._next_status_s += self.log_interval_s

    def status(self, now_s: float) -> GpuStatus:
        """The snapshot the log lines and the metrics both read."""
        last, share, policy = self.last, self.last_share, self.policy
        plan = self.worker.plan
        return GpuStatus(
            state=policy.state.value,
            target=policy.target if policy.state is State.YIELDING else policy.current_target,
            holding=policy.current_target,
            util_ratio=share.util_ratio if share else None,
            own_ratio=share.own_ratio if share else None,
            foreign_ratio=share.foreign_ratio if share else None,
            multiplier=plan.multiplier if plan.duty_ratio > 0 else 0,
            own_mem_mib=last.own_mem_mib if last is not None else None,
            power_w=last.power_w if last is not None else None,
            temperature_c=last.temperature_c if last is not None else None,
            yields=self.yields,
            yielding_s=self.seconds_yielding(now_s),
            own_busy_s=self.worker.busy_log.total_busy_s,
        )

    def fields(self, now_s: float) -> dict[str, object]:
        """The fields every event line of this GPU carries: state, target, latest shares, multiplier, memory."""
        return line_fields(self.status(now_s))


def line_fields(status: GpuStatus) -> dict[str, object]:
    return {
        "state": status.state,
        "target": status.target,
        "util": status.util_ratio,
        "own": status.own_ratio,
        "foreign": status.foreign_ratio,
        "multiplier": status.multiplier,
        "gpu_mem_mib": round(status.own_mem_mib, 1) if status.own_mem_mib is not None else None,
    }
