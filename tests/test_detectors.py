"""forge_load.control.detectors: each foreign-job signal alone, a pure function of one poll's facts and thresholds."""

from __future__ import annotations

import pytest

from forge_load.config.load import load_config
from forge_load.control.detectors import (
    SIGNALS,
    Observation,
    ShareSample,
    Thresholds,
    memory_signal,
    process_signal,
    sm_activity_signal,
    utilization_signal,
)


def seen(pids: tuple[int, ...] = (), mem_mib: float | None = 0.0, *foreign: float) -> Observation:
    """An observation whose recent windows had these foreign shares (our own share 0.5 in each)."""
    return Observation(pids, mem_mib, tuple(ShareSample(0.1 * k, 0.5 + f, 0.5) for k, f in enumerate(foreign)))


def test_thresholds_are_built_once_from_the_config() -> None:
    config = load_config("--foreign-mem-mib 128 --foreign-util 0.2 --foreign-samples 3 --no-process-list".split(),
                         env={})
    assert Thresholds.from_config(config) == Thresholds(128.0, 0.2, 3, False)


@pytest.mark.parametrize(("pids", "use_list", "fires"), [((), True, False), ((7,), True, True), ((7,), False, False)])
def test_process_signal(pids: tuple[int, ...], use_list: bool, fires: bool) -> None:
    reason = process_signal(seen(pids), Thresholds(use_process_list=use_list))
    assert (reason is not None) is fires
    if fires:
        assert reason == "process 7 on the GPU"


def test_process_signal_names_at_most_five() -> None:
    assert process_signal(seen(tuple(range(1, 9))), Thresholds()) == "process 1,2,3,4,5 on the GPU"


@pytest.mark.parametrize(("mem_mib", "fires"), [(None, False), (0.0, False), (64.0, False), (64.5, True)])
def test_memory_signal(mem_mib: float | None, fires: bool) -> None:
    reason = memory_signal(seen(mem_mib=mem_mib), Thresholds(mem_mib=64.0))
    assert (reason is not None) is fires


@pytest.mark.parametrize(("foreign", "samples", "fires"), [
    ((), 1, False),
    ((0.3,), 1, True),
    ((0.3,), 2, False),
    ((0.3, 0.3), 2, True),
    ((0.3, 0.05, 0.3), 2, False),  # the run is what counts, up to the newest window
    ((0.05, 0.3, 0.3, 0.3), 3, True),
    ((0.1, 0.1), 1, False),  # the threshold itself is not beyond it
])
def test_utilization_signal_needs_a_run_of_windows_over(foreign: tuple[float, ...], samples: int,
                                                        fires: bool) -> None:
    reason = utilization_signal(seen((), 0.0, *foreign), Thresholds(util_ratio=0.1, util_samples=samples))
    assert (reason is not None) is fires


def test_utilization_reason_says_the_newest_window_and_the_run() -> None:
    reason = utilization_signal(seen((), 0.0, 0.05, 0.3, 0.4), Thresholds(util_samples=2))
    assert reason == "utilization 0.90 beyond our own 0.50 for 2 samples"


def test_signals_are_named_and_listed_in_log_order() -> None:
    assert [name for name, _ in SIGNALS] == ["process", "memory", "utilization", "sm_activity"]


@pytest.mark.parametrize(("sm_over_own", "fires"), [
    ((0.3, 0.3), True),
    ((0.3, 0.05, 0.3), False),  # a run, up to the newest reading, as for utilization
    ((0.1, 0.1), False),  # the threshold itself is not beyond it
    ((-0.2, -0.2), False),  # below our own share (the tails of our last waves): never foreign
])
def test_sm_activity_signal_needs_a_run_of_gpm_readings_over_our_own_share(sm_over_own: tuple[float, ...],
                                                                          fires: bool) -> None:
    activity = tuple(ShareSample(0.2 * k, 0.5 + f, 0.5) for k, f in enumerate(sm_over_own))
    observation = Observation((), 0.0, (), activity)
    reason = sm_activity_signal(observation, Thresholds(util_ratio=0.1, util_samples=2))
    assert (reason is not None) is fires
    if fires:
        assert reason == "SM activity 0.80 beyond our own 0.50 for 2 GPM readings"
    assert utilization_signal(observation, Thresholds(util_samples=1)) is None  # each judges its own readings
