from __future__ import annotations

import functools

import pytest

pytest_plugins = ["vgpu.pytest_plugin", "tests.slurm_harness"]  # fixtures `vgpu` and `slurm_cluster`


@functools.lru_cache(maxsize=1)
def gpu_present() -> str | None:
    """None when a real NVIDIA GPU with a driver is usable here, else why not."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            if pynvml.nvmlDeviceGetCount() == 0:
                return "NVML sees no GPU"
        finally:
            pynvml.nvmlShutdown()
    except Exception as error:  # noqa: BLE001 - no library, no driver: whatever it raises
        return f"no NVML: {error}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "gpu" in item.keywords:
            reason = gpu_present()
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=f"needs an NVIDIA GPU with a driver ({reason})"))
