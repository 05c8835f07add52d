"""Holds: named requests that one GPU's filler not run (docs/holds.md). Pure stdlib; the only clock read here is
boot_stamp(), the host's boot clock (forge_load/clock.py) that acknowledgements are judged by, and only when a caller
asks for it.

On disk (format 1), one flat directory (FORGE_HOLD_DIR, default /run/forge-load/holds):
  - `hold.<GPU-UUID>.<HOLDER>.json`: a hold, UTF-8 JSON of at most HOLD_MAX_BYTES;
  - `filler.<GPU-UUID>.json`: that GPU's filler's acknowledgement (what it honours, whether it has drained); a MIG
    device's names its GPU (`of_gpu`): a hold on that GPU holds it too;
  - `filler.<GPU-UUID>.lock`: locked while exclusive mode's child holds a CUDA context on that GPU;
  - dot files: the temporary files of atomic writes (write, then rename), never holds.

Every read refuses what is not a regular file (links are not followed), never blocks on a FIFO, reads at most
HOLD_MAX_BYTES + 1 bytes and looks at most at MAX_ENTRIES names; the problems come back as lines for the filler
to log, once each. Beyond MAX_HOLDS holds on one GPU, the GPU is held (fail safe).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import json
import math
import os
import re
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field

from forge_load.clock import boot_time_s

FORMAT: int = 1
DEFAULT_HOLD_DIR: str = "/run/forge-load/holds"
HOLD_MAX_BYTES: int = 4096
# A reason is limited in the characters a user types: any this many fit a hold of HOLD_MAX_BYTES, at 4 bytes of UTF-8
# (or 2 of a JSON escape) each, beside the longest GPU id, holder and times (240 bytes; tests/test_holds_input.py).
MAX_REASON_CHARS: int = 900
MAX_HOLDS: int = 256  # per GPU; more and the GPU is held whatever they say
MAX_ENTRIES: int = 4096  # names looked at in the directory per read; more and every GPU is held
ACK_MAX_BYTES: int = 1 << 20  # our own file: every holder of a GPU held fail safe fits
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
_HEX = "[0-9a-fA-F]"
_UUID = rf"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}"
GPU_UUID_RE = re.compile(rf"(?i:GPU|MIG)-{_UUID}", re.ASCII)  # any case: canonical_gpu_uuid says which GPU
HOLD_PREFIX, ACK_PREFIX, SUFFIX = "hold.", "filler.", ".json"


class HoldError(Exception):
    """A hold that cannot be written or read as asked; the message is one line."""


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


@dataclass(frozen=True)
class HoldsView:
    """What one GPU's holds say now: the holds honoured (unexpired), the problems met (one line each, stable
    text, so that a caller can log each once), and `fail_safe`: why the GPU is held whatever the holds say."""

    holds: tuple[Hold, ...] = ()
    problems: tuple[str, ...] = ()
    fail_safe: str | None = None
    expired: tuple[Hold, ...] = ()
    mtimes_ns: dict[str, int] = field(default_factory=dict, compare=False)  # holder -> its file's mtime
    named: tuple[str, ...] = ()  # every holder a file names for this GPU, readable or not

    @property
    def held(self) -> bool:
        return bool(self.holds) or self.fail_safe is not None


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


def hold_name(gpu_uuid: str, holder: str) -> str:
    return f"{HOLD_PREFIX}{canonical_gpu_uuid(gpu_uuid)}.{holder}{SUFFIX}"


def ack_name(gpu_uuid: str) -> str:
    return f"{ACK_PREFIX}{canonical_gpu_uuid(gpu_uuid)}{SUFFIX}"


def parse_hold_name(name: str) -> tuple[str, str] | None:
    """(GPU UUID, canonical, and holder) of a hold's file name; None for any other name."""
    if not (name.startswith(HOLD_PREFIX) and name.endswith(SUFFIX)):
        return None
    uuid, dot, holder = name[len(HOLD_PREFIX):-len(SUFFIX)].partition(".")
    if not dot or not valid_gpu_uuid(uuid) or not valid_holder(holder):
        return None
    return canonical_gpu_uuid(uuid), holder


# --- reading and writing files --------------------------------------------------------------------------------

def read_small(path: str, max_bytes: int = HOLD_MAX_BYTES) -> bytes:
    """The bytes of a regular file of at most `max_bytes`, without following a link or blocking on a FIFO;
    HoldError (with why) for anything else, FileNotFoundError when it is gone."""
    return _read_regular(path, max_bytes)[0]


def _read_regular(path: str, max_bytes: int) -> tuple[bytes, int]:
    """read_small's bytes and the file's mtime (ns)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
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
        data = os.read(fd, max_bytes + 1)
    except OSError as error:
        raise HoldError(f"cannot be read ({error.strerror or error})") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise HoldError(f"is larger than {max_bytes} bytes")
    return data, info.st_mtime_ns


def write_atomic(directory: str, name: str, data: bytes) -> None:
    """`directory/name` holds `data`, whole or not at all: a dot file beside it, then a rename."""
    # A fresh name, made exclusively: in a directory others may write, no link or file of theirs is written through.
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        try:
            view = memoryview(data)
            while view:  # a short write (a full disk, a signal) is written on: nothing short is renamed into place
                written = os.write(fd, view)
                if written <= 0:
                    raise OSError(errno.EIO, "the file system took no more of it")
                view = view[written:]
            os.fchmod(fd, FILE_MODE)  # the umask does not decide who can read a hold
        finally:
            os.close(fd)
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _load(data: bytes) -> dict[str, object]:
    try:
        loaded = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise HoldError("is not JSON") from None
    if not isinstance(loaded, dict):
        raise HoldError("is not a JSON object")
    fmt = loaded.get("format")
    if fmt != FORMAT or isinstance(fmt, bool):
        raise HoldError(f"has format {json.dumps(fmt)[:20]}, this forge-load reads format {FORMAT}")
    return loaded


def hold_to_json(hold: Hold) -> bytes:
    """UTF-8 as it is (not \\u escapes, six bytes a character): MAX_REASON_CHARS of any text fit."""
    return json.dumps({"format": FORMAT, "gpu": hold.gpu_uuid, "holder": hold.holder, "reason": hold.reason,
                       "since_unix_s": hold.since_unix_s, "until_unix_s": hold.until_unix_s},
                      ensure_ascii=False).encode("utf-8", "backslashreplace")  # a lone surrogate: its JSON escape


def hold_from_json(data: bytes, gpu_uuid: str, holder: str) -> Hold:
    """The hold a file named for (gpu_uuid, holder) holds; HoldError for anything but format 1 that agrees."""
    loaded = _load(data)
    gpu, gpu_uuid = loaded.get("gpu"), canonical_gpu_uuid(gpu_uuid)
    if not isinstance(gpu, str) or canonical_gpu_uuid(gpu) != gpu_uuid or loaded.get("holder") != holder:
        raise HoldError("names another GPU or holder than its file name")
    reason = loaded.get("reason", "")
    since = _number(loaded.get("since_unix_s"))
    until_raw = loaded.get("until_unix_s")
    until = _number(until_raw)
    if not isinstance(reason, str) or since is None or (until_raw is not None and until is None):
        raise HoldError("lacks a reason, since_unix_s or until_unix_s of the right type")
    return Hold(gpu_uuid, holder, reason, since, until)


def ack_to_json(ack: Ack) -> bytes:
    boot = ack.written_boot
    stamp = {} if boot is None else {"boot_id": boot.boot_id, "written_boot_s": boot.boot_s}
    of_gpu = {"of_gpu": ack.of_gpu} if ack.of_gpu else {}
    return json.dumps({"format": FORMAT, "gpu": ack.gpu_uuid, "pid": ack.pid, "state": ack.state,
                       "held_by": list(ack.held_by), "drained": ack.drained,
                       "written_unix_s": ack.written_unix_s, **stamp, **of_gpu}).encode("utf-8")


def ack_from_json(data: bytes, gpu_uuid: str) -> Ack:
    loaded = _load(data)
    pid, state, held_by, drained = (loaded.get(k) for k in ("pid", "state", "held_by", "drained"))
    written = _number(loaded.get("written_unix_s"))
    gpu, gpu_uuid = loaded.get("gpu"), canonical_gpu_uuid(gpu_uuid)
    if (not isinstance(gpu, str) or canonical_gpu_uuid(gpu) != gpu_uuid
            or not isinstance(pid, int) or isinstance(pid, bool)
            or not isinstance(state, str) or not isinstance(held_by, list)
            or not all(isinstance(h, str) for h in held_by) or not isinstance(drained, bool) or written is None):
        raise HoldError("is not a filler's acknowledgement of this GPU")
    boot_id, boot_s = loaded.get("boot_id"), _number(loaded.get("written_boot_s"))
    boot = BootStamp(boot_id, boot_s) if isinstance(boot_id, str) and boot_s is not None else None
    of_gpu = loaded.get("of_gpu", "")
    of_gpu = canonical_gpu_uuid(of_gpu) if isinstance(of_gpu, str) and valid_gpu_uuid(of_gpu) else ""
    return Ack(gpu_uuid, pid, state, tuple(str(h) for h in held_by), drained, written, boot, of_gpu)


# --- the API ---------------------------------------------------------------------------------------------

def configured(hold_dir: str) -> bool:
    """Holds are configured when their directory exists: the hold commands, the Slurm prolog or the deploy files
    made it. A filler cannot tell a directory nobody writes from one whose next job is not announced yet."""
    return bool(hold_dir) and os.path.isdir(hold_dir)


def ensure_dir(hold_dir: str) -> bool:
    """The directory, made (mode 0755) with its parents where missing; whether it was made here. HoldError when it
    cannot be."""
    made = False
    try:
        if not os.path.lexists(hold_dir):
            os.makedirs(hold_dir, mode=DIR_MODE, exist_ok=True)
            os.chmod(hold_dir, DIR_MODE)  # whatever the umask: every filler must be able to read it
            made = True
    except OSError as error:
        raise HoldError(f"cannot create {hold_dir} ({error.strerror or error})") from None
    if not os.path.isdir(hold_dir):
        raise HoldError(f"{hold_dir} is not a directory")
    return made


def place(hold_dir: str, hold: Hold) -> Hold:
    """Write (or refresh) a hold; a refresh keeps the first `since_unix_s`. Returns the hold as written."""
    if not valid_gpu_uuid(hold.gpu_uuid) or not valid_holder(hold.holder):
        raise HoldError(f"not a GPU UUID and holder: {hold.gpu_uuid!r} {hold.holder!r}")
    hold = dataclasses.replace(hold, gpu_uuid=canonical_gpu_uuid(hold.gpu_uuid))
    name = hold_name(hold.gpu_uuid, hold.holder)
    try:
        previous = hold_from_json(read_small(os.path.join(hold_dir, name)), hold.gpu_uuid, hold.holder)
        hold = Hold(hold.gpu_uuid, hold.holder, hold.reason, previous.since_unix_s, hold.until_unix_s)
    except (FileNotFoundError, HoldError):
        pass  # a new hold, or one unreadable: replaced
    data = hold_to_json(hold)
    if len(data) > HOLD_MAX_BYTES:
        raise HoldError(f"the hold would be larger than {HOLD_MAX_BYTES} bytes: shorten the reason")
    try:
        write_atomic(hold_dir, name, data)
    except OSError as error:
        raise HoldError(f"cannot write {os.path.join(hold_dir, name)} ({error.strerror or error})") from None
    return hold


def release(hold_dir: str, gpu_uuid: str, holder: str) -> bool:
    """Remove a hold, in whatever spelling of the UUID its file is named; False when there was none."""
    gpu_uuid = canonical_gpu_uuid(gpu_uuid)
    names = {hold_name(gpu_uuid, holder)}
    with contextlib.suppress(HoldError):
        names.update(list_dir(hold_dir).names.get((gpu_uuid, holder), ()))
    removed = False
    for name in sorted(names):
        try:
            os.unlink(os.path.join(hold_dir, name))
            removed = True
        except FileNotFoundError:
            pass
        except OSError as error:
            raise HoldError(f"cannot remove {name} from {hold_dir} ({error.strerror or error})") from None
    return removed


def _names(hold_dir: str) -> Iterator[str]:
    with os.scandir(hold_dir) as entries:
        for entry in entries:
            yield entry.name


@dataclass(frozen=True)
class Listing:
    """The hold names of a directory by GPU, what else it holds, and whether it was too long to read whole."""

    holds: dict[str, list[str]] = field(default_factory=dict)  # GPU UUID (canonical) -> holders
    names: dict[tuple[str, str], list[str]] = field(default_factory=dict)  # (GPU UUID, holder) -> its files' names
    ignored: tuple[str, ...] = ()  # names that are neither holds, acknowledgements nor dot files
    truncated: bool = False
    missing: bool = False  # no such directory


def list_dir(hold_dir: str) -> Listing:
    holds: dict[str, list[str]] = {}
    names: dict[tuple[str, str], list[str]] = {}
    ignored: list[str] = []
    try:
        for count, name in enumerate(_names(hold_dir)):
            if count >= MAX_ENTRIES:
                return Listing(holds, names, tuple(ignored), truncated=True)
            parsed = parse_hold_name(name)
            if parsed is not None:
                if parsed not in names:  # one holder, one hold, however many spellings of the UUID name it
                    holds.setdefault(parsed[0], []).append(parsed[1])
                names.setdefault(parsed, []).append(name)
            elif not name.startswith(".") and not name.startswith(ACK_PREFIX):  # filler.*: the filler's own
                ignored.append(name)
    except (FileNotFoundError, NotADirectoryError):
        return Listing(missing=True)
    except OSError as error:
        raise HoldError(f"cannot list {hold_dir} ({error.strerror or error})") from None
    return Listing(holds, names, tuple(ignored))


def read_holds_of(hold_dir: str, gpu_uuids: tuple[str, ...], now_unix_s: float) -> HoldsView:
    """The holds honoured now on any of `gpu_uuids` (a GPU; a MIG device and its GPU) from one listing, one per holder
    (the first UUID's first): read_holds' view of them all, the same as read_holds' for one UUID."""
    try:
        listing = list_dir(hold_dir)
    except HoldError:
        return read_holds(hold_dir, gpu_uuids[0], now_unix_s)  # it says why, and holds fail safe
    views = [read_holds(hold_dir, uuid, now_unix_s, listing) for uuid in gpu_uuids]
    honoured: dict[str, Hold] = {}
    expired: dict[str, Hold] = {}
    for view in views:
        for hold in view.holds:
            honoured.setdefault(hold.holder, hold)
        for hold in view.expired:
            expired.setdefault(hold.holder, hold)
    mtimes_ns: dict[str, int] = {}
    for view in views:
        for holder, mtime_ns in view.mtimes_ns.items():
            mtimes_ns[holder] = max(mtime_ns, mtimes_ns.get(holder, mtime_ns))
    return HoldsView(tuple(sorted(honoured.values(), key=lambda h: h.holder)),
                     tuple(dict.fromkeys(p for view in views for p in view.problems)),
                     fail_safe=next((view.fail_safe for view in views if view.fail_safe is not None), None),
                     expired=tuple(h for holder, h in sorted(expired.items()) if holder not in honoured),
                     mtimes_ns=mtimes_ns, named=tuple(sorted({n for view in views for n in view.named})))


def read_holds(hold_dir: str, gpu_uuid: str, now_unix_s: float, listing: Listing | None = None) -> HoldsView:
    """The holds on one GPU honoured now (sorted by holder), and the problems met on the way."""
    try:
        listing = listing if listing is not None else list_dir(hold_dir)
    except HoldError as error:
        return HoldsView(problems=(f"hold directory: {error}: GPU held until it can be read",),
                         fail_safe=str(error))
    problems: list[str] = []
    if listing.ignored:  # one line for them all: a directory shared with other files must not flood the log
        shown = ", ".join(repr(name) for name in listing.ignored[:5])
        more = f" and {len(listing.ignored) - 5} more" if len(listing.ignored) > 5 else ""
        problems.append(f"hold directory {hold_dir}: {shown}{more} not named as a hold "
                        "(hold.<GPU-UUID>.<HOLDER>.json): ignored")
    if listing.truncated:
        why = f"hold directory {hold_dir} has more than {MAX_ENTRIES} entries: GPU held until it has fewer"
        return HoldsView(problems=(*problems, why), fail_safe=why)
    gpu_uuid = canonical_gpu_uuid(gpu_uuid)
    holders = sorted(listing.holds.get(gpu_uuid, []))
    if len(holders) > MAX_HOLDS:
        why = f"more than {MAX_HOLDS} holds on this GPU in {hold_dir}: GPU held until there are fewer"
        return HoldsView(problems=(*problems, why), fail_safe=why, named=tuple(holders))
    honoured: list[Hold] = []
    expired: list[Hold] = []
    mtimes_ns: dict[str, int] = {}
    for holder in holders:
        read: list[Hold] = []
        for name in sorted(listing.names.get((gpu_uuid, holder), [hold_name(gpu_uuid, holder)])):
            try:
                data, mtime_ns = _read_regular(os.path.join(hold_dir, name), HOLD_MAX_BYTES)
                read.append(hold_from_json(data, gpu_uuid, holder))
            except FileNotFoundError:
                continue  # released while we read
            except HoldError as error:
                problems.append(f"hold file {os.path.join(hold_dir, name)} {error}: ignored")
                continue
            mtimes_ns[holder] = max(mtime_ns, mtimes_ns.get(holder, mtime_ns))
        live = [h for h in read if h.until_unix_s is None or h.until_unix_s > now_unix_s]
        if live:  # a holder's files in two spellings of the UUID: one hold, honoured while either is
            honoured.append(live[0])
        elif read:
            expired.append(read[0])
    return HoldsView(tuple(honoured), tuple(problems), expired=tuple(expired), mtimes_ns=mtimes_ns,
                     named=tuple(holders))


def all_holds(hold_dir: str) -> tuple[list[Hold], list[str]]:
    """Every readable hold in the directory (expired ones too), by GPU then holder, and the problems."""
    listing = list_dir(hold_dir)
    holds: list[Hold] = []
    problems: list[str] = []
    for uuid in sorted(listing.holds):
        view = read_holds(hold_dir, uuid, -math.inf, listing)
        holds.extend(view.holds)
        problems.extend(p for p in view.problems if p not in problems)
    if listing.truncated:
        problems.append(f"more than {MAX_ENTRIES} entries: only the first were read")
    return holds, problems


def context_lock_name(gpu_uuid: str) -> str:
    return f"{ACK_PREFIX}{canonical_gpu_uuid(gpu_uuid)}.lock"


def lock_taken(path: str) -> bool | None:
    """Whether a process holds an exclusive flock on the regular file at `path` now, asked without blocking by a
    shared lock let go at once; None when that cannot be told (no such file, not a regular file, unreadable)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # let go at once, by the close below
        return False
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)


def context_held(hold_dir: str, gpu_uuid: str) -> bool:
    """Whether a live process of ours holds (or is about to create) a CUDA context on this GPU in exclusive mode: the
    flock its child keeps on context_lock_name for its life (service/exclusive_child.py) is taken. No file (no
    child of ours has ever run here) or one that cannot be read is not held."""
    return lock_taken(os.path.join(hold_dir, context_lock_name(gpu_uuid))) is True


def any_context_held(hold_dir: str, gpu_uuid: str, migs: list[Ack]) -> bool:
    """context_held on the GPU or on any of its MIG devices (`migs`: its MIG devices' acknowledgements, stale ones
    too, as mig_acks reads them: a MIG device in exclusive mode has a child and a lock of its own)."""
    return any(context_held(hold_dir, uuid) for uuid in (gpu_uuid, *(ack.gpu_uuid for ack in migs)))


def write_ack(hold_dir: str, ack: Ack) -> None:
    write_atomic(hold_dir, ack_name(ack.gpu_uuid), ack_to_json(ack))


def read_ack(hold_dir: str, gpu_uuid: str) -> Ack | None:
    """The filler's acknowledgement of one GPU; None when there is none or it cannot be read as one."""
    try:
        return ack_from_json(read_small(os.path.join(hold_dir, ack_name(gpu_uuid)), ACK_MAX_BYTES), gpu_uuid)
    except (FileNotFoundError, NotADirectoryError, HoldError):
        return None


def mig_acks(hold_dir: str, gpu_uuid: str) -> list[Ack]:
    """The acknowledgements of the MIG devices of one GPU (those whose `of_gpu` names it), by UUID: each MIG device's
    filler honours the GPU's holds. At most MAX_ENTRIES names are looked at; none where the directory cannot be read."""
    gpu_uuid = canonical_gpu_uuid(gpu_uuid)
    found: list[Ack] = []
    with contextlib.suppress(OSError):
        for count, name in enumerate(_names(hold_dir)):
            if count >= MAX_ENTRIES:
                break
            uuid = name.removeprefix(ACK_PREFIX).removesuffix(SUFFIX)
            if name == ack_name(uuid) and uuid.upper().startswith("MIG-") and valid_gpu_uuid(uuid):
                ack = read_ack(hold_dir, uuid)
                if ack is not None and ack.of_gpu == gpu_uuid:
                    found.append(ack)
    return sorted(found, key=lambda ack: ack.gpu_uuid)


@functools.cache
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            return file.read(64).strip()
    except (OSError, ValueError):
        return ""


def boot_stamp() -> BootStamp:
    """Now on this host's boot clock; OSError where the platform has none."""
    boot_s = boot_time_s()
    if boot_s is None:
        raise OSError("this host has no boot clock (CLOCK_BOOTTIME)")
    return BootStamp(_boot_id(), boot_s)


def _ack_times(ack: Ack, now_unix_s: float, now_boot: BootStamp | None) -> tuple[float, float] | None:
    """(the acknowledgement's age, when it was written) on the boot clock where both sides stamped it, else on the
    wall clock (a filler of an earlier release); None for one written before this boot (no filler of this boot)."""
    if ack.written_boot is not None and now_boot is not None:
        if ack.written_boot.boot_id != now_boot.boot_id:
            return None
        return now_boot.boot_s - ack.written_boot.boot_s, ack.written_boot.boot_s
    return now_unix_s - ack.written_unix_s, ack.written_unix_s


def ack_live(ack: Ack | None, now_unix_s: float, now_boot: BootStamp | None) -> bool:
    """Whether a live filler stands behind the acknowledgement: one written within ACK_STALE_S, in this boot."""
    times = _ack_times(ack, now_unix_s, now_boot) if ack is not None else None
    return times is not None and times[0] <= ACK_STALE_S


def acknowledged(ack: Ack | None, holder: str, placed_unix_s: float, now_unix_s: float,
                 placed_boot: BootStamp | None = None, now_boot: BootStamp | None = None) -> bool:
    """Whether `hold --wait` may return for this GPU: no live filler there (no acknowledgement, or one older than
    ACK_STALE_S: fail open), or its filler honours `holder`, has drained, and said so after the hold was placed.
    Age and order are judged on the boot clock where the filler stamped it and the caller gives `placed_boot` and
    `now_boot`: a step of either side's wall clock then changes nothing."""
    if placed_boot is None or now_boot is None:
        placed_boot = now_boot = None  # one clock for all three times
    if ack is None or not ack_live(ack, now_unix_s, now_boot):
        return True
    times = _ack_times(ack, now_unix_s, now_boot)
    assert times is not None
    placed_s = placed_boot.boot_s if ack.written_boot is not None and placed_boot is not None else placed_unix_s
    return holder in ack.held_by and ack.drained and times[1] >= placed_s
