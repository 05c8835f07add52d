"""Runs forge-load's console entry point (the one pyproject.toml names) for the hostile tests, with hooks:

    python tests/hostile_entry.py [--signal-on-import SIGNAME:MODULE] [--wall-clock-sim] [--without MODULE]
                                  -- FORGE-LOAD ARGS...

--signal-on-import  the process sends itself SIGNAME the moment MODULE starts importing: a signal at start-up,
                    at a moment that does not depend on how fast this machine is.
--wall-clock-sim    the real run loop (threads, wall-clock time) on simulated GPUs: NVML and CUDA are stood in
                    for by forge_load.gpu.sim, as tests/test_app.py's threaded tests do in-process.
--without           MODULE cannot be imported, as where it is not installed.
"""

from __future__ import annotations

import importlib
import importlib.abc
import os
import re
import signal
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def entry_point() -> tuple[str, str]:
    """`forge-load-python = "module:function"` from pyproject.toml: what the installed command runs (bin/forge-load,
    once it has checked TZ)."""
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'^forge-load-python\s*=\s*"([\w.]+):(\w+)"', text, re.MULTILINE)
    assert match, "no forge-load-python entry point in pyproject.toml"
    return match[1], match[2]


class SignalOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, signum: int, module: str) -> None:
        self.signum, self.module = signum, module

    def find_spec(self, name: str, path: object = None, target: ModuleType | None = None) -> None:
        if name == self.module:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), self.signum)
        return None


def wall_clock_sim() -> None:
    from simrun import WallClock  # tests/, this script's folder

    import forge_load.gpu.launcher
    import forge_load.gpu.nvml
    from forge_load.config.sim import SimConfig
    from forge_load.gpu.sim import SimGpu, SimLauncher, SimProbe

    gpus: dict[int, SimGpu] = {}

    def gpu(index: int) -> SimGpu:
        return gpus.setdefault(index, SimGpu(SimConfig(), WallClock(), index))

    forge_load.gpu.nvml.NvmlProbe = lambda selector, *a, **k: SimProbe(gpu(int(selector)))  # type: ignore
    forge_load.gpu.nvml.device_uuids = lambda *a, **k: [gpu(i).info.uuid for i in range(8)]  # type: ignore
    forge_load.gpu.launcher.CudaLauncher = lambda uuid, *a, **k: SimLauncher(  # type: ignore
        next(g for g in gpus.values() if g.info.uuid == uuid))


def main() -> None:
    args = sys.argv[1:]
    split = args.index("--")
    options, rest = args[:split], args[split + 1:]
    while options:
        option = options.pop(0)
        if option == "--signal-on-import":
            name, module = options.pop(0).split(":")
            sys.meta_path.insert(0, SignalOnImport(signal.Signals[name], module))
        elif option == "--wall-clock-sim":
            wall_clock_sim()
        elif option == "--without":
            sys.modules[options.pop(0)] = None  # type: ignore[assignment]
        else:
            raise SystemExit(f"hostile_entry: unknown option {option}")
    module, function = entry_point()
    sys.argv = ["forge-load", *rest]
    raise SystemExit(getattr(importlib.import_module(module), function)())


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
