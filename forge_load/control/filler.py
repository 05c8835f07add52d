"""The control loop of one GPU: Monitor readings and the reasons not to run (reasons.py: pauses, holds, the power
cap) -> policy -> controller (under the power cap's duty limit) -> Worker, and what the log lines say. The lines are
written through lines.py's LineGate, the power cap learns through powercap.py's PowerWatch, the energy is counted by
energy.py's EnergyMeter."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from forge_load.control.controller import Controller
from forge_load.control.energy import EnergyMeter
from forge_load.control.lines import LineGate
from forge_load.control.monitor import Monitor, Reading
from forge_load.control.policy import FILLING_STATES, Policy, State, Transition
from forge_load.control.powercap import CapChange, PowerCap, PowerWatch
from forge_load.control.quantity import UTILIZATION, Held, HeldNow, Quantity, held_mean
from forge_load.control.status import GpuStatus
from forge_load.control.worker import IDLE_PLAN, Worker
from forge_load.steering.filler_status import StatusWriter
from forge_load.steering.hold_watch import FillerHolds, HoldBoard
from forge_load.steering.pause import Pauses, PauseSwitch


@dataclass
class IntervalStats:
    """Means over the NVML samples of one status interval (GPM's GRAPHICS_UTIL readings where NVML has no
    utilization), and the held quantity's readings of it where that is another."""

    util_sum: float = 0.0
    own_sum: float = 0.0
    foreign_sum: float = 0.0
    count: int = 0
    held: list[Held] = field(default_factory=list)

    def mean(self, total: float) -> float | None:
        return total / self.count if self.count else None


@dataclass(frozen=True)
class Timing:
    """When the filler started (the lines' t=0), how often it writes a status line, and how old the latest reading
    may be before it stops filling."""

    start_s: float
    log_interval_s: float
    stale_after_s: float = 2.0


@dataclass(frozen=True)
class Controls:
    """What ties a GPU's filler to the rest of the process, passed down from main() to the loop as one: what steers
    it from outside (the signals' pause switch, SIGUSR1 and SIGUSR2; the holds kept in this process, the kubelet's:
    both feed each GPU's Reasons) and who is told what it does (a change of state: the process title; each second:
    the heartbeat)."""

    switch: PauseSwitch | None = None
    on_transition: Callable[[], None] | None = None
    board: HoldBoard | None = None
    heartbeat: Callable[[], None] | None = None


NO_CONTROLS = Controls()


class Filler:
    """The loop's parts (monitor, worker, controller, policy, whose Reasons say what keeps the GPU from being
    filled), the gate its lines go through, its timing, and who it tells (`controls`: its heartbeat and its changes
    of state; `report`: this GPU's status file, which `forge-load status` reads); `quantity` is what the target is
    a target of."""

    def __init__(self, monitor: Monitor, worker: Worker, controller: Controller, policy: Policy, lines: LineGate,
                 timing: Timing, controls: Controls = NO_CONTROLS, quantity: Quantity = UTILIZATION,
                 report: StatusWriter | None = None) -> None:
        self.monitor = monitor
        self.report = report
        self.reason: str | None = None  # the last change's reason
        self.quantity = quantity
        self.worker = worker
        self.controller = controller
        self.policy = policy
        self.lines = lines
        self.timing = timing
        self.reasons = policy.reasons
        self.heartbeat = controls.heartbeat
        self.on_transition = controls.on_transition
        self.power_watch = (PowerWatch(self.power_cap, worker.busy_log, since_s=timing.start_s)
                            if self.power_cap is not None else None)
        self.yields = 0
        self.yielding_s = 0.0
        self.last: Reading | None = None
        self.last_share: Held | None = None  # the latest utilization reading (NVML's, or GPM's where it has none)
        self.util_now = HeldNow()  # utilization's readings of the latest 2 s
        self.held_now = self.util_now if quantity is UTILIZATION else HeldNow()  # the held quantity's
        self._seq = 0
        self._stats = IntervalStats()
        self._next_status_s = timing.start_s + timing.log_interval_s
        self._last_beat_s = float("-inf")
        self._yield_since_s: float | None = None
        self._draining = False  # a yield's (or a pause's) last kernels are still running
        self._held_at_zero = False  # the last plan's duty limit was 0 (the power cap allowed nothing)
        # Energy: the device's, over the time between two readings that began while we were filling.
        self.energy = EnergyMeter()  # the device's energy while we fill
        controller.start(timing.start_s)

    @property
    def state(self) -> State:
        return self.policy.state

    @property
    def pauses(self) -> Pauses | None:
        return self.reasons.pauses

    @property
    def holds(self) -> FillerHolds | None:
        return self.reasons.holds

    @property
    def power_cap(self) -> PowerCap | None:
        return self.reasons.power_cap

    @property
    def holds_begun(self) -> int:
        return self.reasons.holds_begun

    def step(self, now_s: float) -> float:
        """React to a new reading, drive the Worker, log; returns when to step again."""
        if self.monitor.failure is not None:
            raise self.monitor.failure
        reading = self.monitor.take()
        fresh = reading is not None and reading.seq != self._seq
        if self.reasons.holds_due(fresh):
            if fresh and reading is not None and reading.reason is not None and self.holds is not None:
                self.holds.foreign_seen(now_s)  # a held GPU at work is not idle: no age-out
            self._check_holds(now_s)
        if self.reasons.pauses_due(fresh):
            self._check_pauses(now_s)
        if reading is not None and fresh:
            self._seq = reading.seq
            self._react(now_s, reading)
        elif reading is None or now_s - reading.t_s > self.timing.stale_after_s:
            self._decide(now_s, f"no reading from NVML for {self.timing.stale_after_s:.0f} s")
        due_s = self.worker.step(now_s)
        if self._draining and not self.worker.in_flight:
            self._draining = False
            last_end_t = round(self.worker.busy_log.last_end_s - self.timing.start_s, 6)
            self.lines.emit(now_s, "drained", {**self.fields(now_s), "last_kernel_end_t": last_end_t})
        if self.holds is not None:  # at once when drained, so that `hold --wait` returns at once
            problem = self.holds.acknowledge(now_s, self.policy.state.value, self.drained)
            if problem is not None:
                self.lines.emit(now_s, "hold_warning", {**self.fields(now_s), "reason": problem})
        if self.report is not None:
            held_by = self.holds.watch.holders if self.holds is not None else ()
            if self.report.due(self.policy.state.value, held_by):
                self._report(now_s, held_by)
        if now_s >= self._next_status_s:
            self._status(now_s)
        if now_s >= self.lines.due_s:
            self.lines.flush(now_s)
        if self.heartbeat is not None and now_s - self._last_beat_s >= 1.0:
            self._last_beat_s = now_s
            self.heartbeat()
        # While filling, the next burst takes the readings in between; otherwise each one may end a wait. A
        # pause file is read at each reading, as fast as a yield: with one, every reading still wakes us.
        self.monitor.wake_every_reading = (self.policy.state not in FILLING_STATES or self._draining
                                           or (self.pauses is not None and self.pauses.pause_file is not None)
                                           or self._held_at_zero)  # the cap's first idle reading starts it
        ack_due_s = self.holds.ack_due_s if self.holds is not None else float("inf")
        return min(due_s, self._next_status_s, self.lines.due_s, ack_due_s)

    def _report(self, now_s: float, held_by: tuple[str, ...]) -> None:
        assert self.report is not None
        status = self.status(now_s)
        self.report.write(status.state, held_by, status.target, status.util_ratio, status.own_ratio, status.power_w,
                          self.reason, status.metric, status.metric_ratio, status.metric_own_ratio)

    def _react(self, now_s: float, reading: Reading) -> None:
        self.last = reading
        shares = UTILIZATION.held(reading)
        if shares:
            self.last_share = shares[-1]
        for share in shares:
            self._stats.util_sum += share.ratio
            self._stats.own_sum += share.own_ratio
            self._stats.foreign_sum += max(share.ratio - share.own_ratio, 0.0)
            self._stats.count += 1
        self.util_now.add(shares)
        if self.quantity is not UTILIZATION:
            held = self.quantity.held(reading)
            self.held_now.add(held)
            self._stats.held.extend(held)
        self.energy.add(reading)
        self._decide(now_s, reading.reason, reading)
        if self.power_watch is not None:
            self.power_watch.observe(now_s, reading)
        if self.policy.state in FILLING_STATES:
            self._plan(now_s, reading)
        self.energy.counting = self.policy.state in FILLING_STATES

    def _plan(self, now_s: float, reading: Reading | None) -> None:
        """The controller's plan for the Worker, under the power cap's duty limit; without a reading (an unpause
        between polls), from what the controller already knows."""
        limit = self.reasons.duty_limit
        if limit <= 0.0 or self._held_at_zero:
            # The power cap allowed nothing (before its first idle reading, or under idle): nothing filled, so the
            # windows until it allows some are not the controller's to learn from, as before a start.
            self.controller.start(now_s)
        self._held_at_zero = limit <= 0.0
        samples = self.quantity.samples(reading) if reading is not None else []
        window_s = reading.window_s if reading is not None else self.monitor.window_s
        plan = self.controller.update(self.policy.current_target, samples, window_s, self.worker.launch_s,
                                      max_duty=limit)
        self.worker.set_plan(plan)
        if self.power_cap is not None:
            self._log_cap(now_s, self.power_cap.after_plan(plan.duty_ratio, limit))

    def _decide(self, now_s: float, reason: str | None, reading: Reading | None = None) -> None:
        self._apply(now_s, self.policy.update(now_s, reason), reading)

    def _check_pauses(self, now_s: float) -> None:
        """A pause begins (or its reasons change) or ends: as fast as a yield, and logged like one."""
        change = self.reasons.look_pauses()
        if change is not None:
            self._apply(now_s, self.policy.changed(change.event, now_s, change.reason))
            if change.event == "unpause" and self.policy.state in FILLING_STATES:
                self._plan(now_s, None)  # at once, not at the next poll

    @property
    def drained(self) -> bool:
        """No kernel of ours in flight, and none to come."""
        return self.policy.state not in FILLING_STATES and not self.worker.in_flight

    def _check_holds(self, now_s: float) -> None:
        """Holds begin or end: a `hold` line per holder (the first one holds the GPU, as fast as a yield) and a
        `release` line per holder gone (the last one lets it fill again); each problem once."""
        look = self.reasons.look_holds(now_s)
        for problem in look.problems:
            self.lines.emit(now_s, "hold_warning", {**self.fields(now_s), "reason": problem})
        for line in look.lines:
            extra: dict[str, object] = {"holder": line.holder, **line.more}
            if line.turns:
                self._apply(now_s, self.policy.changed(line.event, now_s, line.reason), extra=extra)
                if line.event == "release" and self.policy.state in FILLING_STATES:
                    self._plan(now_s, None)  # at once, not at the next poll
                continue
            fields = self.fields(now_s)
            fields.update(reason=line.reason, **extra)
            self.lines.emit(now_s, line.event, fields)

    def _apply(self, now_s: float, transition: Transition | None, reading: Reading | None = None,
               extra: dict[str, object] | None = None) -> None:
        if transition is None:
            return
        filling_before = self.worker.plan.duty_ratio > 0 or self.worker.in_flight > 0
        if transition.state not in FILLING_STATES:
            self.worker.set_plan(IDLE_PLAN)  # no kernel is launched after this line
            self._draining = self._draining or filling_before
        if transition.state is State.YIELDING and self._yield_since_s is None:
            # Every spell of yielding counts, also one an unpause begins (a job seen during the pause).
            self.yields += 1
            self._yield_since_s = now_s
        elif transition.state is not State.YIELDING and self._yield_since_s is not None:
            self.yielding_s += now_s - self._yield_since_s
            self._yield_since_s = None
        if transition.event in ("resume", "unpause", "release") and transition.state in FILLING_STATES:
            self.controller.start(now_s)
        extra = dict(extra or {})
        if reading is not None and reading.signals:
            extra["signals"] = ",".join(reading.signals)
        self.reason = transition.reason
        fields = self.fields(now_s)
        fields.update(reason=transition.reason, **extra)
        self.lines.emit(now_s, transition.event, fields)
        if transition.state not in FILLING_STATES and self.power_cap is not None:
            self._log_cap(now_s, self.power_cap.stop_binding())
        if self.on_transition is not None:
            self.on_transition()

    def _log_cap(self, now_s: float, change: CapChange | None) -> None:
        if change is not None:
            self.lines.emit(now_s, "power_capped", {**self.fields(now_s), **change.fields()})

    def seconds_yielding(self, now_s: float) -> float:
        open_s = now_s - self._yield_since_s if self._yield_since_s is not None else 0.0
        return self.yielding_s + open_s

    def _status(self, now_s: float) -> None:
        stats = self._stats
        extra: dict[str, object] = {}
        if self.last is not None and self.last.power_w is not None:
            extra["power_w"] = round(self.last.power_w, 1)
        extra["energy_j"] = round(self.energy.energy_j, 1)
        if self.power_cap is not None:
            extra["power_capped"] = self.power_cap.binding
        fields = self.fields(now_s)
        fields.update(util=stats.mean(stats.util_sum), own=stats.mean(stats.own_sum),
                      foreign=stats.mean(stats.foreign_sum))
        if self.quantity is not UTILIZATION:  # the held quantity under its own name (utilization's is the line's)
            held = held_mean(stats.held)
            fields[self.quantity.field], fields[self.quantity.own_field] = held if held is not None else (None, None)
        fields.update(samples=stats.count, **extra)
        self.lines.emit(now_s, "status", fields)
        self._stats = IntervalStats()
        while self._next_status_s <= now_s:
            self._next_status_s += self.timing.log_interval_s

    def status(self, now_s: float) -> GpuStatus:
        """The snapshot the log lines and the metrics both read."""
        last, policy = self.last, self.policy
        held = self.held_now.mean()
        # NVML's latest sample window; where GPM stands in for it, its readings of the latest 2 s (quantity.HeldNow:
        # a single one holds one period of our bursts and part of the next, and swings with where it falls)
        share = self.last_share
        if last is not None and last.utilization_by_gpm:
            util_now = self.util_now.mean()
            share = Held(last.t_s, 0.0, *util_now) if util_now is not None else None
        plan = self.worker.plan
        filling = policy.state in FILLING_STATES
        return GpuStatus(
            state=policy.state.value,
            target=policy.current_target if filling else policy.target,
            holding=policy.current_target,
            util_ratio=share.ratio if share else None,
            own_ratio=share.own_ratio if share else None,
            foreign_ratio=max(share.ratio - share.own_ratio, 0.0) if share else None,
            multiplier=plan.multiplier if plan.duty_ratio > 0 else 0,
            own_mem_mib=last.own_mem_mib if last is not None else None,
            power_w=last.power_w if last is not None else None,
            temperature_c=last.temperature_c if last is not None else None,
            yields=self.yields,
            yielding_s=self.seconds_yielding(now_s),
            own_busy_s=self.worker.busy_log.total_busy_s,
            energy_j=self.energy.energy_j,
            power_cap_w=self.power_cap.cap_w if self.power_cap is not None else None,
            power_capped=self.power_cap is not None and self.power_cap.binding and filling,
            holds=len(self.holds.watch.honoured) if self.holds is not None else 0,
            holds_begun=self.holds_begun,
            metric=self.quantity.name,
            metric_ratio=held[0] if held is not None else None,
            metric_own_ratio=held[1] if held is not None else None,
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
