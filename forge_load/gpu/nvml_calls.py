"""NVML's one call path: pynvml loaded (the only import of it in forge_load) and each query run with its errors
mapped in one place. The NVML modules of gpu/ ask through it, and nothing else in forge_load talks to NVML:
nvml.py (the Probe on a real GPU, the host's GPUs) and nvml_mig.py (MIG devices, GPU instances, GPM). The names
with an underscore are theirs, not the package's.

pynvml is NVIDIA's `nvidia-ml-py` package (not the deprecated `pynvml` package). It is imported lazily,
and the module can be passed in, so forge_load imports (and its tests run) where it is missing.

Errors: every query goes through `_call`, which maps NVML's errors in one place:
  - not supported / no permission / function missing in this driver -> the query returns None;
  - GPU lost, driver gone, unknown error -> GpuFailedError ("GPU 0 (GPU-...) was lost: ..."), exit 4;
  - any other NVMLError during a query -> GpuFailedError with NVML's message (never swallowed);
  - any NVML error while opening the GPU -> NoGpuError with a hint, exit 3.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from forge_load.control.probe import NoGpuError

INIT_HINT: str = (
    "is the NVIDIA driver installed and loaded (does `nvidia-smi` work)? "
    "In Docker, start the container with `--gpus device=N` (or `--gpus all`) and the NVIDIA container "
    "toolkit installed; or run with --simulate to try forge_load without a GPU"
)
INSTALL_HINT: str = (
    "the NVML Python bindings are missing: `pip install nvidia-ml-py` (module pynvml), "
    "or run with --simulate to try forge_load without a GPU"
)


class _Unavailable(Exception):
    """Internal: this GPU/driver does not offer the query (NotSupported, NoPermission, missing function)."""


class _NeverRaised(Exception):
    """Stands in for an NVMLError subclass that an older pynvml does not define, so `except` never matches."""


_NOT_GIVEN: Any = object()  # `_call` without a value for NOT_FOUND: NOT_FOUND is an error


def _load_nvml(nvml: ModuleType | None) -> ModuleType:
    if nvml is not None:
        return nvml
    try:
        import pynvml  # the only import of pynvml in the project
    except ImportError as err:
        raise NoGpuError(f"cannot import pynvml ({err}): {INSTALL_HINT}") from err
    module: ModuleType = pynvml
    return module


def _err_class(nvml: ModuleType, name: str) -> type[BaseException]:
    cls = getattr(nvml, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, BaseException) else _NeverRaised


def _err_text(err: BaseException) -> str:
    # NVMLError.__str__ may need the library for unknown codes; never let the message itself fail.
    try:
        text = str(err)
    except Exception:  # noqa: BLE001 - a message is all we want here
        text = ""
    return text or type(err).__name__


def _text(value: str | bytes) -> str:
    """Older pynvml returns bytes for names, UUIDs and versions."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _call(
    nvml: ModuleType,
    names: str | tuple[str, ...],
    *args: Any,
    fail: Callable[[str, bool], Exception],
    optional: bool = True,
    not_found: Any = _NOT_GIVEN,
    **kwargs: Any,
) -> Any:
    """Run one NVML query and map its errors; the one place where NVMLErrors are interpreted.

    `names` are tried in order: a name the pynvml module lacks (AttributeError) or whose C symbol the driver
    lacks (NVMLError_FunctionNotFound) moves on to the next, for the _v3 -> _v2 -> plain fallbacks.
    Returns the value, or `not_found` where NVML says NOT_FOUND and a value is given for it.
    Raises _Unavailable where the query is not offered (only when `optional`), else `fail(message, lost)`.
    """
    error_base = _err_class(nvml, "NVMLError")
    function_missing = (
        _err_class(nvml, "NVMLError_FunctionNotFound"),
        # pynvml's unversioned wrappers turn FunctionNotFound into this (not an NVMLError).
        _err_class(nvml, "NVMLLibraryMismatchError"),
    )
    unsupported = (
        _err_class(nvml, "NVMLError_NotSupported"),
        _err_class(nvml, "NVMLError_NoPermission"),
        # A struct version this driver does not know (e.g. nvmlMemory_v2 on an old driver).
        _err_class(nvml, "NVMLError_ArgumentVersionMismatch"),
    )
    lost = (
        _err_class(nvml, "NVMLError_GpuIsLost"),
        _err_class(nvml, "NVMLError_Unknown"),
        _err_class(nvml, "NVMLError_DriverNotLoaded"),
        _err_class(nvml, "NVMLError_ResetRequired"),
    )
    not_found_cls = _err_class(nvml, "NVMLError_NotFound")

    chain = (names,) if isinstance(names, str) else names
    for name in chain:
        fn = getattr(nvml, name, None)
        if fn is None:
            continue
        try:
            return fn(*args, **kwargs)
        except function_missing:
            continue
        except unsupported as err:
            if optional:
                raise _Unavailable(name) from err
            raise fail(f"{name} is not available: {_err_text(err)}", False) from err
        except not_found_cls as err:
            if not_found is not _NOT_GIVEN:
                return not_found
            raise fail(f"{name} failed: {_err_text(err)}", False) from err
        except lost as err:
            raise fail(f"{_err_text(err)} ({name})", True) from err
        except error_base as err:
            raise fail(f"{name} failed: {_err_text(err)}", False) from err
    if optional:
        raise _Unavailable(chain[-1])
    raise fail(f"{' / '.join(chain)} is missing from this pynvml or NVIDIA driver", False)


def _nvml_init(nvml: ModuleType) -> None:
    try:
        nvml.nvmlInit()
    except _err_class(nvml, "NVMLError") as err:
        raise NoGpuError(f"NVML could not start ({_err_text(err)}): {INIT_HINT}") from err


def _nvml_shutdown(nvml: ModuleType) -> None:
    try:
        nvml.nvmlShutdown()
    except _err_class(nvml, "NVMLError"):
        pass  # nothing useful to do when the driver is already gone


def _setup_fail(message: str, lost: bool) -> Exception:
    # While opening the GPU, any failure means "no usable GPU" (exit 3), not "the GPU failed" (exit 4).
    return NoGpuError(f"cannot use the GPU: {message}")


def _device_count(nvml: ModuleType) -> int:
    return int(_call(nvml, "nvmlDeviceGetCount", fail=_setup_fail, optional=False))


def _device_uuid(nvml: ModuleType, handle: Any) -> str:
    return _text(_call(nvml, "nvmlDeviceGetUUID", handle, fail=_setup_fail, optional=False))
