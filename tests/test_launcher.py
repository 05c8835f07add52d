"""forge_load.launcher without a GPU: the event timeline's arithmetic, and finding the CUDA device by UUID.

The CUDA side itself runs on the virtual GPU (tests/test_vgpu_*.py) and on a real one (tests/test_gpu.py)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

from forge_load.launcher import EventTimeline, find_device
from forge_load.probe import NoGpuError


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
        call_s: float = 3e-5) -> tuple[float, float]:
    """One kernel: its launch call took `call_s` and returned at `returned_s`; it ended at `end_s`, seen at
    `now_s`."""
    return timeline.finish(timeline.launched(), gpu(end_s), multiplier, returned_s - call_s, returned_s, now_s)


def test_back_to_back_kernels_start_where_the_one_before_ended() -> None:
    timeline = EventTimeline(elapsed_ms)
    timeline.anchor(gpu(10.0), 10.0)
    # Three 2-ms kernels queued at once; their launch calls returned at 10.00002, 10.00004, 10.00006.
    anchors = [timeline.launched() for _ in range(3)]
    times = [t for k, a in enumerate(anchors, 1)
             for t in timeline.finish(a, gpu(10.0 + 0.002 * k), 8, 10.0 + 2e-5 * (k - 1), 10.0 + 2e-5 * k,
                                      now_s=10.1)]
    assert times == pytest.approx([10.00002, 10.002, 10.002, 10.004, 10.004, 10.006], abs=1e-9)
    assert timeline.length_s == {8: pytest.approx(0.002)}  # measured exactly by the queued ones


def test_a_kernel_on_an_idle_stream_gets_the_length_measured_for_its_size() -> None:
    # It started somewhere inside its 30-µs launch call; the kernels queued behind others measured its size
    # at 100 µs, which places its start better than the call's return.
    timeline = EventTimeline(elapsed_ms)
    timeline.anchor(gpu(1.0), 1.0)
    a, b = timeline.launched(), timeline.launched()
    timeline.finish(a, gpu(1.00012), 8, 1.0, 1.00003, now_s=1.1)
    timeline.finish(b, gpu(1.00022), 8, 1.00003, 1.00006, now_s=1.1)
    assert timeline.length_s[8] == pytest.approx(1e-4)
    assert run(timeline, 2.0001, returned_s=2.00003, now_s=2.1) == pytest.approx((2.0, 2.0001), abs=1e-7)
    # Never earlier than the call: a kernel cannot start before it was launched.
    assert run(timeline, 3.00005, returned_s=3.00003, now_s=3.1, call_s=1e-5) == pytest.approx((3.00002, 3.00005))


def test_a_kernel_on_an_idle_stream_starts_when_its_launch_returned_not_at_the_anchor() -> None:
    # The anchor (like a start event) completes at once, 30 µs before the kernel was even launched: starting
    # the kernel there would read our busy time high.
    timeline = EventTimeline(elapsed_ms)
    timeline.anchor(gpu(20.0), 20.0)
    start_s, end_s = run(timeline, 20.0 + 0.00003 + 0.0001, returned_s=20.00003, now_s=20.1)
    assert (start_s, end_s) == pytest.approx((20.00003, 20.00013), abs=1e-9)


def test_a_kernel_after_an_idle_gap_starts_when_its_launch_returned() -> None:
    timeline = EventTimeline(elapsed_ms)
    timeline.anchor(gpu(1.0), 1.0)
    run(timeline, 1.002, 1.00001, now_s=1.1)
    assert timeline.wants_anchor(3.0)  # a second after the anchor: take a fresh one
    timeline.anchor(gpu(3.0), 3.0)
    assert not timeline.wants_anchor(3.5)
    assert run(timeline, 3.002, 3.00001, now_s=3.1) == pytest.approx((3.00001, 3.002), abs=1e-9)


def test_kernels_in_flight_stay_timed_from_the_anchor_of_their_launch() -> None:
    # A fresh anchor while a kernel is queued: the kernel ends before the new anchor was recorded, so timing
    # it from the new one would need a negative elapsed time; it keeps its own.
    timeline = EventTimeline(elapsed_ms)
    first = gpu(1.0)
    timeline.anchor(first, 1.0)
    queued = timeline.launched()
    retired = timeline.anchor(gpu(2.5), 2.5)
    assert retired is None  # still in use: its event must not be recorded again yet
    assert queued.event is first
    assert timeline.finish(queued, gpu(2.4), 8, 1.0, 1.00001, now_s=2.6) == pytest.approx((1.00001, 2.4))
    assert queued.users == 0
    assert timeline.anchor(gpu(4.0), 4.0) is not None  # the 2.5-s one, which no kernel used


def test_an_end_is_never_later_than_when_its_event_was_seen_complete() -> None:
    timeline = EventTimeline(elapsed_ms)
    timeline.anchor(gpu(1.0), 1.0005)  # the anchor's host time read 0.5 ms late
    start_s, end_s = run(timeline, 1.002, returned_s=1.0006, now_s=1.0021)
    assert end_s == 1.0021
    assert start_s <= end_s


def test_hours_of_kernels_keep_sub_microsecond_precision() -> None:
    # float32 milliseconds from one anchor would be off by ~0.2 ms after two hours; chaining each end from
    # the one before would add each reading's rounding. Fresh anchors keep every end exact.
    timeline = EventTimeline(elapsed_ms)
    kernel_s = 0.0021317
    worst_s = 0.0
    t_s = 0.0
    for _ in range(int(7200 / kernel_s) // 50):  # every 50th kernel of two hours, launched 1 ms ahead
        t_s += 50 * kernel_s
        if timeline.wants_anchor(t_s - 0.001):  # the launcher asks at each launch
            timeline.anchor(gpu(t_s - 0.001), t_s - 0.001)
        _start_s, end_s = run(timeline, t_s, returned_s=t_s - 0.001, now_s=t_s + 1.0)
        worst_s = max(worst_s, abs(end_s - t_s))
    assert worst_s < 1e-6


def test_a_launch_before_any_anchor_is_a_bug() -> None:
    with pytest.raises(RuntimeError):
        EventTimeline(elapsed_ms).launched()


# --- finding the device -----------------------------------------------------------------------------------


class FakeCuda:
    def __init__(self, uuids: list[str]) -> None:
        self.gpus = [SimpleNamespace(id=i, uuid=u) for i, u in enumerate(uuids)]


UUID_A = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
UUID_B = "GPU-bbbbbbbb-1111-2222-3333-444444444444"


def test_the_cuda_device_is_found_by_uuid_whatever_its_cuda_number() -> None:
    # CUDA_VISIBLE_DEVICES=1: NVML still numbers the GPU 1, CUDA calls it 0.
    assert find_device(FakeCuda([UUID_B]), UUID_B).id == 0
    assert find_device(FakeCuda([UUID_B, UUID_A]), UUID_A).id == 1


def test_a_mig_instance_is_found_by_its_uuid() -> None:
    mig = "MIG-cccccccc-1111-2222-3333-444444444444"
    assert find_device(FakeCuda(["GPU-cccccccc-1111-2222-3333-444444444444"]), mig).id == 0


def test_a_gpu_cuda_does_not_see_is_no_gpu_naming_what_it_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(NoGpuError, match=f"{UUID_A}.*CUDA_VISIBLE_DEVICES=1.*0 {UUID_B}"):
        find_device(FakeCuda([UUID_B]), UUID_A)
