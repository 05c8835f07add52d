"""forge_load.gpu.launcher without a GPU: the event timeline's arithmetic, and finding the CUDA device by UUID.

The CUDA side itself runs on the virtual GPU (tests/test_vgpu_*.py) and on a real one (tests/test_gpu.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from forge_load.control.probe import NoGpuError
from forge_load.gpu.launcher import EventTimeline, find_device, uuid_text


@dataclass(frozen=True)
class Event:
    """A completed CUDA event: when the GPU reached it, on the GPU's own clock (seconds)."""

    gpu_s: float


def elapsed_ms(a: Event, b: Event) -> float:
    """As cuEventElapsedTime: float32 milliseconds."""
    return float(np.float32((b.gpu_s - a.gpu_s) * 1e3))


GPU_MINUS_HOST_S = 5000.0  # the GPU's event clock is unrelated to ours


def gpu(host_s: float) -> Event:
    return Event(host_s + GPU_MINUS_HOST_S)


def run(timeline: EventTimeline, end_s: float, returned_s: float, now_s: float, multiplier: int = 8,
        call_s: float = 3e-5, count: int = 1, first_end_s: float | None = None) -> tuple[float, float]:
    """One burst of `count` kernels: its first launch call took `call_s` and returned at `returned_s`; its
    first kernel ended at `first_end_s` (bursts of two or more), its last at `end_s`, seen at `now_s`."""
    first = gpu(first_end_s) if first_end_s is not None else None
    start_s, end_s, _kernel_s = timeline.finish(timeline.launched(), first, gpu(end_s), multiplier, count,
                                                returned_s - call_s, returned_s, now_s)
    return start_s, end_s


def test_a_burst_on_an_idle_stream_is_measured_by_its_two_events() -> None:
    # Four 2-ms kernels: the events after the first and after the last measure the three behind the first
    # exactly, which places the first one's start (inside its 30-µs launch call) at its end minus 2 ms.
    timeline = EventTimeline(elapsed_ms)
    timeline.anchor(gpu(10.0), 10.0)
    start_s, end_s = run(timeline, 10.00802, returned_s=10.00003, now_s=10.1, multiplier=160, count=4,
                         first_end_s=10.00202)
    assert (start_s, end_s) == pytest.approx((10.00002, 10.00802), abs=1e-8)
    assert timeline.rate_s == pytest.approx(0.002 / 160)


@pytest.mark.parametrize("skew_s", [-0.0004, 0.0004])
def test_a_kernels_length_is_exact_whatever_the_anchors_error(skew_s: float) -> None:
    # An anchor read early or late (the thread was preempted around the record call) shifts a burst's times;
    # its kernels' length, the difference of two events timed from the same anchor, is exact all the same.
    timeline = EventTimeline(elapsed_ms)
    timeline.anchor(gpu(10.0), 10.0 + skew_s)
    _start, _end, kernel_s = timeline.finish(timeline.launched(), gpu(10.0001), gpu(10.0003), 8, 3, 9.99998,
                                             10.00001, now_s=10.0004)
    assert kernel_s == pytest.approx(0.0001, abs=1e-9)
    assert timeline.rate_s == pytest.approx(0.0001 / 8)


def test_a_burst_queued_behind_another_starts_where_it_ended() -> None:
    timeline = EventTimeline(elapsed_ms)
    timeline.anchor(gpu(10.0), 10.0)
    a, b = timeline.launched(), timeline.launched()  # both queued at once
    first = timeline.finish(a, gpu(10.002), gpu(10.006), 160, 3, 10.0, 10.00001, now_s=10.1)
    second = timeline.finish(b, gpu(10.008), gpu(10.010), 160, 2, 10.00002, 10.00003, now_s=10.1)
    assert first[2] == pytest.approx(0.002) and second[2] == pytest.approx(0.002)
    assert second[0] == pytest.approx(first[1]) == pytest.approx(10.006)
    assert second[1] == pytest.approx(10.010)


def test_a_single_kernel_on_an_idle_stream_gets_the_measured_rate_times_its_size() -> None:
    timeline = EventTimeline(elapsed_ms)
    timeline.anchor(gpu(1.0), 1.0)
    run(timeline, 1.00023, returned_s=1.00003, now_s=1.1, multiplier=8, count=3, first_end_s=1.00009)
    assert timeline.rate_s == pytest.approx(0.00007 / 8)
    # Half the size: 35 µs, ending 100 µs after its call returned.
    assert run(timeline, 2.00013, returned_s=2.00003, now_s=2.1, multiplier=4) == pytest.approx((2.000095, 2.00013))
    # Never earlier than the call: a kernel cannot start before it was launched.
    assert run(timeline, 3.00005, returned_s=3.00003, now_s=3.1, multiplier=8, call_s=1e-5) == pytest.approx(
        (3.00002, 3.00005))


def test_before_any_measurement_a_kernel_starts_when_its_launch_returned_not_at_the_anchor() -> None:
    # The anchor (like a start event) completes at once, 30 µs before the kernel was even launched: starting
    # the kernel there would read our busy time high.
    timeline = EventTimeline(elapsed_ms)
    timeline.anchor(gpu(20.0), 20.0)
    start_s, end_s = run(timeline, 20.0 + 0.00003 + 0.0001, returned_s=20.00003, now_s=20.1)
    assert (start_s, end_s) == pytest.approx((20.00003, 20.00013), abs=1e-9)
    assert timeline.rate_s is None  # one kernel alone measures nothing exactly


def test_a_burst_after_an_idle_gap_gets_a_fresh_anchor() -> None:
    timeline = EventTimeline(elapsed_ms)
    timeline.anchor(gpu(1.0), 1.0)
    run(timeline, 1.002, 1.00001, now_s=1.1)
    assert timeline.wants_anchor(3.0)  # a second after the anchor: take a fresh one
    timeline.anchor(gpu(3.0), 3.0)
    assert not timeline.wants_anchor(3.5)
    assert run(timeline, 3.004, 3.00001, now_s=3.1, multiplier=8, count=2, first_end_s=3.002005) == pytest.approx(
        (3.00001, 3.004), abs=1e-8)


def test_bursts_in_flight_stay_timed_from_the_anchor_of_their_launch() -> None:
    # A fresh anchor while a burst is queued: the burst ends before the new anchor was recorded, so timing
    # it from the new one would need a negative elapsed time; it keeps its own.
    timeline = EventTimeline(elapsed_ms)
    first = gpu(1.0)
    timeline.anchor(first, 1.0)
    queued = timeline.launched()
    retired = timeline.anchor(gpu(2.5), 2.5)
    assert retired is None  # still in use: its event must not be recorded again yet
    assert queued.event is first
    assert timeline.finish(queued, None, gpu(2.4), 8, 1, 1.0, 1.00001, now_s=2.6)[:2] == pytest.approx((1.00001, 2.4))
    assert queued.users == 0
    assert timeline.anchor(gpu(4.0), 4.0) is not None  # the 2.5-s one, which no burst used


def test_an_end_is_never_later_than_when_its_event_was_seen_complete() -> None:
    timeline = EventTimeline(elapsed_ms)
    timeline.anchor(gpu(1.0), 1.0005)  # the anchor's host time read 0.5 ms late
    start_s, end_s = run(timeline, 1.002, returned_s=1.0006, now_s=1.0021, count=2, first_end_s=1.0011)
    assert end_s == 1.0021
    assert start_s <= end_s
    assert timeline.rate_s is not None and timeline.rate_s >= 0


def test_hours_of_bursts_keep_sub_microsecond_precision() -> None:
    # float32 milliseconds from one anchor would be off by ~0.2 ms after two hours; chaining each end from
    # the one before would add each reading's rounding. Fresh anchors keep every end exact.
    timeline = EventTimeline(elapsed_ms)
    period_s = 1 / 6
    worst_s = 0.0
    t_s = 0.0
    for _ in range(int(7200 / period_s) // 7):  # every 7th burst of two hours, launched 80 ms ahead
        t_s += 7 * period_s
        if timeline.wants_anchor(t_s - 0.08):  # the launcher asks at each launch
            timeline.anchor(gpu(t_s - 0.08), t_s - 0.08)
        _start_s, end_s = run(timeline, t_s, returned_s=t_s - 0.08, now_s=t_s + 1.0, count=8,
                              first_end_s=t_s - 0.07)
        worst_s = max(worst_s, abs(end_s - t_s))
    assert worst_s < 1e-6


def test_a_launch_before_any_anchor_is_a_bug() -> None:
    with pytest.raises(RuntimeError):
        EventTimeline(elapsed_ms).launched()


# --- finding the device -----------------------------------------------------------------------------------


def cuda_sees(uuids: list[str]) -> list[tuple[int, str]]:
    """What cuda_devices gives: (CUDA ordinal, UUID) of each device CUDA sees."""
    return list(enumerate(uuids))


UUID_A = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
UUID_B = "GPU-bbbbbbbb-1111-2222-3333-444444444444"


def test_the_cuda_device_is_found_by_uuid_whatever_its_cuda_number() -> None:
    # CUDA_VISIBLE_DEVICES=1: NVML still numbers the GPU 1, CUDA calls it 0.
    assert find_device(cuda_sees([UUID_B]), UUID_B) == 0
    assert find_device(cuda_sees([UUID_B, UUID_A]), UUID_A) == 1


def test_a_mig_instance_is_found_by_its_uuid() -> None:
    mig = "MIG-cccccccc-1111-2222-3333-444444444444"
    assert find_device(cuda_sees(["GPU-cccccccc-1111-2222-3333-444444444444"]), mig) == 0


def test_a_gpu_cuda_does_not_see_is_no_gpu_naming_what_it_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(NoGpuError, match=f"{UUID_A}.*CUDA_VISIBLE_DEVICES=1.*0 {UUID_B}"):
        find_device(cuda_sees([UUID_B]), UUID_A)


def test_cudas_uuid_bytes_read_as_nvml_writes_them() -> None:
    raw = bytes.fromhex("aaaaaaaa111122223333444444444444")
    assert uuid_text(raw) == UUID_A
