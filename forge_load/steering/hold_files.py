"""The hold directory's files (docs/holds.md: on disk): their names, their formats, and reading and writing them
without trusting what is at a name. Pure stdlib, no clock. The API over them (a look at the directory, the holds of
a GPU, placing and releasing) is holds.py; the fillers' own directories are filler_dirs.py.

Formats: a hold is format 1; what a filler writes in its own directory (acknowledgement, status) is format 2; the
acknowledgement of format 1 (`filler.<GPU-UUID>.json` in the hold directory itself) is written only for the hold
commands of earlier releases, and read only for a GPU no filler of this release acknowledges.

Every read opens without following a link and without blocking (a FIFO), refuses what is not a regular file,
reads at most its bound plus one byte, and may be given the directory's descriptor (openat: nothing is reached
through a name swapped after the directory was checked) and the owners it trusts. `parsed` keeps what a read
parsed while the file is the same (device, inode, size and times): a file is parsed once however many looks and
names (hard links) reach it.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import secrets
import stat
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TypeVar

FORMAT: int = 1  # holds, and the acknowledgement for earlier releases' commands
FILLER_FORMAT: int = 2  # the fillers' files in their own directories
DEFAULT_HOLD_DIR: str = "/run/forge-load/holds"
HOLD_MAX_BYTES: int = 4096
# A reason is limited in the characters a user types: any this many fit a hold of HOLD_MAX_BYTES, at 4 bytes of UTF-8
# (or 2 of a JSON escape) each, beside the longest GPU id, holder and times (240 bytes; tests/test_holds_input.py).
MAX_REASON_CHARS: int = 900
MAX_HOLDS: int = 256  # per GPU; more and the GPU is held whatever they say
ACK_MAX_BYTES: int = 64 * 1024  # format 2: at most MAX_HOLDS holders of 64 characters, and the rest
LEGACY_ACK_MAX_BYTES: int = 1 << 20  # format 1 names every holder of a GPU held fail safe
ACK_STALE_S: float = 3.0  # an acknowledgement older than this has no live filler behind it
ACK_REFRESH_S: float = 1.0
# A filler writes its first acknowledgement into a directory that has just appeared within a refresh (and a burst
# step): until then, no acknowledgement in a directory just made does not mean that no filler runs, and one MIG
# device's does not mean that its siblings have found it.
NEW_DIR_ACK_S: float = ACK_REFRESH_S + 0.5
# A hold over a GPU without foreign work for this long has lost its holder (docs/holds.md: why a day).
DEFAULT_IDLE_AGE_OUT_S: float = 86400.0
DIR_MODE: int = 0o755
FILE_MODE: int = 0o644

HOLDER_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}", re.ASCII)
TAG_RE = re.compile(r"[0-9a-f]{16}", re.ASCII)  # a name of its own, where the usual one is taken
_HEX = "[0-9a-fA-F]"
_UUID = rf"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}"
GPU_UUID_RE = re.compile(rf"(?i:GPU|MIG)-{_UUID}", re.ASCII)  # any case: canonical_gpu_uuid says which GPU
HOLD_PREFIX, ACK_PREFIX, SUFFIX = "hold.", "filler.", ".json"
TAG_MARK = "+"  # in no holder's name: `hold.<UUID>.<HOLDER>+<tag>.json` is HOLDER's


class HoldError(Exception):
    """A file that cannot be written or read as asked; the message is one line."""


@dataclass(frozen=True)
class Hold:
    gpu_uuid: str
    holder: str
    reason: str
    since_unix_s: float
    until_unix_s: float | None = None


@dataclass(frozen=True)
class BootStamp:
    """A time on this host's boot clock (CLOCK_BOOTTIME: seconds since boot, suspend included), and which boot.
    No step of the wall clock (NTP, an operator's `date -s`) moves it, and every process of the host reads the same
    one, containers included: what `hold --wait` judges an acknowledgement's age and order by."""

    boot_id: str  # /proc/sys/kernel/random/boot_id; "" where it cannot be read
    boot_s: float


@dataclass(frozen=True)
class Ack:
    gpu_uuid: str
    pid: int
    state: str
    held_by: tuple[str, ...]
    drained: bool
    written_unix_s: float  # shown to people; judged only where the filler gave no boot stamp (an earlier release)
    written_boot: BootStamp | None = None
    of_gpu: str = ""  # a MIG device's filler: its GPU's UUID, whose holds it honours too; "" for a whole GPU
    fail_safe: bool = False  # the GPU is held whatever the holds say: every holder is honoured


def valid_holder(holder: str) -> bool:
    return HOLDER_RE.fullmatch(holder) is not None


def valid_gpu_uuid(uuid: str) -> bool:
    return GPU_UUID_RE.fullmatch(uuid) is not None


def canonical_gpu_uuid(uuid: str) -> str:
    """The one spelling of a GPU (or MIG) UUID that holds are named and compared by: `GPU-` and the hex in lower
    case, as NVML spells it. UUIDs are case-insensitive hex, so `GPU-5FD4...` typed by an operator, named in a
    file or sent by the kubelet is the GPU NVML calls `GPU-5fd4...`. Anything that is no UUID comes back as it is."""
    if not valid_gpu_uuid(uuid):
        return uuid
    return uuid[:3].upper() + uuid[3:].lower()


def new_tag() -> str:
    return secrets.token_hex(8)


def hold_name(gpu_uuid: str, holder: str, tag: str = "") -> str:
    return f"{HOLD_PREFIX}{canonical_gpu_uuid(gpu_uuid)}.{holder}{TAG_MARK + tag if tag else ''}{SUFFIX}"


# One match a name: a look at a crowded directory parses every name of it.
_HOLD_NAME_RE = re.compile(rf"hold\.((?i:GPU|MIG)-{_UUID})\.({HOLDER_RE.pattern})(?:\+[0-9a-f]{{16}})?\.json",
                           re.ASCII)
_LEGACY_ACK_RE = re.compile(rf"filler\.((?i:GPU|MIG)-{_UUID})\.json", re.ASCII)


def _canonical(uuid: str) -> str:
    return uuid[:3].upper() + uuid[3:].lower()


def parse_hold_name(name: str) -> tuple[str, str] | None:
    """(GPU UUID, canonical, and holder) of a hold's file name, its own name (`+<tag>`) too; None for any other."""
    match = _HOLD_NAME_RE.fullmatch(name)
    return (_canonical(match.group(1)), match.group(2)) if match else None


def legacy_ack_name(gpu_uuid: str) -> str:
    """The acknowledgement of format 1, in the hold directory itself (for earlier releases' commands)."""
    return f"{ACK_PREFIX}{canonical_gpu_uuid(gpu_uuid)}{SUFFIX}"


def parse_legacy_ack_name(name: str) -> str | None:
    match = _LEGACY_ACK_RE.fullmatch(name)
    return _canonical(match.group(1)) if match else None


def legacy_context_lock_name(gpu_uuid: str) -> str:
    """Exclusive mode's `flock` of format 1, in the hold directory itself (for earlier releases' commands)."""
    return f"{ACK_PREFIX}{canonical_gpu_uuid(gpu_uuid)}.lock"


# --- reading and writing files --------------------------------------------------------------------------------

def read_regular(name: str, max_bytes: int, dir_fd: int | None = None,
                 owners: Collection[int] | None = None) -> tuple[bytes, os.stat_result]:
    """The bytes of a regular file of at most `max_bytes` (at `name`, from `dir_fd` where given) and its stat,
    without following a link or blocking on a FIFO; HoldError (with why) for anything else, or for a file whose
    owner is not one of `owners` (where given); FileNotFoundError when it is gone."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise HoldError("is a symbolic link") from None
        raise HoldError(f"cannot be read ({error.strerror or error})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise HoldError("is not a regular file")
        if owners is not None and info.st_uid not in owners:
            raise HoldError(f"is not its directory's user's (uid {info.st_uid})")
        if info.st_size > max_bytes:
            raise HoldError(f"is larger than {max_bytes} bytes")
        data = os.read(fd, max_bytes + 1)
    except OSError as error:
        raise HoldError(f"cannot be read ({error.strerror or error})") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise HoldError(f"is larger than {max_bytes} bytes")
    return data, info


def read_small(path: str, max_bytes: int = HOLD_MAX_BYTES) -> bytes:
    return read_regular(path, max_bytes)[0]


T = TypeVar("T")
_PARSED: dict[tuple[object, ...], object] = {}
MAX_PARSED = 4096  # files whose parse is kept; more, and the oldest half goes


def parsed(info: os.stat_result, data: bytes, parse: Callable[..., T], *args: object) -> T:
    """parse(data, *args), kept while the file (its device, inode, size and times) and the arguments (what else the
    result depends on, such as the name it was read at) are the same. A parse that fails raises each time: nothing
    is kept of it."""
    key = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns, parse, *args)
    if key in _PARSED:
        return _PARSED[key]  # type: ignore[return-value]
    result = parse(data, *args)
    if len(_PARSED) >= MAX_PARSED:
        for old in list(_PARSED)[: MAX_PARSED // 2]:
            del _PARSED[old]
    _PARSED[key] = result
    return result


def write_atomic(directory: str, name: str, data: bytes, dir_fd: int | None = None, mode: int = FILE_MODE) -> None:
    """`directory/name` (or `name` in `dir_fd`) holds `data`, whole or not at all: a dot file beside it, then a
    rename. OSError where it cannot be written (IsADirectoryError: the name is a directory's)."""
    # A fresh name, made exclusively: in a directory others may write, no link or file of theirs is written through.
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    at = dir_fd if dir_fd is not None else None
    path = tmp if at is not None else os.path.join(directory, tmp)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=at)
    try:
        try:
            view = memoryview(data)
            while view:  # a short write (a full disk, a signal) is written on: nothing short is renamed into place
                written = os.write(fd, view)
                if written <= 0:
                    raise OSError(errno.EIO, "the file system took no more of it")
                view = view[written:]
            os.fchmod(fd, mode)  # the umask does not decide who can read it
        finally:
            os.close(fd)
        target = name if at is not None else os.path.join(directory, name)
        os.replace(path, target, src_dir_fd=at, dst_dir_fd=at)
    except BaseException:
        try:
            os.unlink(path, dir_fd=at)
        except OSError:
            pass
        raise


# --- formats --------------------------------------------------------------------------------------------------

def number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    result = float(value)
    return result if math.isfinite(result) else None


def load(data: bytes, fmt: int = FORMAT, what: str = "") -> dict[str, object]:
    """A JSON object of format `fmt`; HoldError for anything else."""
    try:
        loaded = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise HoldError("is not JSON") from None
    if not isinstance(loaded, dict):
        raise HoldError("is not a JSON object")
    found = loaded.get("format")
    if found != fmt or isinstance(found, bool):
        raise HoldError(f"has format {json.dumps(found)[:20]}, this forge-load reads {what}format {fmt}")
    return loaded


def hold_to_json(hold: Hold) -> bytes:
    """UTF-8 as it is (not \\u escapes, six bytes a character): MAX_REASON_CHARS of any text fit."""
    return json.dumps({"format": FORMAT, "gpu": hold.gpu_uuid, "holder": hold.holder, "reason": hold.reason,
                       "since_unix_s": hold.since_unix_s, "until_unix_s": hold.until_unix_s},
                      ensure_ascii=False).encode("utf-8", "backslashreplace")  # a lone surrogate: its JSON escape


def hold_from_json(data: bytes, gpu_uuid: str, holder: str) -> Hold:
    """The hold a file named for (gpu_uuid, holder) holds; HoldError for anything but format 1 that agrees."""
    loaded = load(data)
    gpu, gpu_uuid = loaded.get("gpu"), canonical_gpu_uuid(gpu_uuid)
    if not isinstance(gpu, str) or canonical_gpu_uuid(gpu) != gpu_uuid or loaded.get("holder") != holder:
        raise HoldError("names another GPU or holder than its file name")
    reason = loaded.get("reason", "")
    since = number(loaded.get("since_unix_s"))
    until_raw = loaded.get("until_unix_s")
    until = number(until_raw)
    if not isinstance(reason, str) or since is None or (until_raw is not None and until is None):
        raise HoldError("lacks a reason, since_unix_s or until_unix_s of the right type")
    return Hold(gpu_uuid, holder, reason, since, until)


def ack_to_json(ack: Ack, fmt: int = FILLER_FORMAT) -> bytes:
    """Format 2 names at most MAX_HOLDS holders (`fail_safe` stands for them all); format 1, every one."""
    boot = ack.written_boot
    stamp = {} if boot is None else {"boot_id": boot.boot_id, "written_boot_s": boot.boot_s}
    of_gpu = {"of_gpu": ack.of_gpu} if ack.of_gpu else {}
    held_by = list(ack.held_by[:MAX_HOLDS] if fmt == FILLER_FORMAT else ack.held_by)
    fail_safe = {"fail_safe": ack.fail_safe} if fmt == FILLER_FORMAT else {}
    return json.dumps({"format": fmt, "gpu": ack.gpu_uuid, "pid": ack.pid, "state": ack.state, "held_by": held_by,
                       **fail_safe, "drained": ack.drained, "written_unix_s": ack.written_unix_s, **stamp,
                       **of_gpu}).encode("utf-8")


def ack_from_json(data: bytes, gpu_uuid: str, fmt: int = FILLER_FORMAT) -> Ack:
    """The acknowledgement a file named for `gpu_uuid` holds; HoldError for anything else."""
    loaded = load(data, fmt, "acknowledgements of ")
    pid, state, held_by, drained = (loaded.get(k) for k in ("pid", "state", "held_by", "drained"))
    written = number(loaded.get("written_unix_s"))
    gpu, gpu_uuid = loaded.get("gpu"), canonical_gpu_uuid(gpu_uuid)
    fail_safe = loaded.get("fail_safe", False)
    if (not isinstance(gpu, str) or canonical_gpu_uuid(gpu) != gpu_uuid
            or not isinstance(pid, int) or isinstance(pid, bool)
            or not isinstance(state, str) or not isinstance(held_by, list)
            or not all(isinstance(h, str) for h in held_by) or not isinstance(drained, bool) or written is None
            or not isinstance(fail_safe, bool)):
        raise HoldError("is not a filler's acknowledgement of this GPU")
    boot_id, boot_s = loaded.get("boot_id"), number(loaded.get("written_boot_s"))
    boot = BootStamp(boot_id, boot_s) if isinstance(boot_id, str) and boot_s is not None else None
    of_gpu = loaded.get("of_gpu", "")
    of_gpu = canonical_gpu_uuid(of_gpu) if isinstance(of_gpu, str) and valid_gpu_uuid(of_gpu) else ""
    return Ack(gpu_uuid, pid, state, tuple(str(h) for h in held_by), drained, written, boot, of_gpu, fail_safe)
