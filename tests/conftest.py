from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tests import host_paths

pytest_plugins = ["vgpu.pytest_plugin", "tests.slurm_harness"]  # fixtures `vgpu` and `slurm_cluster`

_own_paths: list[Path] = []


def pytest_configure(config: pytest.Config) -> None:
    """Before any test is collected: the suite's own heartbeats, locks and other host-shared paths
    (tests/host_paths.py), for this process and every one a test starts."""
    _own_paths.append(host_paths.isolate())


def pytest_unconfigure(config: pytest.Config) -> None:
    for base in _own_paths:
        host_paths.remove(base)


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
