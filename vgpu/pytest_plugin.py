"""pytest fixtures for the virtual GPU (loaded by tests/conftest.py).

    def test_something(vgpu: VgpuFactory) -> None:
        gpu = vgpu(gpus=2, hide_processes=True)        # a fresh virtual GPU in the test's tmp dir
        proc = gpu.run([sys.executable, "-c", CODE])    # a subprocess on it
        assert gpu.kernels() ...

The libraries are built once per session (skipped, saying why, only where no C compiler exists). At the end of
each test, every virtual GPU it made must have seen no call to an unimplemented entry point, unless the test
said it expects one with `vgpu.expect_unimplemented(name)`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vgpu import BuildError, VirtualGpu, build
from vgpu.build import compiler


class VgpuFactory:
    """Makes fresh virtual GPUs (keyword arguments as VirtualGpu's) under one test's tmp dir."""

    def __init__(self, lib_dir: Path, tmp_path: Path) -> None:
        self.lib_dir = lib_dir
        self._tmp_path = tmp_path
        self.made: list[VirtualGpu] = []
        self.expected: set[str] = set()

    def __call__(self, **kwargs: Any) -> VirtualGpu:
        state_dir = kwargs.pop("state_dir", None) or self._tmp_path / f"vgpu{len(self.made)}"
        gpu = VirtualGpu(state_dir, lib_dir=self.lib_dir, **kwargs)
        self.made.append(gpu)
        return gpu

    def expect_unimplemented(self, *names: str) -> None:
        self.expected.update(names)

    def check(self) -> None:
        for gpu in self.made:
            missing = sorted(set(gpu.unimplemented()) - self.expected)
            assert not missing, (f"the virtual GPU was called for entry points it does not implement: {missing} "
                                 "(a new numba-cuda or pynvml path? implement them in vgpu/src)")


@pytest.fixture(scope="session")
def vgpu_lib_dir() -> Path:
    """The built libraries (once per session)."""
    if compiler() is None:
        pytest.skip("the virtual GPU needs a C compiler (cc or gcc) to build its libraries")
    try:
        return build()
    except BuildError as error:
        pytest.fail(f"the virtual GPU's libraries do not build: {error}", pytrace=False)


@pytest.fixture
def vgpu(vgpu_lib_dir: Path, tmp_path: Path) -> Iterator[VgpuFactory]:
    factory = VgpuFactory(vgpu_lib_dir, tmp_path)
    yield factory
    factory.check()
