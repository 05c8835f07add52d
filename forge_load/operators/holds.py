"""Holds: named requests that one GPU's filler not run (docs/holds.md). Pure stdlib; no clock is read here.

On disk (format 1), one flat directory (FORGE_HOLD_DIR, default /run/forge-load/holds):
  - `hold.<GPU-UUID>.<HOLDER>.json`: a hold, UTF-8 JSON of at most HOLD_MAX_BYTES;
  - `filler.<GPU-UUID>.json`: that GPU's filler's acknowledgement (what it honours, whether it has drained);
  - dot files: the temporary files of atomic writes (write, then rename), never holds.

Every read refuses what is not a regular file (links are not followed), never blocks on a FIFO, reads at most
HOLD_MAX_BYTES + 1 bytes and looks at most at MAX_ENTRIES names; the problems come back as lines for the filler
to log, once each. Beyond MAX_HOLDS holds on one GPU, the GPU is held (fail safe).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import secrets
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

FORMAT: int = 1
DEFAULT_HOLD_DIR: str = "/run/forge-load/holds"
HOLD_MAX_BYTES: int = 4096
MAX_HOLDS: int = 256  # per GPU; more and the GPU is held whatever they say
MAX_ENTRIES: int = 4096  # names looked at in the directory per read; more and every GPU is held
ACK_MAX_BYTES: int = 1 << 20  # our own file: every holder of a GPU held fail safe fits
ACK_STALE_S: float = 3.0  # an acknowledgement older than this has no live filler behind it
ACK_REFRESH_S: float = 1.0
# A hold over a GPU without foreign work for this long has lost its holder (docs/holds.md: why a day).
DEFAULT_IDLE_AGE_OUT_S: float = 86400.0
DIR_MODE: int = 0o755
FILE_MODE: int = 0o644

HOLDER_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}", re.ASCII)
_HEX = "[0-9a-fA-F]"
_UUID = rf"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}"
GPU_UUID_RE = re.compile(rf"(?:GPU|MIG)-{_UUID}", re.ASCII)
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
class Ack:
    gpu_uuid: str
    pid: int
    state: str
    held_by: tuple[str, ...]
    drained: bool
    written_unix_s: float


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


def hold_name(gpu_uuid: str, holder: str) -> str:
    return f"{HOLD_PREFIX}{gpu_uuid}.{holder}{SUFFIX}"


def ack_name(gpu_uuid: str) -> str:
    return f"{ACK_PREFIX}{gpu_uuid}{SUFFIX}"


def parse_hold_name(name: str) -> tuple[str, str] | None:
    """(GPU UUID, holder) of a hold's file name; None for any other name."""
    if not (name.startswith(HOLD_PREFIX) and name.endswith(SUFFIX)):
        return None
    uuid, dot, holder = name[len(HOLD_PREFIX):-len(SUFFIX)].partition(".")
    if not dot or not valid_gpu_uuid(uuid) or not valid_holder(holder):
        return None
    return uuid, holder


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
            os.write(fd, data)
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
    return json.dumps({"format": FORMAT, "gpu": hold.gpu_uuid, "holder": hold.holder, "reason": hold.reason,
                       "since_unix_s": hold.since_unix_s, "until_unix_s": hold.until_unix_s}).encode("utf-8")


def hold_from_json(data: bytes, gpu_uuid: str, holder: str) -> Hold:
    """The hold a file named for (gpu_uuid, holder) holds; HoldError for anything but format 1 that agrees."""
    loaded = _load(data)
    if loaded.get("gpu") != gpu_uuid or loaded.get("holder") != holder:
        raise HoldError("names another GPU or holder than its file name")
    reason = loaded.get("reason", "")
    since = _number(loaded.get("since_unix_s"))
    until_raw = loaded.get("until_unix_s")
    until = _number(until_raw)
    if not isinstance(reason, str) or since is None or (until_raw is not None and until is None):
        raise HoldError("lacks a reason, since_unix_s or until_unix_s of the right type")
    return Hold(gpu_uuid, holder, reason, since, until)


def ack_to_json(ack: Ack) -> bytes:
    return json.dumps({"format": FORMAT, "gpu": ack.gpu_uuid, "pid": ack.pid, "state": ack.state,
                       "held_by": list(ack.held_by), "drained": ack.drained,
                       "written_unix_s": ack.written_unix_s}).encode("utf-8")


def ack_from_json(data: bytes, gpu_uuid: str) -> Ack:
    loaded = _load(data)
    pid, state, held_by, drained = (loaded.get(k) for k in ("pid", "state", "held_by", "drained"))
    written = _number(loaded.get("written_unix_s"))
    if (loaded.get("gpu") != gpu_uuid or not isinstance(pid, int) or isinstance(pid, bool)
            or not isinstance(state, str) or not isinstance(held_by, list)
            or not all(isinstance(h, str) for h in held_by) or not isinstance(drained, bool) or written is None):
        raise HoldError("is not a filler's acknowledgement of this GPU")
    return Ack(gpu_uuid, pid, state, tuple(str(h) for h in held_by), drained, written)


# --- the API ---------------------------------------------------------------------------------------------

def ensure_dir(hold_dir: str) -> None:
    """The directory, made (mode 0755) with its parents where missing; HoldError when it cannot be."""
    try:
        if not os.path.lexists(hold_dir):
            os.makedirs(hold_dir, mode=DIR_MODE, exist_ok=True)
            os.chmod(hold_dir, DIR_MODE)  # whatever the umask: every filler must be able to read it
    except OSError as error:
        raise HoldError(f"cannot create {hold_dir} ({error.strerror or error})") from None
    if not os.path.isdir(hold_dir):
        raise HoldError(f"{hold_dir} is not a directory")


def place(hold_dir: str, hold: Hold) -> Hold:
    """Write (or refresh) a hold; a refresh keeps the first `since_unix_s`. Returns the hold as written."""
    if not valid_gpu_uuid(hold.gpu_uuid) or not valid_holder(hold.holder):
        raise HoldError(f"not a GPU UUID and holder: {hold.gpu_uuid!r} {hold.holder!r}")
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
    """Remove a hold; False when there was none."""
    try:
        os.unlink(os.path.join(hold_dir, hold_name(gpu_uuid, holder)))
    except FileNotFoundError:
        return False
    except OSError as error:
        raise HoldError(f"cannot remove {hold_name(gpu_uuid, holder)} from {hold_dir} "
                        f"({error.strerror or error})") from None
    return True


def _names(hold_dir: str) -> Iterator[str]:
    with os.scandir(hold_dir) as entries:
        for entry in entries:
            yield entry.name


@dataclass(frozen=True)
class Listing:
    """The hold names of a directory by GPU, what else it holds, and whether it was too long to read whole."""

    holds: dict[str, list[str]] = field(default_factory=dict)  # GPU UUID -> holders
    ignored: tuple[str, ...] = ()  # names that are neither holds, acknowledgements nor dot files
    truncated: bool = False
    missing: bool = False  # no such directory


def list_dir(hold_dir: str) -> Listing:
    holds: dict[str, list[str]] = {}
    ignored: list[str] = []
    try:
        for count, name in enumerate(_names(hold_dir)):
            if count >= MAX_ENTRIES:
                return Listing(holds, tuple(ignored), truncated=True)
            parsed = parse_hold_name(name)
            if parsed is not None:
                holds.setdefault(parsed[0], []).append(parsed[1])
            elif not name.startswith(".") and not (name.startswith(ACK_PREFIX) and name.endswith(SUFFIX)):
                ignored.append(name)
    except (FileNotFoundError, NotADirectoryError):
        return Listing(missing=True)
    except OSError as error:
        raise HoldError(f"cannot list {hold_dir} ({error.strerror or error})") from None
    return Listing(holds, tuple(ignored))


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
    holders = sorted(listing.holds.get(gpu_uuid, []))
    if len(holders) > MAX_HOLDS:
        why = f"more than {MAX_HOLDS} holds on this GPU in {hold_dir}: GPU held until there are fewer"
        return HoldsView(problems=(*problems, why), fail_safe=why, named=tuple(holders))
    honoured: list[Hold] = []
    expired: list[Hold] = []
    mtimes_ns: dict[str, int] = {}
    for holder in holders:
        name = hold_name(gpu_uuid, holder)
        try:
            data, mtimes_ns[holder] = _read_regular(os.path.join(hold_dir, name), HOLD_MAX_BYTES)
            hold = hold_from_json(data, gpu_uuid, holder)
        except FileNotFoundError:
            continue  # released while we read
        except HoldError as error:
            problems.append(f"hold file {os.path.join(hold_dir, name)} {error}: ignored")
            continue
        if hold.until_unix_s is not None and hold.until_unix_s <= now_unix_s:
            expired.append(hold)
        else:
            honoured.append(hold)
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


def write_ack(hold_dir: str, ack: Ack) -> None:
    write_atomic(hold_dir, ack_name(ack.gpu_uuid), ack_to_json(ack))


def read_ack(hold_dir: str, gpu_uuid: str) -> Ack | None:
    """The filler's acknowledgement of one GPU; None when there is none or it cannot be read as one."""
    try:
        return ack_from_json(read_small(os.path.join(hold_dir, ack_name(gpu_uuid)), ACK_MAX_BYTES), gpu_uuid)
    except (FileNotFoundError, NotADirectoryError, HoldError):
        return None


def acknowledged(ack: Ack | None, holder: str, placed_unix_s: float, now_unix_s: float) -> bool:
    """Whether `hold --wait` may return for this GPU: no live filler there (no acknowledgement, or one older than
    ACK_STALE_S: fail open), or its filler honours `holder`, has drained, and said so after the hold was placed."""
    if ack is None or now_unix_s - ack.written_unix_s > ACK_STALE_S:
        return True
    return holder in ack.held_by and ack.drained and ack.written_unix_s >= placed_unix_s


# --- the filler's side ------------------------------------------------------------------------------------

FAIL_SAFE_HOLDER = "-"  # no holder's name (HOLDER_RE): the GPU held because its holds cannot be counted or read


@dataclass(frozen=True)
class HoldChange:
    event: str  # "hold" or "release"; holder FAIL_SAFE_HOLDER for the fail safe
    holder: str
    reason: str  # the hold's reason ("hold"), or why it ended: released, expired, aged out ("release")
    until_unix_s: float | None = None

class HoldBoard:
    """Holds kept in this process, never on disk: what an engine the filler asks itself says (the kubelet's
    pod-resources List, service/kubelet.py). One writer replaces them all at once; every GPU's HoldWatch reads
    its own. Such a hold has no end time: it ends when the writer leaves it out, or by the idle age-out; its
    `since_unix_s` stamps it, so one that ends and comes back is a new hold."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holds: dict[str, tuple[Hold, ...]] = {}
        self._listeners: list[Callable[[], None]] = []
        self.generation = 0  # moves on every change

    def replace(self, holds: Iterable[Hold]) -> bool:
        """Every hold of the board, at once; whether anything changed (listeners are told then)."""
        by_gpu: dict[str, list[Hold]] = {}
        for hold in holds:
            by_gpu.setdefault(hold.gpu_uuid, []).append(hold)
        new = {gpu: tuple(sorted(held, key=lambda h: h.holder)) for gpu, held in by_gpu.items()}
        with self._lock:
            if new == self._holds:
                return False
            self._holds = new
            self.generation += 1
            listeners = list(self._listeners)
        for listener in listeners:
            listener()
        return True

    def holds_for(self, gpu_uuid: str) -> tuple[Hold, ...]:
        with self._lock:
            return self._holds.get(gpu_uuid, ())

    def add_listener(self, listener: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)


class HoldWatch:
    """One GPU's holds as its filler sees them, asked on every poll.

    The directory is listed again only when its mtime moved, or a second has passed since it was last listed (a
    change in the same clock tick as a listing would not move the mtime), so polling ten times a second costs a
    stat. `board` adds the holds kept in this process (HoldBoard): honoured like a file's, a file's hold of the
    same holder first. `check` says what began and ended since the last call, and each problem once. The idle age-out:
    a hold that has seen no foreign work on its GPU for `idle_age_out_s` (filler time, counted from when this
    filler first saw it, or from the last foreign work) is no longer honoured until its file is rewritten.
    """

    def __init__(self, hold_dir: str, gpu_uuid: str, idle_age_out_s: float = DEFAULT_IDLE_AGE_OUT_S,
                 board: HoldBoard | None = None) -> None:
        self.hold_dir = hold_dir
        self.gpu_uuid = gpu_uuid
        self.board = board
        self.idle_age_out_s = idle_age_out_s  # 0: never
        self.honoured: dict[str, Hold] = {}
        self.fail_safe: str | None = None
        self._view = HoldsView()
        self._mtime_ns: int | None = None
        self._listed_s = -math.inf
        self._said: set[str] = set()
        self._seen_s: dict[str, float] = {}  # holder -> filler time it was first honoured (or rewritten)
        self._stamp: dict[str, int] = {}  # holder -> its file's mtime: a rewrite (a refresh) moves it
        self._aged: dict[str, int] = {}  # holders aged out, and their file's mtime then
        self._last_foreign_s = -math.inf
        self.generation = 0  # moves whenever a hold file of this GPU changed

    @property
    def held(self) -> bool:
        return bool(self.honoured) or self.fail_safe is not None

    @property
    def holders(self) -> tuple[str, ...]:
        """The holders honoured now; under the fail safe, every holder a file names."""
        if self.fail_safe is not None:
            return tuple(sorted(set(self.honoured) | set(self._view.named)))
        return tuple(sorted(self.honoured))

    def foreign_seen(self, now_s: float) -> None:
        """Foreign work on the GPU now: no hold on it is idle."""
        self._last_foreign_s = now_s

    def _changed(self, now_s: float) -> bool:
        try:
            mtime_ns: int | None = os.stat(self.hold_dir).st_mtime_ns
        except OSError:
            mtime_ns = None
        if mtime_ns != self._mtime_ns or now_s - self._listed_s >= 1.0:
            self._mtime_ns = mtime_ns
            self._listed_s = now_s
            return True
        return False

    def check(self, now_s: float, now_unix_s: float) -> tuple[list[HoldChange], list[str]]:
        """(what began and ended, problems not said before); `now_s` on the filler's clock."""
        if self._changed(now_s):
            before = self._view.mtimes_ns
            self._view = read_holds(self.hold_dir, self.gpu_uuid, now_unix_s)
            if self._view.mtimes_ns != before:
                self.generation += 1  # a hold of this GPU placed, refreshed or removed: acknowledge it at once
        view = self._view
        holds, stamps = list(view.holds), dict(view.mtimes_ns)
        if self.board is not None:
            from_files = {h.holder for h in view.holds} | {h.holder for h in view.expired}
            for hold in self.board.holds_for(self.gpu_uuid):
                if hold.holder not in from_files:
                    holds.append(hold)
                    stamps[hold.holder] = round(hold.since_unix_s * 1e9)
        problems = [p for p in view.problems if p not in self._said]
        self._said = set(view.problems)  # only what is there now: bounded, and said again if it comes back
        fail_safe_before, self.fail_safe = self.fail_safe, view.fail_safe
        live: dict[str, Hold] = {}
        why_gone: dict[str, str] = {h.holder: "expired" for h in view.expired}
        for hold in holds:
            if hold.until_unix_s is not None and hold.until_unix_s <= now_unix_s:
                why_gone[hold.holder] = "expired"  # expired since the directory was read
                continue
            stamp = stamps.get(hold.holder, 0)
            if self._aged.get(hold.holder) == stamp:
                continue
            self._aged.pop(hold.holder, None)
            if self._stamp.get(hold.holder) != stamp:
                self._seen_s[hold.holder] = now_s  # new or refreshed: its idle time counts from now
                self._stamp[hold.holder] = stamp
            idle_from_s = max(self._seen_s[hold.holder], self._last_foreign_s)
            if self.idle_age_out_s > 0 and now_s - idle_from_s >= self.idle_age_out_s:
                self._aged[hold.holder] = stamp
                why_gone[hold.holder] = "aged out"
                continue
            live[hold.holder] = hold
        changes = [HoldChange("release", holder, why_gone.get(holder, "released"))
                   for holder in sorted(self.honoured) if holder not in live]
        changes += [HoldChange("hold", holder, hold.reason, hold.until_unix_s)
                    for holder, hold in sorted(live.items()) if holder not in self.honoured]
        for holder in set(self._stamp) - set(live) - set(self._aged):
            self._stamp.pop(holder, None)
            self._seen_s.pop(holder, None)
        for holder in set(self._aged) - {h.holder for h in holds}:
            self._aged.pop(holder)  # its file is gone: a new one is a new hold
        self.honoured = live
        if self.fail_safe is not None and fail_safe_before is None:
            changes.append(HoldChange("hold", FAIL_SAFE_HOLDER, self.fail_safe))
        elif self.fail_safe is None and fail_safe_before is not None:
            changes.insert(0, HoldChange("release", FAIL_SAFE_HOLDER, "the hold directory can be read again"))
        return changes, problems


class FillerHolds:
    """A filler's side of one GPU's holds: the watch, and the acknowledgement it keeps in the directory (written
    at once on every change of what it honours, its state or its drain, and at least every ACK_REFRESH_S).

    The acknowledgement is written only where the directory exists (the filler never creates it); a write that
    fails is said once (`ack_problem`) and tried again at the next change or refresh."""

    def __init__(self, hold_dir: str, gpu_uuid: str, pid: int, wall_clock: Callable[[], float],
                 idle_age_out_s: float = DEFAULT_IDLE_AGE_OUT_S, board: HoldBoard | None = None) -> None:
        self.watch = HoldWatch(hold_dir, gpu_uuid, idle_age_out_s, board)
        self.hold_dir = hold_dir
        self.gpu_uuid = gpu_uuid
        self.pid = pid
        self.wall_clock = wall_clock
        self._last: tuple[str, tuple[str, ...], bool, int] | None = None
        self._written_s = -math.inf
        self._failed: str | None = None

    @property
    def held(self) -> bool:
        return self.watch.held

    @property
    def generation(self) -> int:
        """Moves when the in-process holds change: the filler asks again at once, not at its next reading."""
        return self.watch.board.generation if self.watch.board is not None else 0

    def check(self, now_s: float) -> tuple[list[HoldChange], list[str]]:
        return self.watch.check(now_s, self.wall_clock())

    def foreign_seen(self, now_s: float) -> None:
        self.watch.foreign_seen(now_s)

    def acknowledge(self, now_s: float, state: str, drained: bool) -> str | None:
        """Write the acknowledgement if it changed or is due; a problem line the first time a write fails."""
        said = (state, self.watch.holders, drained, self.watch.generation)  # a refreshed hold is acknowledged too
        if said == self._last and now_s - self._written_s < ACK_REFRESH_S:
            return None
        self._last, self._written_s = said, now_s
        try:
            write_ack(self.hold_dir, Ack(self.gpu_uuid, self.pid, state, said[1], drained, self.wall_clock()))
        except FileNotFoundError:
            return None  # no hold directory (not mounted): nothing to acknowledge to
        except OSError as error:
            problem = (f"cannot write the acknowledgement {os.path.join(self.hold_dir, ack_name(self.gpu_uuid))} "
                       f"({error.strerror or error}): `forge-load hold --wait` cannot see this filler drain; "
                       "is the hold directory mounted read-write?")
            first, self._failed = self._failed is None, problem
            return problem if first else None
        self._failed = None
        return None

    def close(self) -> None:
        """The filler stops: no acknowledgement left behind (`hold --wait` need not wait for it to go stale)."""
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.hold_dir, ack_name(self.gpu_uuid)))
