"""forge_load.gpu.nvml against a fake pynvml table (tests/fake_pynvml.py), plus a real-GPU check marked `gpu`."""

from __future__ import annotations

import ctypes.util
import pathlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pynvml
import pytest
from fake_pynvml import MIB, FakeDevice, FakeNvml, FakeProcess
from nvml_support import (
    BOOT_MINUS_MONO_S,
    UUID_A,
    UUID_B,
    WALL_MINUS_MONO_S,
    Clocks,
    clocks,
    fake,
    two_devices,
)

from forge_load.control.probe import ComputeMode, DeviceInfo, GpuFailedError, GpuProcess, NoGpuError, UtilSample
from forge_load.gpu.backend import NvidiaBackend
from forge_load.gpu.nvml import NvmlProbe, list_devices

__all__ = ["clocks", "fake"]  # fixtures, imported for pytest


def wall_us(mono_s: float, offset_s: float = WALL_MINUS_MONO_S) -> int:
    """The NVML timestamp (wall clock, µs) of an instant given on the monotonic clock."""
    return round((mono_s + offset_s) * 1e6)


@pytest.fixture
def probe(fake: FakeNvml, clocks: Clocks) -> NvmlProbe:
    return clocks.probe(fake)


# --- construction ---


def test_open_by_index_fills_device_info(fake: FakeNvml) -> None:
    probe = NvmlProbe("1", nvml=fake.module)
    assert probe.info == DeviceInfo(
        index=1,
        uuid=UUID_B,
        name="NVIDIA A100-SXM4-40GB",
        memory_total_mib=40960.0,
        driver_version="550.54.15",
        mig_enabled=False,
    )
    assert fake.init_count == 1


def test_open_by_uuid_finds_the_index(fake: FakeNvml) -> None:
    probe = NvmlProbe(UUID_B, nvml=fake.module)
    assert probe.info.index == 1
    assert probe.info.uuid == UUID_B
    assert fake.called("nvmlDeviceGetHandleByUUID")[0][0] == (UUID_B,)


def test_open_by_uuid_without_get_index_scans_the_devices() -> None:
    fake = FakeNvml(two_devices(), without=["nvmlDeviceGetIndex"])
    assert NvmlProbe(UUID_B, nvml=fake.module).info.index == 1


def test_old_pynvml_bytes_are_decoded() -> None:
    fake = FakeNvml(two_devices(), bytes_strings=True)
    info = NvmlProbe("0", nvml=fake.module).info
    assert (info.name, info.uuid, info.driver_version) == ("NVIDIA H100 80GB HBM3", UUID_A, "550.54.15")


def test_a_gpu_in_mig_mode_is_refused_in_one_line_naming_its_mig_devices() -> None:
    # CUDA runs only on MIG devices there, one per process (docs/design.md §12): the whole GPU is no CUDA device.
    migs = [FakeDevice(uuid="MIG-11111111-2222-3333-4444-55555555555" + str(k)) for k in range(2)]
    fake = FakeNvml([FakeDevice(uuid=UUID_A, mig_mode=pynvml.NVML_DEVICE_MIG_ENABLE, migs=migs)])
    with pytest.raises(NoGpuError) as caught:
        NvmlProbe("0", nvml=fake.module)
    text = str(caught.value)
    assert "\n" not in text and f"GPU 0 ({UUID_A}) is in MIG mode" in text
    assert text.endswith(f"its MIG devices: {migs[0].uuid}, {migs[1].uuid}")
    assert fake.init_count == fake.shutdown_count  # NVML left as found
    empty = FakeNvml([FakeDevice(uuid=UUID_A, mig_mode=pynvml.NVML_DEVICE_MIG_ENABLE)])
    with pytest.raises(NoGpuError, match="none is made yet"):
        NvmlProbe("0", nvml=empty.module)


def test_mig_mode_disabled_or_unsupported_is_not_mig() -> None:
    fake = FakeNvml(
        [FakeDevice(uuid=UUID_A, mig_mode=pynvml.NVML_DEVICE_MIG_DISABLE), FakeDevice(uuid=UUID_B)]
    )
    assert NvmlProbe("0", nvml=fake.module).info.mig_enabled is False
    info = NvmlProbe("1", nvml=fake.module).info  # GetMigMode: NotSupported
    assert info.mig_enabled is False
    assert NvidiaBackend().start_fields(info).get("note") is None


@pytest.mark.parametrize("value, mode", [(0, ComputeMode.DEFAULT), (1, ComputeMode.EXCLUSIVE_THREAD),
                                         (2, ComputeMode.PROHIBITED), (3, ComputeMode.EXCLUSIVE_PROCESS),
                                         (7, ComputeMode.UNKNOWN)])
def test_the_compute_mode_is_read_when_the_gpu_is_opened(value: int, mode: ComputeMode) -> None:
    fake = FakeNvml([FakeDevice(uuid=UUID_A, compute_mode=value)])
    assert NvmlProbe("0", nvml=fake.module).info.compute_mode is mode
    assert [d.compute_mode for d in list_devices(fake.module)] == [mode]


def test_a_compute_mode_nvml_does_not_report_is_unknown() -> None:
    fake = FakeNvml([FakeDevice(uuid=UUID_A, errors={"nvmlDeviceGetComputeMode": pynvml.NVMLError_NotSupported})])
    assert NvmlProbe("0", nvml=fake.module).info.compute_mode is ComputeMode.UNKNOWN
    old = FakeNvml([FakeDevice(uuid=UUID_A)], without=["nvmlDeviceGetComputeMode"])
    assert NvmlProbe("0", nvml=old.module).info.compute_mode is ComputeMode.UNKNOWN


def test_a_mig_instance_uuid_is_mig() -> None:
    fake = FakeNvml([FakeDevice(uuid="MIG-11111111-2222-3333-4444-555555555555")])
    info = NvmlProbe("MIG-11111111-2222-3333-4444-555555555555", nvml=fake.module).info
    assert info.mig_enabled is True
    assert NvidiaBackend().start_fields(info).get("note") is not None


@pytest.mark.parametrize("gpu", ["2", "7"])
def test_index_out_of_range_says_how_many_gpus_are_visible(fake: FakeNvml, gpu: str) -> None:
    with pytest.raises(NoGpuError) as caught:
        NvmlProbe(gpu, nvml=fake.module)
    message = str(caught.value)
    assert f"GPU index {gpu}" in message
    assert "2 GPUs are visible" in message and UUID_A in message and UUID_B in message
    assert fake.shutdown_count == fake.init_count == 1  # NVML is not left initialized


def test_unknown_uuid_says_how_many_gpus_are_visible(fake: FakeNvml) -> None:
    with pytest.raises(NoGpuError) as caught:
        NvmlProbe("GPU-ffffffff-0000-0000-0000-000000000000", nvml=fake.module)
    assert "GPU-ffffffff" in str(caught.value)
    assert "2 GPUs are visible" in str(caught.value)
    assert fake.shutdown_count == 1


def test_no_gpu_at_all() -> None:
    fake = FakeNvml([])
    with pytest.raises(NoGpuError, match="no GPU is visible"):
        NvmlProbe("0", nvml=fake.module)


def test_gpu_that_is_neither_index_nor_uuid(fake: FakeNvml) -> None:
    with pytest.raises(NoGpuError, match="neither an index"):
        NvmlProbe("first", nvml=fake.module)


@pytest.mark.parametrize(
    "error",
    [pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded, pynvml.NVMLError_NoPermission],
)
def test_nvml_init_failure_is_no_gpu_with_hint(error: type[pynvml.NVMLError]) -> None:
    fake = FakeNvml(two_devices())
    fake.errors["nvmlInit"] = error
    with pytest.raises(NoGpuError) as caught:
        NvmlProbe("0", nvml=fake.module)
    message = str(caught.value)
    assert str(error()) in message  # NVML's own words, e.g. "Driver Not Loaded"
    assert "NVIDIA driver" in message and "--gpus" in message and "--simulate" in message


def test_gpu_lost_while_opening_is_no_gpu(fake: FakeNvml) -> None:
    fake.devices[0].errors["nvmlDeviceGetName"] = pynvml.NVMLError_GpuIsLost
    with pytest.raises(NoGpuError, match="GPU is lost"):
        NvmlProbe("0", nvml=fake.module)
    assert fake.shutdown_count == 1


def test_missing_pynvml_module_is_no_gpu_with_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    with pytest.raises(NoGpuError) as caught:
        NvmlProbe("0")
    assert "nvidia-ml-py" in str(caught.value) and "--simulate" in str(caught.value)
    with pytest.raises(NoGpuError, match="nvidia-ml-py"):
        list_devices()


def test_importing_forge_load_nvml_does_not_need_pynvml() -> None:
    code = "import sys; sys.modules['pynvml'] = None; import forge_load.gpu.nvml; print('ok')"
    root = pathlib.Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_nvml_calls_py_is_the_only_module_that_imports_pynvml() -> None:
    package = pathlib.Path(__file__).resolve().parents[1] / "forge_load"
    importers = sorted(
        path.name
        for path in package.rglob("*.py")
        if any(
            line.strip().startswith(("import pynvml", "from pynvml"))
            for line in path.read_text(encoding="utf-8").splitlines()
        )
    )
    assert importers == ["nvml_calls.py"]


# --- utilization samples ---


def test_samples_are_converted_to_monotonic_time_filtered_and_sorted(
    fake: FakeNvml, clocks: Clocks, probe: NvmlProbe
) -> None:
    # The buffer as NVML keeps it: wall-clock µs, not necessarily in order.
    fake.devices[0].samples = [
        (wall_us(999.5), 40),
        (wall_us(998.0), 10),
        (wall_us(999.0), 30),
        (wall_us(998.5), 20),
    ]
    samples = probe.utilization_samples(since_s=998.2)
    assert [s.t_s for s in samples] == pytest.approx([998.5, 999.0, 999.5], abs=1e-6)
    assert [s.ratio for s in samples] == pytest.approx([0.2, 0.3, 0.4])
    assert all(isinstance(s, UtilSample) for s in samples)
    # Next time NVML is asked for what is newer than the newest stamp it gave, exactly ...
    assert probe.utilization_samples(since_s=999.5) == []
    (args, _kwargs) = fake.called("nvmlDeviceGetSamples")[-1]
    assert args[1] == pynvml.NVML_GPU_UTILIZATION_SAMPLES
    assert args[2] == wall_us(999.5)
    # ... or than since_s, as a wall-clock stamp in µs, where that is later.
    probe.utilization_samples(since_s=1000.2)
    assert abs(fake.called("nvmlDeviceGetSamples")[-1][0][2] - wall_us(1000.2)) <= 1


def test_samples_are_filtered_even_when_nvml_returns_older_ones(clocks: Clocks) -> None:
    fake = FakeNvml(two_devices(), honor_last_seen=False)
    probe = clocks.probe(fake)
    fake.devices[0].samples = [(wall_us(998.0), 20), (wall_us(999.0), 30), (wall_us(999.5), 40)]
    samples = probe.utilization_samples(since_s=999.0)  # since_s itself is excluded
    assert [s.t_s for s in samples] == pytest.approx([999.5], abs=1e-6)


def test_samples_use_the_wall_clock_offset_of_each_call(
    fake: FakeNvml, clocks: Clocks, probe: NvmlProbe
) -> None:
    clocks.offset_s = WALL_MINUS_MONO_S + 3600.0  # the wall clock was stepped an hour ahead (NTP, DST bugs)
    fake.devices[0].samples = [(wall_us(999.5, clocks.offset_s), 50)]
    samples = probe.utilization_samples(since_s=999.0)
    assert [s.t_s for s in samples] == pytest.approx([999.5], abs=1e-6)


def test_the_newest_sample_is_never_returned_twice_when_the_clocks_jitter(
    fake: FakeNvml, clocks: Clocks, probe: NvmlProbe
) -> None:
    # wall - monotonic moves by fractions of a µs between two reads of the clocks; the same NVML sample
    # must still come back once only (two copies of one noisy window would meet FORGE_FOREIGN_SAMPLES=2).
    fake.devices[0].samples = [(wall_us(999.0), 30)]
    first = probe.utilization_samples(since_s=float("-inf"))
    assert [s.ratio for s in first] == [0.3]
    for jitter_s in (-4e-7, 3e-7, -9e-7, 6e-7, -2e-7):
        clocks.offset_s = WALL_MINUS_MONO_S + jitter_s
        assert probe.utilization_samples(since_s=first[-1].t_s) == []
    fake.devices[0].samples.append((wall_us(999.0) + 166_667, 40))
    assert [s.ratio for s in probe.utilization_samples(since_s=first[-1].t_s)] == [0.4]


def test_sample_stamps_on_the_wall_clock_are_found_at_open(fake: FakeNvml, clocks: Clocks) -> None:
    fake.devices[0].samples = [(wall_us(999.8), 10)]
    probe = clocks.probe(fake)
    assert probe.sample_clock == "unix"
    assert [s.t_s for s in probe.utilization_samples(float("-inf"))] == pytest.approx([999.8], abs=1e-6)


def test_boot_relative_sample_stamps_are_found_and_converted(fake: FakeNvml, clocks: Clocks) -> None:
    # NVML documents the stamp only as a CPU timestamp in µs; some platforms count from boot.
    boot_us = round((999.8 + BOOT_MINUS_MONO_S) * 1e6)
    fake.devices[0].samples = [(boot_us - 500_000, 20), (boot_us, 40)]
    probe = clocks.probe(fake)
    assert probe.sample_clock == "boot"
    samples = probe.utilization_samples(float("-inf"))
    assert [s.t_s for s in samples] == pytest.approx([999.3, 999.8], abs=1e-6)
    clocks.mono_s += 0.5
    fake.devices[0].samples.append((boot_us + 500_000, 60))
    assert [s.t_s for s in probe.utilization_samples(samples[-1].t_s)] == pytest.approx([1000.3], abs=1e-6)


def test_sample_stamps_on_no_known_clock_are_anchored_on_the_newest_sample(fake: FakeNvml, clocks: Clocks) -> None:
    far_us = 4_000_000_000 * 10**6  # ahead of every clock we know: an epoch we cannot name
    fake.devices[0].samples = [(far_us - 500_000, 20), (far_us, 30)]
    probe = clocks.probe(fake)
    assert probe.sample_clock == "relative"
    assert [s.t_s for s in probe.utilization_samples(float("-inf"))] == pytest.approx([999.5, 1000.0], abs=1e-6)


def test_sample_clock_is_found_from_the_first_samples_when_the_buffer_starts_empty(
    fake: FakeNvml, clocks: Clocks
) -> None:
    probe = clocks.probe(fake)
    assert probe.sample_clock == "pending"
    fake.devices[0].samples = [(round((1000.0 + BOOT_MINUS_MONO_S) * 1e6), 50)]
    assert [s.t_s for s in probe.utilization_samples(float("-inf"))] == pytest.approx([1000.0], abs=1e-6)
    assert probe.sample_clock == "boot"


def test_sample_ratio_is_clamped(fake: FakeNvml, probe: NvmlProbe) -> None:
    fake.devices[0].samples = [(wall_us(999.0), 130)]
    assert [s.ratio for s in probe.utilization_samples(since_s=0.0)] == [1.0]


def test_since_before_the_epoch_asks_for_the_whole_buffer(fake: FakeNvml, probe: NvmlProbe) -> None:
    fake.devices[0].samples = [(wall_us(999.0), 25)]
    assert [s.ratio for s in probe.utilization_samples(since_s=float("-inf"))] == [0.25]
    assert fake.called("nvmlDeviceGetSamples")[-1][0][2] == 0


def test_samples_not_found_means_no_new_samples(fake: FakeNvml, probe: NvmlProbe) -> None:
    assert probe.utilization_samples(since_s=0.0) == []  # empty buffer: NVML answers NOT_FOUND
    fake.devices[0].samples = [(wall_us(990.0), 60)]
    assert probe.utilization_samples(since_s=995.0) == []  # nothing newer than since_s


def test_samples_not_supported_is_none(fake: FakeNvml, probe: NvmlProbe) -> None:
    fake.devices[0].errors["nvmlDeviceGetSamples"] = pynvml.NVMLError_NotSupported
    assert probe.utilization_samples(since_s=0.0) is None


def test_utilization_ratio(fake: FakeNvml, probe: NvmlProbe) -> None:
    fake.devices[0].util_percent = 37
    assert probe.utilization_ratio() == pytest.approx(0.37)


# --- memory ---


def test_memory_prefers_v2_which_excludes_reserved(fake: FakeNvml, probe: NvmlProbe) -> None:
    fake.devices[0].memory_used_bytes = 600 * MIB
    fake.devices[0].memory_reserved_bytes = 512 * MIB
    assert probe.memory_used_mib() == pytest.approx(600.0)
    assert fake.called("nvmlDeviceGetMemoryInfo")[-1][1] == {"version": pynvml.nvmlMemory_v2}


def test_memory_falls_back_to_v1_on_a_driver_without_v2(clocks: Clocks) -> None:
    fake = FakeNvml(two_devices(), missing_in_driver=["nvmlDeviceGetMemoryInfo_v2"])
    fake.devices[0].memory_used_bytes = 600 * MIB
    fake.devices[0].memory_reserved_bytes = 512 * MIB
    probe = NvmlProbe("0", nvml=fake.module)
    assert probe.memory_used_mib() == pytest.approx(1112.0)  # v1's used includes the reservation
    assert fake.called("nvmlDeviceGetMemoryInfo")[-1][1] == {}


def test_memory_uses_v1_with_a_pynvml_without_v2() -> None:
    fake = FakeNvml(two_devices(), without=["nvmlMemory_v2"])
    fake.devices[0].memory_used_bytes = 100 * MIB
    probe = NvmlProbe("0", nvml=fake.module)
    assert probe.memory_used_mib() == pytest.approx(100.0 + 512.0)
    assert all(kwargs == {} for _args, kwargs in fake.called("nvmlDeviceGetMemoryInfo"))


# --- processes ---


def test_processes_merge_compute_and_graphics_by_pid(fake: FakeNvml, probe: NvmlProbe) -> None:
    sentinel = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
    fake.devices[0].compute_processes = [FakeProcess(10, 300 * MIB), FakeProcess(30, sentinel)]
    fake.devices[0].graphics_processes = [FakeProcess(10, 300 * MIB), FakeProcess(20, None)]
    assert probe.processes() == [
        GpuProcess(pid=10, used_mib=300.0),
        GpuProcess(pid=20, used_mib=None),
        GpuProcess(pid=30, used_mib=None),
    ]
    assert fake.called("nvmlDeviceGetComputeRunningProcesses_v3")
    assert not fake.called("nvmlDeviceGetComputeRunningProcesses_v2")


def test_processes_empty(probe: NvmlProbe) -> None:
    assert probe.processes() == []


@pytest.mark.parametrize("how", ["without", "missing_in_driver"])
def test_processes_fall_back_from_v3_to_v2(how: str) -> None:
    v3 = ["nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3"]
    fake = FakeNvml(two_devices(), **{how: v3})
    fake.devices[0].compute_processes = [FakeProcess(42, 256 * MIB)]
    probe = NvmlProbe("0", nvml=fake.module)
    assert probe.processes() == [GpuProcess(pid=42, used_mib=256.0)]
    assert fake.called("nvmlDeviceGetComputeRunningProcesses_v2")
    assert fake.called("nvmlDeviceGetGraphicsRunningProcesses_v2")


def test_processes_fall_back_to_the_unversioned_call() -> None:
    fake = FakeNvml(
        two_devices(),
        without=[
            "nvmlDeviceGetComputeRunningProcesses_v3",
            "nvmlDeviceGetComputeRunningProcesses_v2",
            "nvmlDeviceGetGraphicsRunningProcesses_v3",
        ],
        missing_in_driver=["nvmlDeviceGetGraphicsRunningProcesses_v2"],
    )
    fake.devices[0].graphics_processes = [FakeProcess(7, MIB)]
    assert NvmlProbe("0", nvml=fake.module).processes() == [GpuProcess(pid=7, used_mib=1.0)]
    assert fake.called("nvmlDeviceGetComputeRunningProcesses")
    assert fake.called("nvmlDeviceGetGraphicsRunningProcesses")


def test_processes_with_no_process_call_at_all_is_none() -> None:
    names = [n for n in FakeNvml.FUNCTIONS if "RunningProcesses" in n]
    fake = FakeNvml(two_devices(), without=names)
    assert NvmlProbe("0", nvml=fake.module).processes() is None


def test_processes_not_supported_is_none(fake: FakeNvml, probe: NvmlProbe) -> None:
    fake.devices[0].errors["nvmlDeviceGetComputeRunningProcesses_v3"] = pynvml.NVMLError_NotSupported
    fake.devices[0].errors["nvmlDeviceGetGraphicsRunningProcesses_v3"] = pynvml.NVMLError_NotSupported
    assert probe.processes() is None


def test_processes_keep_compute_when_only_graphics_is_not_supported(fake: FakeNvml, probe: NvmlProbe) -> None:
    fake.devices[0].compute_processes = [FakeProcess(5, 200 * MIB)]
    fake.devices[0].graphics_processes = [FakeProcess(6, 200 * MIB)]
    fake.devices[0].errors["nvmlDeviceGetGraphicsRunningProcesses_v3"] = pynvml.NVMLError_NotSupported
    assert probe.processes() == [GpuProcess(pid=5, used_mib=200.0)]


# --- power, temperature ---


def test_power_and_temperature(fake: FakeNvml, probe: NvmlProbe) -> None:
    fake.devices[0].power_mw = 312_500
    fake.devices[0].temperature_c = 61
    assert probe.power_w() == pytest.approx(312.5)
    assert probe.temperature_c() == pytest.approx(61.0)


def test_energy_and_power_limit(fake: FakeNvml, probe: NvmlProbe) -> None:
    fake.devices[0].energy_mj = 9_876_543_210  # mJ since the driver loaded: joules to the millijoule
    fake.devices[0].power_limit_mw = 450_000
    assert probe.energy_j() == 9_876_543.21
    assert probe.power_limit_w() == pytest.approx(450.0)


# --- error mapping, for every query ---

QUERIES: list[tuple[str, Callable[[NvmlProbe], Any], str]] = [
    ("utilization_samples", lambda p: p.utilization_samples(0.0), "nvmlDeviceGetSamples"),
    ("utilization_ratio", lambda p: p.utilization_ratio(), "nvmlDeviceGetUtilizationRates"),
    ("memory_used_mib", lambda p: p.memory_used_mib(), "nvmlDeviceGetMemoryInfo"),
    ("processes", lambda p: p.processes(), "nvmlDeviceGetComputeRunningProcesses_v3"),
    ("processes(graphics)", lambda p: p.processes(), "nvmlDeviceGetGraphicsRunningProcesses_v3"),
    ("power_w", lambda p: p.power_w(), "nvmlDeviceGetPowerUsage"),
    ("energy_j", lambda p: p.energy_j(), "nvmlDeviceGetTotalEnergyConsumption"),
    ("power_limit_w", lambda p: p.power_limit_w(), "nvmlDeviceGetEnforcedPowerLimit"),
    ("temperature_c", lambda p: p.temperature_c(), "nvmlDeviceGetTemperature"),
]
QUERY_IDS = [q[0] for q in QUERIES]


@pytest.mark.parametrize(("label", "query", "function"), QUERIES, ids=QUERY_IDS)
@pytest.mark.parametrize("error", [pynvml.NVMLError_NotSupported, pynvml.NVMLError_NoPermission])
def test_unsupported_query_is_none(
    fake: FakeNvml,
    probe: NvmlProbe,
    label: str,
    query: Callable[[NvmlProbe], Any],
    function: str,
    error: type[pynvml.NVMLError],
) -> None:
    if label == "processes":  # the graphics list alone still answers; both must be unsupported
        fake.devices[0].errors["nvmlDeviceGetGraphicsRunningProcesses_v3"] = error
    if label == "processes(graphics)":
        fake.devices[0].errors["nvmlDeviceGetComputeRunningProcesses_v3"] = error
    fake.devices[0].errors[function] = error
    assert query(probe) is None


@pytest.mark.parametrize(("label", "query", "function"), QUERIES, ids=QUERY_IDS)
@pytest.mark.parametrize(
    "error", [pynvml.NVMLError_GpuIsLost, pynvml.NVMLError_Unknown, pynvml.NVMLError_DriverNotLoaded]
)
def test_lost_gpu_during_any_query_is_gpu_failed(
    fake: FakeNvml,
    probe: NvmlProbe,
    label: str,
    query: Callable[[NvmlProbe], Any],
    function: str,
    error: type[pynvml.NVMLError],
) -> None:
    fake.devices[0].errors[function] = error
    with pytest.raises(GpuFailedError) as caught:
        query(probe)
    message = str(caught.value)
    assert message.startswith(f"GPU 0 ({UUID_A}) was lost: {error()}")
    assert "\n" not in message


@pytest.mark.parametrize(("label", "query", "function"), QUERIES, ids=QUERY_IDS)
def test_unexpected_nvml_error_during_a_query_is_gpu_failed_not_swallowed(
    fake: FakeNvml, probe: NvmlProbe, label: str, query: Callable[[NvmlProbe], Any], function: str
) -> None:
    fake.devices[0].errors[function] = pynvml.NVMLError_Timeout
    with pytest.raises(GpuFailedError) as caught:
        query(probe)
    assert f"GPU 0 ({UUID_A}) failed" in str(caught.value)
    assert "Timeout" in str(caught.value) and function in str(caught.value)


def test_lost_gpu_names_the_right_gpu(fake: FakeNvml, clocks: Clocks) -> None:
    probe = NvmlProbe(UUID_B, nvml=fake.module)
    fake.devices[1].errors["nvmlDeviceGetPowerUsage"] = pynvml.NVMLError_GpuIsLost
    with pytest.raises(GpuFailedError, match=f"^GPU 1 \\({UUID_B}\\) was lost: GPU is lost"):
        probe.power_w()


# --- close ---


def test_close_is_idempotent(fake: FakeNvml, probe: NvmlProbe) -> None:
    probe.close()
    probe.close()
    assert fake.shutdown_count == 1
    with pytest.raises(RuntimeError, match="closed"):
        probe.power_w()


def test_context_manager_closes(fake: FakeNvml) -> None:
    with NvmlProbe("0", nvml=fake.module) as probe:
        assert probe.power_w() == pytest.approx(70.0)
    assert fake.shutdown_count == 1


# --- list_devices ---


def test_list_devices(fake: FakeNvml) -> None:
    devices = list_devices(fake.module)
    assert [(d.index, d.uuid, d.name) for d in devices] == [
        (0, UUID_A, "NVIDIA H100 80GB HBM3"),
        (1, UUID_B, "NVIDIA A100-SXM4-40GB"),
    ]
    assert fake.init_count == fake.shutdown_count == 1


def test_list_devices_without_driver_is_no_gpu() -> None:
    fake = FakeNvml(two_devices())
    fake.errors["nvmlInit"] = pynvml.NVMLError_LibraryNotFound
    with pytest.raises(NoGpuError, match="--simulate"):
        list_devices(fake.module)


# --- the real pynvml on this machine ---


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None, reason="an NVML library is present")
def test_real_pynvml_without_a_driver_is_no_gpu_with_hint() -> None:
    with pytest.raises(NoGpuError) as caught:
        NvmlProbe("0")
    assert "--simulate" in str(caught.value) and "NVIDIA driver" in str(caught.value)


def _real_gpu_present() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    try:
        return pynvml.nvmlDeviceGetCount() > 0
    finally:
        pynvml.nvmlShutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not _real_gpu_present(), reason="needs an NVIDIA GPU with a driver")
def test_real_gpu_answers_every_query() -> None:
    with NvmlProbe("0") as probe:
        assert probe.info.uuid.startswith(("GPU-", "MIG-"))
        assert probe.info.memory_total_mib > 0
        samples = probe.utilization_samples(since_s=0.0)
        assert samples is None or all(0.0 <= s.ratio <= 1.0 for s in samples)
        ratio = probe.utilization_ratio()
        assert ratio is None or 0.0 <= ratio <= 1.0
        used = probe.memory_used_mib()
        assert used is None or 0.0 <= used <= probe.info.memory_total_mib
        processes = probe.processes()
        assert processes is None or all(isinstance(p, GpuProcess) for p in processes)
        power = probe.power_w()
        assert power is None or power > 0.0
        temperature = probe.temperature_c()
        assert temperature is None or 0.0 < temperature < 120.0
