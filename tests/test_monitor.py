"""forge_load.control.monitor: the three foreign-activity signals, sample hold-back, own share, fallbacks, schedule.

The probe is a table: each row sets what the GPU reports at one poll."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest

from forge_load.control.detectors import Observation, Thresholds
from forge_load.control.monitor import Monitor, Reading
from forge_load.control.probe import DeviceInfo, GpuFailedError, GpuProcess, UtilSample
from forge_load.control.sampling import DEFAULT_WINDOW_S, FALLBACK_AFTER_S
from forge_load.control.worker import BusyLog

OWN_PID = 100
OWN_MIB = 500.0
UNSUPPORTED = None


@dataclass
class FakeProbe:
    """What the GPU reports; tests set the fields between polls. None = the query is not supported."""

    samples: list[UtilSample] | None = field(default_factory=list)
    util_ratio: float | None = None
    memory_mib: float | None = None
    procs: list[GpuProcess] | None = None
    power: float | None = None
    temperature: float | None = None
    energy: float | None = None
    fail_with: Exception | None = None
    info: DeviceInfo = DeviceInfo(0, "GPU-fake", "Fake GPU", 81559.0, "fake", False)
    util_ratio_calls: int = 0
    samples_calls: int = 0

    def utilization_samples(self, since_s: float) -> list[UtilSample] | None:
        self.samples_calls += 1
        if self.samples is None:
            return None
        return [s for s in self.samples if s.t_s > since_s]

    def utilization_ratio(self) -> float | None:
        self.util_ratio_calls += 1
        return self.util_ratio

    def memory_used_mib(self) -> float | None:
        return self.memory_mib

    def processes(self) -> list[GpuProcess] | None:
        if self.fail_with is not None:
            raise self.fail_with
        return self.procs

    def power_w(self) -> float | None:
        return self.power

    def temperature_c(self) -> float | None:
        return self.temperature

    def energy_j(self) -> float | None:
        return self.energy

    def power_limit_w(self) -> float | None:
        return None

    def close(self) -> None:
        pass


def own_proc(mib: float = OWN_MIB) -> GpuProcess:
    return GpuProcess(OWN_PID, mib)


def monitor(probe: FakeProbe, busy_log: BusyLog | None = None, baseline_mib: float = 0.0,
            complete: bool = True, **kwargs: object) -> Monitor:
    log = busy_log if busy_log is not None else BusyLog()
    if complete:
        log.mark_complete_until(1e9)  # every kernel of ours is logged: no sample is held back
    return Monitor(probe, log, own_pid=OWN_PID, baseline_mem_mib=baseline_mib,
                   own_mem_context_mib=OWN_MIB, **kwargs)  # type: ignore[arg-type]


def poll(m: Monitor, t_s: float) -> Reading:
    m.step(t_s)
    reading = m.latest()
    assert reading is not None
    return reading


# --- a quiet GPU --------------------------------------------------------------------------------------


def test_quiet_gpu_has_no_verdict() -> None:
    probe = FakeProbe(samples=[UtilSample(0.9, 0.5)], memory_mib=OWN_MIB + 20, procs=[own_proc()],
                      power=300.0, temperature=55.0, energy=12345.5)
    r = poll(monitor(probe, baseline_mib=20.0), 1.0)
    assert r.reason is None and not r.foreign
    assert r.signals == ()
    assert r.foreign_pids == ()
    assert r.own_mem_mib == OWN_MIB
    assert r.foreign_mem_mib == 0.0
    assert r.power_w == 300.0 and r.temperature_c == 55.0 and r.energy_j == 12345.5


# --- process signal -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("procs", "fires", "pids"), [
    ([own_proc()], False, ()),
    ([], False, ()),
    (UNSUPPORTED, False, ()),
    ([own_proc(), GpuProcess(4242, 900.0)], True, (4242,)),
    ([GpuProcess(4242, None)], True, (4242,)),  # a foreign process whose memory NVML hides
    ([GpuProcess(9, 1.0), own_proc(), GpuProcess(7, 1.0)], True, (7, 9)),
])
def test_process_signal(procs: list[GpuProcess] | None, fires: bool, pids: tuple[int, ...]) -> None:
    r = poll(monitor(FakeProbe(procs=procs)), 1.0)
    assert ("process" in r.signals) is fires
    assert r.foreign_pids == pids
    if fires:
        assert r.reason is not None
        assert all(str(pid) in r.reason for pid in pids)
        assert str(OWN_PID) not in r.reason
    else:
        assert r.reason is None


def test_process_list_can_be_ignored() -> None:
    probe = FakeProbe(procs=[own_proc(), GpuProcess(4242, 900.0)])
    r = poll(monitor(probe, thresholds=Thresholds(use_process_list=False)), 1.0)
    assert r.signals == ()
    assert r.reason is None
    assert r.foreign_pids == (4242,)  # still reported, just not a verdict


# --- memory signal ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("used_mib", "fires"), [
    (OWN_MIB + 100 + 0, False),
    (OWN_MIB + 100 + 63, False),
    (OWN_MIB + 100 + 64, False),  # the threshold itself is not "beyond"
    (OWN_MIB + 100 + 65, True),
    (OWN_MIB + 100 + 2048, True),
])
def test_memory_signal(used_mib: float, fires: bool) -> None:
    probe = FakeProbe(memory_mib=used_mib, procs=[own_proc()])
    r = poll(monitor(probe, baseline_mib=100.0, thresholds=Thresholds(mem_mib=64.0)), 1.0)
    assert ("memory" in r.signals) is fires
    assert r.foreign_mem_mib == pytest.approx(used_mib - OWN_MIB - 100)
    if fires:
        assert r.reason is not None and "MiB" in r.reason
        assert f"{used_mib - OWN_MIB - 100:.0f} MiB" in r.reason


def test_memory_signal_uses_own_memory_from_the_process_list() -> None:
    # Our process holds 800 MiB, not the 500 MiB fallback: 800 + 100 baseline + 40 is not foreign.
    probe = FakeProbe(memory_mib=940.0, procs=[own_proc(800.0)])
    r = poll(monitor(probe, baseline_mib=100.0), 1.0)
    assert r.own_mem_mib == 800.0
    assert r.signals == ()


def test_own_memory_is_never_less_than_what_our_context_added_to_the_device() -> None:
    # The process list under-counts us (100 MiB) next to the 500 MiB our context added at start: trusting it
    # would call 400 MiB of our own foreign on every poll, for ever.
    probe = FakeProbe(memory_mib=OWN_MIB + 100, procs=[own_proc(100.0)])
    m = monitor(probe, baseline_mib=100.0)
    for t_s in (1.0, 1.1, 5.0):
        r = poll(m, t_s)
        assert r.signals == (), r.reason
    assert r.own_mem_mib == OWN_MIB
    assert r.own_mem_process_mib == 100.0


def test_memory_signal_uses_fallback_own_memory_without_process_list() -> None:
    probe = FakeProbe(memory_mib=OWN_MIB + 100 + 200, procs=UNSUPPORTED)
    r = poll(monitor(probe, baseline_mib=100.0), 1.0)
    assert r.own_mem_mib == OWN_MIB
    assert r.signals == ("memory",)


def test_memory_unsupported_degrades_to_other_signals() -> None:
    probe = FakeProbe(memory_mib=UNSUPPORTED, procs=[own_proc(), GpuProcess(5, 10.0)])
    r = poll(monitor(probe, baseline_mib=100.0), 1.0)
    assert r.memory_used_mib is None and r.foreign_mem_mib is None
    assert r.signals == ("process",)


def test_memory_baseline_comes_down_and_never_goes_up() -> None:
    # Started while a job held 1000 MiB: the baseline came out too high.
    probe = FakeProbe(memory_mib=OWN_MIB + 1000, procs=[own_proc()])
    m = monitor(probe, baseline_mib=1000.0)
    assert poll(m, 0.1).signals == ()
    probe.memory_mib = OWN_MIB + 100  # that job left
    r = poll(m, 0.2)
    assert m.baseline_mem_mib == 100.0
    assert r.foreign_mem_mib == 0.0
    probe.memory_mib = OWN_MIB + 100 + 50
    assert poll(m, 0.3).signals == ()
    probe.memory_mib = OWN_MIB + 1000  # the same job again: now it is seen
    r = poll(m, 0.4)
    assert m.baseline_mem_mib == 100.0
    assert r.signals == ("memory",)
    assert r.foreign_mem_mib == 900.0


# --- utilization signal -------------------------------------------------------------------------------


@pytest.mark.parametrize(("ratios", "fired_at"), [
    ([0.5, 0.5, 0.5], [False, True, True]),
    ([0.5, 0.05, 0.5, 0.5], [False, False, False, True]),
    ([0.5, 0.05, 0.5, 0.05, 0.5], [False] * 5),
    ([0.11, 0.11], [False, True]),
    ([0.1, 0.1, 0.1], [False, False, False]),  # at the threshold is not beyond it
    ([0.0, 0.0, 0.0], [False, False, False]),
])
def test_utilization_signal_needs_consecutive_samples(ratios: list[float], fired_at: list[bool]) -> None:
    probe = FakeProbe()
    m = monitor(probe, thresholds=Thresholds(util_ratio=0.1, util_samples=2))
    fired = []
    for k, ratio in enumerate(ratios):
        t = 0.5 * (k + 1)
        probe.samples = [UtilSample(t, ratio)]
        r = poll(m, t + 0.01)
        assert [s.t_s for s in r.samples] == [t]
        fired.append("utilization" in r.signals)
    assert fired == fired_at


def test_utilization_count_of_three() -> None:
    probe = FakeProbe()
    m = monitor(probe, thresholds=Thresholds(util_samples=3))
    fired = []
    for k in range(4):
        probe.samples = [UtilSample(0.5 * (k + 1), 0.6)]
        fired.append("utilization" in poll(m, 0.5 * (k + 1) + 0.01).signals)
    assert fired == [False, False, True, True]


def test_two_samples_over_in_one_poll_fire_at_once() -> None:
    probe = FakeProbe(samples=[UtilSample(0.5, 0.6), UtilSample(1.0, 0.7)])
    r = poll(monitor(probe, thresholds=Thresholds(util_samples=2)), 1.05)
    assert r.signals == ("utilization",)
    assert r.reason is not None
    assert "0.70" in r.reason and "2 samples" in r.reason


def test_an_under_sample_in_the_same_poll_resets_the_count() -> None:
    probe = FakeProbe(samples=[UtilSample(0.5, 0.6), UtilSample(1.0, 0.6), UtilSample(1.5, 0.0)])
    r = poll(monitor(probe, thresholds=Thresholds(util_samples=2)), 1.55)
    assert r.signals == ()


def test_utilization_signal_holds_between_samples() -> None:
    """A poll with no new sample keeps the verdict of the last ones (the job is still there)."""
    probe = FakeProbe(samples=[UtilSample(0.5, 0.6), UtilSample(1.0, 0.6)])
    m = monitor(probe)
    assert poll(m, 1.05).signals == ("utilization",)
    r = poll(m, 1.15)
    assert r.samples == ()
    assert r.signals == ("utilization",)


def test_own_share_comes_from_the_busy_log() -> None:
    log = BusyLog()
    # Windows of 0.5 s ending at 0.5, 1.0, 1.5, 2.0; our kernels fill [1.0, 1.4) and [1.5, 1.8).
    log.add(1.0, 1.4)
    log.add(1.5, 1.8)
    probe = FakeProbe(samples=[UtilSample(0.5, 0.0), UtilSample(1.0, 0.0)])
    m = monitor(probe, busy_log=log)
    poll(m, 1.01)
    assert m.window_s == pytest.approx(0.5)
    probe.samples = [UtilSample(1.5, 0.85), UtilSample(2.0, 0.65)]
    r = poll(m, 2.01)
    assert [s.own_ratio for s in r.samples] == pytest.approx([0.8, 0.6])
    assert [s.foreign_ratio for s in r.samples] == pytest.approx([0.05, 0.05])
    assert r.signals == ()  # our own load is not foreign


def test_foreign_beyond_own_share_fires() -> None:
    log = BusyLog()
    for k in range(20):
        log.add(0.5 * k, 0.5 * k + 0.25)  # we are busy 50 % of every 0.5-s window
    probe = FakeProbe(samples=[UtilSample(0.5 * k, 0.5) for k in range(1, 5)])
    m = monitor(probe, busy_log=log)
    assert poll(m, 2.01).signals == ()
    probe.samples = [UtilSample(2.5, 0.75), UtilSample(3.0, 0.8)]  # a job adds 0.25-0.3 beyond ours
    r = poll(m, 3.01)
    assert r.signals == ("utilization",)
    assert [s.foreign_ratio for s in r.samples] == pytest.approx([0.25, 0.3])


def test_foreign_ratio_never_negative() -> None:
    log = BusyLog()
    log.add(0.0, 1.0)
    probe = FakeProbe(samples=[UtilSample(0.5, 0.9), UtilSample(1.0, 0.9)])
    r = poll(monitor(probe, busy_log=log), 1.01)
    assert [s.own_ratio for s in r.samples] == [1.0, 1.0]
    assert [s.foreign_ratio for s in r.samples] == [0.0, 0.0]


def test_samples_held_back_until_the_busy_log_covers_them() -> None:
    log = BusyLog()
    log.mark_complete_until(1.0)
    probe = FakeProbe(samples=[UtilSample(0.5, 0.6), UtilSample(1.0, 0.6), UtilSample(1.5, 0.6)])
    m = monitor(probe, busy_log=log, complete=False)
    r = poll(m, 1.6)
    assert [s.t_s for s in r.samples] == [0.5, 1.0]
    log.add(1.0, 1.5)  # a kernel of ours that was still running: the 1.5-s window is ours after all
    log.mark_complete_until(1.5)
    r = poll(m, 1.7)
    assert [s.t_s for s in r.samples] == [1.5]
    assert r.samples[0].own_ratio == pytest.approx(1.0)
    assert r.samples[0].foreign_ratio == 0.0
    assert r.signals == ()  # the count restarted at the 1.5-s sample, which was ours


def test_nothing_is_judged_before_the_busy_log_is_complete() -> None:
    log = BusyLog()
    probe = FakeProbe(samples=[UtilSample(0.5, 0.9), UtilSample(1.0, 0.9)])
    m = monitor(probe, busy_log=log, complete=False)
    r = poll(m, 1.1)
    assert r.samples == () and r.signals == ()
    log.mark_complete_until(1.1)
    r = poll(m, 1.2)
    assert len(r.samples) == 2 and r.signals == ("utilization",)


# --- history from before we started --------------------------------------------------------------------


def test_history_from_before_start_is_not_judged_but_teaches_the_window() -> None:
    # NVML's buffer holds ~15 s from before our context existed (a predecessor's filling, say): our share of
    # it reads 0, so judging it would yield at once.
    history = [UtilSample(85.0 + k * 0.2, 0.8) for k in range(76)]  # up to 100.0, every 0.2 s
    probe = FakeProbe(samples=history)
    m = monitor(probe, start_s=100.0)
    r = poll(m, 100.0)
    assert r.samples == () and r.signals == ()
    assert m.window_s == pytest.approx(0.2)
    probe.samples = history + [UtilSample(100.1, 0.8), UtilSample(100.3, 0.8), UtilSample(100.5, 0.8)]
    r = poll(m, 100.6)
    # 100.1 covers 99.9-100.1, partly before the start: not judged either; the two after it are.
    assert [s.t_s for s in r.samples] == [100.3, 100.5]
    assert r.signals == ("utilization",)


# --- fallbacks and the sample window --------------------------------------------------------------------


def test_fallback_to_utilization_ratio_when_samples_unsupported() -> None:
    probe = FakeProbe(samples=UNSUPPORTED, util_ratio=0.3)
    m = monitor(probe)
    r = poll(m, 1.0)
    assert [(s.t_s, s.util_ratio) for s in r.samples] == [(1.0, 0.3)]
    assert m.window_s == DEFAULT_WINDOW_S
    # Not again before a window has passed ...
    r = poll(m, 1.1)
    assert r.samples == ()
    # ... then every window.
    probe.util_ratio = 0.4
    r = poll(m, 1.0 + DEFAULT_WINDOW_S + 0.01)
    assert [s.util_ratio for s in r.samples] == [0.4]


def test_fallback_feeds_the_utilization_signal() -> None:
    probe = FakeProbe(samples=UNSUPPORTED, util_ratio=0.7)
    m = monitor(probe)
    assert poll(m, 1.0).signals == ()
    assert poll(m, 1.2).signals == ("utilization",)


def test_both_utilization_queries_unsupported() -> None:
    probe = FakeProbe(samples=UNSUPPORTED, util_ratio=UNSUPPORTED, procs=[own_proc(), GpuProcess(3, 1.0)])
    r = poll(monitor(probe), 1.0)
    assert r.samples == ()
    assert r.signals == ("process",)


def test_idle_gpu_with_no_buffered_samples_falls_back_after_a_while() -> None:
    probe = FakeProbe(samples=[UtilSample(1.0, 0.0)], util_ratio=0.0)
    m = monitor(probe)
    assert len(poll(m, 1.01).samples) == 1
    probe.samples = []  # the driver buffers nothing while idle
    calls = probe.util_ratio_calls
    assert poll(m, 2.0).samples == ()
    assert probe.util_ratio_calls == calls  # still within FALLBACK_AFTER_S of the last sample
    r = poll(m, 1.0 + FALLBACK_AFTER_S + 0.01)
    assert probe.util_ratio_calls == calls + 1
    assert [s.util_ratio for s in r.samples] == [0.0]


@pytest.mark.parametrize("spacing_s", [1 / 6, 0.2, 0.5, 1.0])
def test_window_estimated_from_sample_spacing(spacing_s: float) -> None:
    probe = FakeProbe(samples=[UtilSample(10 + k * spacing_s, 0.1) for k in range(6)])
    m = monitor(probe)
    assert m.window_s == DEFAULT_WINDOW_S
    r = poll(m, 20.0)
    assert m.window_s == pytest.approx(spacing_s)
    assert r.window_s == pytest.approx(spacing_s)


def test_window_estimate_survives_a_missed_sample() -> None:
    times = [0.2, 0.4, 0.6, 1.0, 1.2, 1.4]  # 0.8 missing
    m = monitor(FakeProbe(samples=[UtilSample(t, 0.1) for t in times]))
    poll(m, 2.0)
    assert m.window_s == pytest.approx(0.2)


def test_window_estimate_spans_polls() -> None:
    probe = FakeProbe(samples=[UtilSample(0.5, 0.1)])
    m = monitor(probe)
    poll(m, 0.6)
    probe.samples = [UtilSample(0.5, 0.1), UtilSample(1.0, 0.1)]
    poll(m, 1.1)
    assert m.window_s == pytest.approx(0.5)


# --- reasons, readings, schedule ------------------------------------------------------------------------


def test_reason_names_every_signal_that_fired() -> None:
    probe = FakeProbe(samples=[UtilSample(0.5, 0.9), UtilSample(1.0, 0.9)], memory_mib=OWN_MIB + 3000,
                      procs=[own_proc(), GpuProcess(31337, 3000.0)])
    r = poll(monitor(probe), 1.05)
    assert r.signals == ("process", "memory", "utilization")
    assert r.reason is not None
    parts = r.reason.split("; ")
    assert len(parts) == 3
    assert "process" in parts[0] and "31337" in parts[0]
    assert "3000 MiB" in parts[1]
    assert "utilization" in parts[2] and "0.90" in parts[2]


def test_process_reason_lists_at_most_five_pids() -> None:
    probe = FakeProbe(procs=[GpuProcess(1000 + k, 1.0) for k in range(8)])
    r = poll(monitor(probe), 1.0)
    assert r.reason is not None
    assert "1004" in r.reason and "1005" not in r.reason
    assert len(r.foreign_pids) == 8


def test_step_returns_due_times_on_a_fixed_grid() -> None:
    m = monitor(FakeProbe(), poll_interval_s=0.25)
    assert m.step(10.0) == 10.25
    assert m.step(10.25) == 10.5
    assert m.step(10.3) == 10.5  # early: the same slot
    assert m.step(10.6) == 10.75  # late: the grid does not shift
    assert m.step(11.6) == 11.75  # missed slots are skipped, not caught up
    assert m.step(11.75) == 12.0


def test_readings_are_numbered_and_published() -> None:
    calls: list[int] = []
    m = monitor(FakeProbe(), on_reading=lambda: calls.append(1))
    assert m.latest() is None
    seqs = [poll(m, 0.1 * k).seq for k in range(1, 4)]
    assert seqs == [1, 2, 3]
    assert len(calls) == 3
    assert m.latest() is not None and m.latest().t_s == pytest.approx(0.3)  # type: ignore[union-attr]


def test_run_thread_records_gpu_failure_and_stops() -> None:
    probe = FakeProbe(fail_with=GpuFailedError("GPU is lost"))
    called = threading.Event()
    m = monitor(probe, on_reading=called.set)
    m.run(lambda: 0.0, threading.Event())  # returns: the failure ends the loop
    assert isinstance(m.failure, GpuFailedError)
    assert called.is_set()


def test_run_thread_records_any_crash_and_stops() -> None:
    # A bug in a poll must not end the thread silently while the filler goes on with stale readings.
    probe = FakeProbe(fail_with=ZeroDivisionError("division by zero"))
    called = threading.Event()
    m = monitor(probe, on_reading=called.set)
    m.run(lambda: 0.0, threading.Event())
    assert isinstance(m.failure, ZeroDivisionError)
    assert called.is_set()


def test_run_thread_stops_when_asked() -> None:
    stop = threading.Event()
    clock = [0.0]
    m = monitor(FakeProbe(), on_reading=stop.set)
    m.run(lambda: clock[0], stop)
    assert m.failure is None
    assert m.latest() is not None


def test_the_signals_are_a_list_the_monitor_is_given() -> None:
    def many_processes(seen: Observation, limits: Thresholds) -> str | None:
        return "crowded" if len(seen.foreign_pids) >= 2 else None

    probe = FakeProbe(procs=[own_proc(), GpuProcess(5, 1.0), GpuProcess(6, 1.0)])
    r = poll(monitor(probe, signals=[("crowded", many_processes)]), 1.0)
    assert r.signals == ("crowded",) and r.reason == "crowded"


@pytest.mark.parametrize("window_s", [1 / 6, 0.5, 1.0])
def test_the_sample_buffer_is_asked_about_once_per_window_and_no_sample_is_late(window_s: float) -> None:
    # Every query costs CPU (docs/design.md §7): polls every 0.1 s ask the buffer only when a sample can be there,
    # and each sample still comes with the first poll at or after its stamp.
    stamps = [k * window_s for k in range(1, int(30 / window_s) + 1)]
    probe = FakeProbe(samples=[])
    m = monitor(probe)
    seen_at: dict[float, float] = {}
    for k in range(1, 301):
        now_s = k / 10
        probe.samples = [UtilSample(t, 0.1) for t in stamps if t <= now_s + 1e-9]
        for sample in poll(m, now_s).samples:
            seen_at[sample.t_s] = now_s
    assert m.window_s == pytest.approx(window_s)
    assert all(seen_at[t] - t < 0.1 + 1e-9 for t in stamps if t > 2 * window_s)  # none waits past one poll
    learning = 2 * window_s / 0.1  # every poll asks until two samples have taught the window
    assert probe.samples_calls <= 30 / window_s + learning + 5, probe.samples_calls  # not one per poll (300)


# --- waking the reader --------------------------------------------------------------------------------------------


def test_while_the_reader_fills_only_a_changed_verdict_wakes_it_and_take_keeps_every_sample() -> None:
    woken: list[int] = []
    probe = FakeProbe(memory_mib=OWN_MIB, procs=[own_proc()])
    m = monitor(probe, on_reading=lambda: woken.append(1))
    poll(m, 0.0)
    assert m.woke and len(woken) == 1  # the first reading always
    m.wake_every_reading = False  # the filler says so while it fills
    probe.samples = [UtilSample(0.05, 0.0)]
    poll(m, 0.1)
    probe.samples = [UtilSample(0.05, 0.0), UtilSample(0.2167, 0.0)]
    poll(m, 0.3)
    assert len(woken) == 1 and not m.woke  # new samples, same verdict: no wake-up
    taken = m.take()
    assert taken is not None and [s.t_s for s in taken.samples] == [0.05, 0.2167]  # both readings' samples
    assert m.take() is taken  # taken once: the same reading again, no sample twice
    probe.procs = [own_proc(), GpuProcess(999, 300.0)]
    probe.memory_mib = OWN_MIB + 300.0
    reading = poll(m, 0.4)
    assert m.woke and len(woken) == 2 and reading.foreign  # a job: at once
    poll(m, 0.5)
    assert len(woken) == 2  # still foreign: nothing new
    m.wake_every_reading = True  # yielding: every reading may end the wait
    poll(m, 0.6)
    assert len(woken) == 3
