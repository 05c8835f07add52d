"""The operator's controls in real mode on the virtual GPU (the unmodified numba-cuda and pynvml path): the power
cap held, pausing by SIGUSR1 complete, the energy counter from NVML's, and the process's name in the GPU's list.

Judged by the virtual GPU's own record of every kernel (`gpu.kernels()`) and its power model, never by what the
filler says of itself. The filler runs the burn shape, where a cap binds: its full waves draw the board's limit
(700 W) while they run, over 70 W with a context, so 70 W + 630 W x the busy share of a second bounds the model's
power from above (a last wave's tail draws less).
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.test_real_path import Run, finish, forge, wait_for
from vgpu import Kernel

IDLE_W, MAX_W = 70.0, 700.0  # the virtual GPU's model (vgpu/src/state.c)
CAP_W = 300.0


def busy_ratio(kernels: list[Kernel], a_s: float, b_s: float) -> float:
    """Share of [a_s, b_s] during which any kernel ran (they run one at a time on the device)."""
    return sum(max(0.0, min(k.end, b_s) - max(k.start, a_s)) for k in kernels) / (b_s - a_s)


def wait_past(run: Run, t_s: float) -> None:
    while float(wait_for(run, "status")["t"]) < t_s:
        pass


@pytest.fixture(scope="module")
def capped_and_paused(tmp_path_factory: pytest.TempPathFactory, vgpu_lib_dir: Path) -> tuple[Run, dict[str, str]]:
    """forge-load at 0.9 under a 300-W cap for 14 s; SIGUSR1 after 5 s, SIGUSR2 after 8 s."""
    from vgpu import VirtualGpu

    gpu = VirtualGpu(tmp_path_factory.mktemp("operators"), lib_dir=vgpu_lib_dir)
    run = forge(gpu, "--target", "0.9", "--max-power-w", str(CAP_W), "--duration", "14", "--log-interval", "0.5",
                "--shape", "burn")
    seen: dict[str, str] = {}
    wait_past(run, 3.0)
    seen["cmdline filling"] = Path(f"/proc/{run.proc.pid}/cmdline").read_bytes().rstrip(b"\0").decode()
    seen["comm on the GPU"] = ",".join(c.comm for c in gpu.contexts() if c.pid == run.proc.pid)
    wait_past(run, 5.0)
    run.proc.send_signal(signal.SIGUSR1)
    wait_for(run, "pause")
    wait_past(run, float(run.of("pause")[0]["t"]) + 0.6)
    seen["cmdline paused"] = Path(f"/proc/{run.proc.pid}/cmdline").read_bytes().rstrip(b"\0").decode()
    wait_past(run, 8.0)
    run.proc.send_signal(signal.SIGUSR2)
    assert finish(run) == 0, run.stderr[-3000:]
    return run, seen


def test_the_cap_holds_board_power_on_the_virtual_gpu(capped_and_paused: tuple[Run, dict[str, str]]) -> None:
    run, _ = capped_and_paused
    kernels = run.gpu.kernels()
    start_s, end_s = run.wall(0.0), run.wall(float(run.of("stop")[0]["t"]))
    grid = [start_s + 0.1 * k for k in range(int((end_s - start_s) / 0.1) + 1)]
    worst_w = max(IDLE_W + (MAX_W - IDLE_W) * busy_ratio(kernels, t - 1.0, t) for t in grid)
    assert worst_w <= CAP_W
    # Held just under the cap while filling, not far below: the target alone (0.9) would draw ~640 W.
    before_pause_s = run.wall(float(run.of("pause")[0]["t"]))
    assert IDLE_W + (MAX_W - IDLE_W) * busy_ratio(kernels, before_pause_s - 2.0, before_pause_s) >= 0.9 * CAP_W
    capped = run.of("power_capped")
    assert capped and capped[0]["capped"] is True and capped[0]["max_power_w"] == CAP_W
    # NVML's own reading, as the status lines report it, agrees.
    assert all(float(s["power_w"]) <= CAP_W for s in run.of("status"))
    assert run.of("start")[0]["power_limit_w"] == MAX_W  # NVML's enforced limit seeds the cap's first duty
    assert run.gpu.unimplemented() == []


def test_sigusr1_pauses_completely_in_real_mode(capped_and_paused: tuple[Run, dict[str, str]]) -> None:
    run, _ = capped_and_paused
    pause_s, unpause_s = (run.wall(float(run.of(e)[0]["t"])) for e in ("pause", "unpause"))
    late = [k for k in run.kernels() if pause_s + 0.006 < k.submit < unpause_s]
    assert late == [], f"{len(late)} kernels launched while paused"
    assert any(k.start > unpause_s for k in run.kernels())  # filling again
    assert run.of("pause")[0]["reason"] == "SIGUSR1 (SIGUSR2 resumes)"
    assert run.of("unpause")[0]["reason"] == "SIGUSR2"


def test_the_energy_counter_is_nvmls_while_filling(capped_and_paused: tuple[Run, dict[str, str]]) -> None:
    run, _ = capped_and_paused
    kernels = run.gpu.kernels()
    stop = run.of("stop")[0]
    spans = [(run.wall(0.0), run.wall(float(run.of("pause")[0]["t"]))),
             (run.wall(float(run.of("unpause")[0]["t"])), run.wall(float(stop["t"])))]
    model_j = sum(IDLE_W * (b - a) + (MAX_W - IDLE_W) * busy_ratio(kernels, a, b) * (b - a) for a, b in spans)
    # Counted from poll to poll (0.1 s): each of the four edges may differ by a poll's worth of at most the cap.
    assert stop["energy_source"] == "counter"
    assert abs(float(stop["energy_j"]) - model_j) <= 4 * 0.11 * CAP_W, (stop["energy_j"], model_j)


def test_the_process_is_named_in_ps_and_in_the_gpus_list(capped_and_paused: tuple[Run, dict[str, str]]) -> None:
    _, seen = capped_and_paused
    assert seen["cmdline filling"] == "forge-load: gpu 0 filling"
    assert seen["cmdline paused"] == "forge-load: gpu 0 paused"
    assert seen["comm on the GPU"] == "forge-load"  # the name the virtual GPU's process list records
