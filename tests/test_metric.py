"""FORGE_METRIC in this process: the quantities the target can be a target of (control/quantity.py), GPM's
readings in the Monitor (its own share of each span, the utilization signal's input where NVML has none), the
setting and its cross-check. On the virtual GPU: tests/test_metric_vgpu.py."""

from __future__ import annotations

import dataclasses

import pytest

from forge_load.config.load import load_config
from forge_load.config.settings import METRIC_NAMES
from forge_load.config.values import ConfigError
from forge_load.control.detectors import Thresholds
from forge_load.control.monitor import Monitor
from forge_load.control.probe import Activity, DeviceInfo
from forge_load.control.quantity import GR_ACTIVITY, NEEDS_GPM, QUANTITIES, SM_ACTIVITY, UTILIZATION
from forge_load.control.worker import BusyLog
from forge_load.service.runtime import metric_refusal
from tests.test_monitor import OWN_MIB, FakeProbe, monitor, own_proc, poll

GPM_INFO = dataclasses.replace(FakeProbe().info, gpm=True)


@dataclasses.dataclass
class GpmProbe(FakeProbe):
    """A fake GPU with GPM: `gpm` holds (sm, gr) ratios, one per activity() call after the first."""

    gpm: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    now_s: float = 0.0
    calls: int = 0
    last_s: float | None = None

    def activity(self) -> Activity | None:
        self.calls += 1
        before, self.last_s = self.last_s, self.now_s
        if before is None or not self.gpm:
            return None
        sm, gr = self.gpm.pop(0)
        return Activity(self.now_s, self.now_s - before, sm, gr)


def test_every_metric_name_is_a_quantity_and_the_gpm_ones_are_known() -> None:
    assert tuple(QUANTITIES) == METRIC_NAMES
    assert NEEDS_GPM == {"sm_activity", "gr_activity"} and UTILIZATION.name not in NEEDS_GPM


def test_the_monitor_reads_gpm_at_most_every_0_19_s_and_splits_each_span_into_ours() -> None:
    busy = BusyLog()
    busy.add(0.0, 0.1)  # ours: half of [0, 0.2), half of [0.2, 0.4)
    busy.add(0.2, 0.3)
    busy.mark_complete_until(1e9)
    probe = GpmProbe(samples=None, memory_mib=OWN_MIB, procs=[own_proc()], info=GPM_INFO,
                     gpm=[(0.45, 0.5), (0.48, 0.5)])
    m = monitor(probe, busy_log=busy, start_s=0.0)
    got = []
    for t in (0.0, 0.1, 0.2, 0.3, 0.4):
        probe.now_s = t
        got.extend(poll(m, t).activity)
    assert probe.calls == 3  # at 0.0, 0.2 and 0.4: NVML asks for samples more than 0.1 s apart
    assert [(a.t_s, a.span_s, a.sm_ratio, a.gr_ratio) for a in got] == [(0.2, 0.2, 0.45, 0.5), (0.4, 0.2, 0.48, 0.5)]
    assert [a.own_ratio for a in got] == pytest.approx([0.5, 0.5])
    reading = poll(m, 0.5)
    assert SM_ACTIVITY.samples(dataclasses.replace(reading, activity=tuple(got)))[0].ratio == 0.45
    assert GR_ACTIVITY.samples(dataclasses.replace(reading, activity=tuple(got)))[1].ratio == 0.5


def test_where_nvml_has_no_utilization_gpm_feeds_the_utilization_signal() -> None:
    busy = BusyLog()
    for k in range(10):  # ours: half of every 0.2-s span
        busy.add(0.2 * k, 0.2 * k + 0.1)
    busy.mark_complete_until(1e9)
    probe = GpmProbe(samples=None, memory_mib=OWN_MIB, procs=[own_proc()], info=GPM_INFO,
                     gpm=[(0.5, 0.5), (0.5, 0.5), (0.9, 0.95), (0.9, 0.95), (0.9, 0.95)])
    m = monitor(probe, busy_log=busy, start_s=0.0)
    seen = []
    for k in range(6):
        probe.now_s = 0.2 * k
        seen.append(poll(m, 0.2 * k).signals)
    assert seen[:3] == [(), (), ()]  # GPM's activity is our own: nothing foreign
    assert "utilization" in seen[4]  # 0.45 beyond our 0.5 for FORGE_FOREIGN_SAMPLES (2) spans
    assert "utilization" not in m.sight()[1]  # not blind: GPM stands in for NVML's utilization


def polls(probe: GpmProbe, m: Monitor, count: int) -> list[tuple[str, ...]]:
    """The signals of `count` polls 0.2 s apart (one GPM reading each, after the first)."""
    seen = []
    for k in range(count):
        probe.now_s = 0.2 * k
        seen.append(poll(m, 0.2 * k).signals)
    return seen


def half_busy() -> BusyLog:
    busy = BusyLog()
    for k in range(20):  # ours: half of every 0.2-s span
        busy.add(0.2 * k, 0.2 * k + 0.1)
    busy.mark_complete_until(1e9)
    return busy


def test_where_gpm_is_there_foreign_sm_activity_is_a_signal_of_its_own() -> None:
    # NVML's utilization shows only ours, GRAPHICS_UTIL too: only SM activity sees the job (its kernels spread
    # over SMs ours leave idle, or overlap ours in time)
    probe = GpmProbe(samples=[], memory_mib=OWN_MIB, procs=[own_proc()], info=GPM_INFO,
                     gpm=[(0.5, 0.5), (0.5, 0.5), (0.8, 0.5), (0.8, 0.5), (0.8, 0.5)])
    m = monitor(probe, busy_log=half_busy(), start_s=0.0)
    seen = polls(probe, m, 5)
    assert seen[:4] == [(), (), (), ()]  # our own, then one reading over: FORGE_FOREIGN_SAMPLES is 2
    assert seen[4] == ("sm_activity",)
    latest = m.latest()
    assert latest is not None and latest.reason == "SM activity 0.80 beyond our own 0.50 for 2 GPM readings"
    assert m.sight() == (("process", "memory", "utilization", "sm_activity"), {})


@pytest.mark.parametrize("own", [0.5, 0.9])
def test_our_own_sm_activity_never_fires_it_tails_and_jitter_included(own: float) -> None:
    busy = BusyLog()
    for k in range(60):
        busy.add(0.2 * k, 0.2 * k + 0.2 * own)
    busy.mark_complete_until(1e9)
    # Below our busy share (the tails of last waves), at it, and above it by less than FORGE_FOREIGN_UTIL
    readings = [(own - 0.05, own), (own, own), (min(own + 0.08, 1.0), own)] * 15
    probe = GpmProbe(samples=[], memory_mib=OWN_MIB, procs=[own_proc()], info=GPM_INFO, gpm=readings)
    m = monitor(probe, busy_log=busy, start_s=0.0)
    assert set(polls(probe, m, 46)) == {()}


ONE_WARP = 1 / 132  # the lean shape's single warp: one SM of 132 while it runs


def test_a_job_on_the_sms_our_single_warp_leaves_idle_is_seen_by_sm_activity() -> None:
    # Our one warp, half the time: 0.5 of NVML's utilization and of GRAPHICS_UTIL, but 0.5/132 of SM activity. A job
    # whose kernels overlap ours in time on the other SMs adds nothing the time-based readings show; SM activity
    # at 0.25 is far beyond our own 0.004, though below our busy share of 0.5.
    probe = GpmProbe(samples=[], memory_mib=OWN_MIB, procs=[own_proc()], info=GPM_INFO,
                     gpm=[(0.5 * ONE_WARP, 0.5)] * 2 + [(0.25, 0.5)] * 3)
    m = monitor(probe, busy_log=half_busy(), start_s=0.0, own_sm_ratio=ONE_WARP)
    seen = polls(probe, m, 5)
    assert seen[:4] == [(), (), (), ()]
    assert seen[4] == ("sm_activity",)
    latest = m.latest()
    assert latest is not None and latest.reason == "SM activity 0.25 beyond our own 0.00 for 2 GPM readings"


@pytest.mark.parametrize("own", [0.5, 0.9])
def test_our_own_single_warp_never_looks_foreign(own: float) -> None:
    busy = BusyLog()
    for k in range(60):
        busy.add(0.2 * k, 0.2 * k + 0.2 * own)
    busy.mark_complete_until(1e9)
    readings = [(own * ONE_WARP * 0.9, own), (own * ONE_WARP, own), (own * ONE_WARP + 0.08, own)] * 15
    probe = GpmProbe(samples=[], memory_mib=OWN_MIB, procs=[own_proc()], info=GPM_INFO, gpm=readings)
    m = monitor(probe, busy_log=busy, start_s=0.0, own_sm_ratio=ONE_WARP)
    assert set(polls(probe, m, 46)) == {()}


def test_the_sm_activity_signal_takes_the_utilization_thresholds() -> None:
    probe = GpmProbe(samples=[], memory_mib=OWN_MIB, procs=[own_proc()], info=GPM_INFO,
                     gpm=[(0.75, 0.5)] * 5)
    m = monitor(probe, busy_log=half_busy(), start_s=0.0, thresholds=Thresholds(util_ratio=0.3, util_samples=1))
    assert set(polls(probe, m, 6)) == {()}  # 0.25 beyond ours is not beyond FORGE_FOREIGN_UTIL=0.3
    probe = GpmProbe(samples=[], memory_mib=OWN_MIB, procs=[own_proc()], info=GPM_INFO, gpm=[(0.75, 0.5)] * 5)
    m = monitor(probe, busy_log=half_busy(), start_s=0.0, thresholds=Thresholds(util_ratio=0.2, util_samples=1))
    assert polls(probe, m, 2) == [(), ("sm_activity",)]  # the first reading comes at the second poll


def test_on_a_mig_device_sm_activity_and_gpms_utilization_both_judge_gpm() -> None:
    probe = GpmProbe(samples=None, memory_mib=OWN_MIB, procs=[own_proc()], info=GPM_INFO,
                     gpm=[(0.5, 0.5), (0.9, 0.95), (0.9, 0.95), (0.9, 0.95)])
    m = monitor(probe, busy_log=half_busy(), start_s=0.0)
    assert polls(probe, m, 5)[3] == ("utilization", "sm_activity")
    assert m.sight() == (("process", "memory", "utilization", "sm_activity"), {})


def test_without_gpm_sm_activity_is_not_a_signal_nor_a_blind_one() -> None:
    m = monitor(GpmProbe(memory_mib=OWN_MIB, procs=[own_proc()]))
    poll(m, 0.0)
    assert m.sight() == (("process", "memory", "utilization"), {})


def test_without_gpm_the_monitor_never_asks_for_it() -> None:
    probe = GpmProbe(memory_mib=OWN_MIB, procs=[own_proc()])
    m = monitor(probe)
    for t in (0.0, 0.5, 1.0):
        probe.now_s = t
        assert poll(m, t).activity == ()
    assert probe.calls == 0


def test_forge_metric_takes_the_three_names_and_refuses_others_in_one_line() -> None:
    assert load_config([], {}).metric == "utilization"
    assert load_config(["--metric", "sm_activity"], {}).metric == "sm_activity"
    assert load_config([], {"FORGE_METRIC": "gr_activity"}).metric == "gr_activity"
    with pytest.raises(ConfigError) as bad:
        load_config([], {"FORGE_METRIC": "sm_active"})
    assert "FORGE_METRIC" in str(bad.value) and "sm_active" in str(bad.value) and "\n" not in str(bad.value)
    with pytest.raises(ConfigError, match="FORGE_METRIC='sm_activity' is not valid with FORGE_CONTROLLER=legacy"):
        load_config([], {"FORGE_METRIC": "sm_activity", "FORGE_CONTROLLER": "legacy"})


def test_the_refusal_names_the_gpu_and_what_to_do() -> None:
    info = DeviceInfo(1, "GPU-x", "A100", 81559.0, "535", False)
    line = metric_refusal("sm_activity", info)
    assert "\n" not in line and "GPU 1 (GPU-x, A100)" in line and "compute capability 9.0" in line
    assert line.endswith("use FORGE_METRIC=utilization on this GPU")
