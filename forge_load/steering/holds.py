"""Holds: named requests that one GPU's filler not run (docs/holds.md). Pure stdlib, no clock. This is the API over
the hold directory: one look at it (list_dir), the holds of a GPU (read_holds), placing and releasing them. The
files' names, formats and safe reads are hold_files.py (its names are this module's too); the fillers' word about
holds (their acknowledgements, exclusive mode's context) is acks.py; their directories of their own filler_dirs.py.

A look lists the directory once and counts towards its bounds only the names it reads (holds, fillers'
directories), never dot files or other names, so no neighbour's files hide a hold or cut a look short; what it
cannot use is said in one line per kind, however many names it is. Beyond MAX_HOLDS holds on one GPU, or a look
cut short, the GPU is held (fail safe).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import stat
from dataclasses import dataclass, field

from forge_load.steering.filler_dirs import parse_own_dir_name
from forge_load.steering.hold_files import (
    ACK_MAX_BYTES,
    ACK_PREFIX,
    ACK_REFRESH_S,
    ACK_STALE_S,
    DEFAULT_HOLD_DIR,
    DEFAULT_IDLE_AGE_OUT_S,
    DIR_MODE,
    FILE_MODE,
    FORMAT,
    GPU_UUID_RE,
    HOLD_MAX_BYTES,
    HOLD_PREFIX,
    HOLDER_RE,
    MAX_HOLDS,
    MAX_REASON_CHARS,
    NEW_DIR_ACK_S,
    SUFFIX,
    Ack,
    BootStamp,
    Hold,
    HoldError,
    canonical_gpu_uuid,
    hold_from_json,
    hold_name,
    hold_to_json,
    new_tag,
    parse_hold_name,
    parse_legacy_ack_name,
    parsed,
    read_regular,
    read_small,
    valid_gpu_uuid,
    valid_holder,
    write_atomic,
)

# The files' names, formats and reads are this module's names too, as they always were.
__all__ = [
    "ACK_MAX_BYTES", "ACK_PREFIX", "ACK_REFRESH_S", "ACK_STALE_S", "DEFAULT_HOLD_DIR", "DEFAULT_IDLE_AGE_OUT_S",
    "DIR_MODE", "FILE_MODE", "FORMAT", "GPU_UUID_RE", "HOLD_MAX_BYTES", "HOLD_PREFIX", "HOLDER_RE", "MAX_ENTRIES",
    "MAX_HOLDS", "MAX_LEGACY", "MAX_REASON_CHARS", "MAX_SCAN", "NEW_DIR_ACK_S", "SUFFIX", "Ack", "BootStamp", "Hold",
    "HoldError", "HoldsView", "Listing", "Problem", "all_holds", "canonical_gpu_uuid", "configured", "ensure_dir",
    "hold_from_json", "hold_name", "hold_to_json", "list_dir", "listing_problems", "parse_hold_name", "place",
    "problem_key", "read_holds", "read_holds_of", "read_small", "release", "valid_gpu_uuid", "valid_holder",
    "write_atomic",
]

MAX_SCAN: int = 65536  # entries listed in one look; more, and the look is cut short (fail safe)
MAX_ENTRIES: int = 4096  # names read in one look (holds, fillers' directories); more, and the look is cut short
MAX_LEGACY: int = 64  # acknowledgements of format 1 kept from one look (acks.py reads them only as a fallback)
SHOWN: int = 5  # names a line about many shows


class Problem(str):
    """A line about something in the directory, with a `key` that stays the same while the same kind of thing is
    there (the filler says a problem once per key, however its count or examples change)."""

    key: str

    def __new__(cls, text: str, key: str = "") -> Problem:
        made = super().__new__(cls, text)
        made.key = key or text
        return made


def problem_key(problem: str) -> str:
    return getattr(problem, "key", problem)


@dataclass(frozen=True)
class HoldsView:
    """What one GPU's holds say now: the holds honoured (unexpired), the problems met (one line each, each with a
    stable key, so that a caller can log each once), and `fail_safe`: why the GPU is held whatever the holds say."""

    holds: tuple[Hold, ...] = ()
    problems: tuple[str, ...] = ()
    fail_safe: str | None = None
    expired: tuple[Hold, ...] = ()
    mtimes_ns: dict[str, int] = field(default_factory=dict, compare=False)  # holder -> its file's mtime
    named: tuple[str, ...] = ()  # every holder a file names for this GPU, readable or not

    @property
    def held(self) -> bool:
        return bool(self.holds) or self.fail_safe is not None


@dataclass(frozen=True)
class Listing:
    """One look at the directory: the hold names by GPU, the fillers' directories, what else it holds, and whether
    it was cut short."""

    holds: dict[str, list[str]] = field(default_factory=dict)  # GPU UUID (canonical) -> holders
    names: dict[tuple[str, str], list[str]] = field(default_factory=dict)  # (GPU UUID, holder) -> its files' names
    ignored: tuple[str, ...] = ()  # the first few names that are none of ours (for the line about them)
    ignored_count: int = 0
    filler_dirs: tuple[str, ...] = ()  # names of fillers' directories (filler_dirs.py judges them)
    legacy_acks: dict[str, str] = field(default_factory=dict)  # GPU UUID -> its format-1 acknowledgement's name
    truncated: str | None = None  # why the look was cut short
    missing: bool = False  # no such directory


def list_dir(hold_dir: str) -> Listing:
    """One look; HoldError when the directory cannot be listed (`missing` when it is not there)."""
    holds: dict[str, list[str]] = {}
    names: dict[tuple[str, str], list[str]] = {}
    ignored: list[str] = []
    ignored_count = read = 0
    dirs: list[str] = []
    legacy: dict[str, str] = {}
    truncated: str | None = None
    try:
        with os.scandir(hold_dir) as entries:
            for count, entry in enumerate(entries):
                name = entry.name
                if count >= MAX_SCAN:
                    truncated = f"hold directory {hold_dir} has more than {MAX_SCAN} entries"
                    break
                if name.startswith("."):
                    continue  # the writes' temporary files, and anyone's dot files: never ours to read
                parsed_name = parse_hold_name(name) if name.startswith(HOLD_PREFIX) else None
                own_dir = parsed_name is None and name.startswith(ACK_PREFIX) and parse_own_dir_name(name) is not None
                if parsed_name is not None or own_dir:
                    read += 1
                    if read > MAX_ENTRIES:
                        truncated = f"hold directory {hold_dir} has more than {MAX_ENTRIES} holds and fillers' " \
                                    "directories"
                        break
                if parsed_name is not None:
                    if parsed_name not in names:  # one holder, one hold, however many names it has
                        holds.setdefault(parsed_name[0], []).append(parsed_name[1])
                    names.setdefault(parsed_name, []).append(name)
                elif own_dir:
                    dirs.append(name)
                elif name.startswith(ACK_PREFIX):  # format 1's files of the fillers (earlier releases, and ours)
                    uuid = parse_legacy_ack_name(name)
                    if uuid is not None and len(legacy) < MAX_LEGACY:
                        legacy.setdefault(uuid, name)
                else:
                    ignored_count += 1
                    if len(ignored) < SHOWN:
                        ignored.append(name)
    except (FileNotFoundError, NotADirectoryError):
        return Listing(missing=True)
    except OSError as error:
        raise HoldError(f"cannot list {hold_dir} ({error.strerror or error})") from None
    return Listing(holds, names, tuple(ignored), ignored_count, tuple(dirs), legacy, truncated)


def _many(count: int, shown: list[str] | tuple[str, ...]) -> str:
    return ", ".join(shown) + (f" and {count - len(shown)} more" if count > len(shown) else "")


def listing_problems(hold_dir: str, listing: Listing) -> list[str]:
    """The lines about a look itself (names that are none of ours), one for them all."""
    if not listing.ignored_count:
        return []
    shown = _many(listing.ignored_count, [repr(name) for name in listing.ignored])
    return [Problem(f"hold directory {hold_dir}: {shown} not named as a hold (hold.<GPU-UUID>.<HOLDER>.json): "
                    "ignored", key=f"ignored:{hold_dir}")]


def read_holds_of(hold_dir: str, gpu_uuids: tuple[str, ...], now_unix_s: float) -> HoldsView:
    """The holds honoured now on any of `gpu_uuids` (a GPU; a MIG device and its GPU) from one look, one per holder
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
    problems: dict[str, str] = {}
    for view in views:
        for problem in view.problems:
            problems.setdefault(problem_key(problem), problem)
    return HoldsView(tuple(sorted(honoured.values(), key=lambda h: h.holder)), tuple(problems.values()),
                     fail_safe=next((view.fail_safe for view in views if view.fail_safe is not None), None),
                     expired=tuple(h for holder, h in sorted(expired.items()) if holder not in honoured),
                     mtimes_ns=mtimes_ns, named=tuple(sorted({n for view in views for n in view.named})))


def read_holds(hold_dir: str, gpu_uuid: str, now_unix_s: float, listing: Listing | None = None) -> HoldsView:
    """The holds on one GPU honoured now (sorted by holder), and the problems met on the way."""
    try:
        listing = listing if listing is not None else list_dir(hold_dir)
    except HoldError as error:
        why = f"hold directory: {error}: GPU held until it can be read"
        return HoldsView(problems=(Problem(why, key="unlistable"),), fail_safe=str(error))
    problems = listing_problems(hold_dir, listing)
    if listing.truncated is not None:
        why = f"{listing.truncated}: GPU held until it has fewer"
        return HoldsView(problems=(*problems, Problem(why, key="truncated")), fail_safe=why)
    gpu_uuid = canonical_gpu_uuid(gpu_uuid)
    holders = sorted(listing.holds.get(gpu_uuid, []))
    if len(holders) > MAX_HOLDS:
        why = f"more than {MAX_HOLDS} holds on this GPU in {hold_dir}: GPU held until there are fewer"
        return HoldsView(problems=(*problems, Problem(why, key=f"many:{gpu_uuid}")), fail_safe=why,
                         named=tuple(holders))
    honoured: list[Hold] = []
    expired: list[Hold] = []
    mtimes_ns: dict[str, int] = {}
    unreadable: list[str] = []
    for holder in holders:
        read: list[Hold] = []
        for name in sorted(listing.names.get((gpu_uuid, holder), [hold_name(gpu_uuid, holder)])):
            try:
                data, info = read_regular(os.path.join(hold_dir, name), HOLD_MAX_BYTES)
                read.append(parsed(info, data, hold_from_json, gpu_uuid, holder))
            except FileNotFoundError:
                continue  # released while we read
            except HoldError as error:
                unreadable.append(f"{os.path.join(hold_dir, name)} {error}")
                continue
            mtimes_ns[holder] = max(info.st_mtime_ns, mtimes_ns.get(holder, info.st_mtime_ns))
        live = [h for h in read if h.until_unix_s is None or h.until_unix_s > now_unix_s]
        if live:  # a holder's files under several names: one hold, honoured while any is
            honoured.append(live[0])
        elif read:
            expired.append(read[0])
    if unreadable:  # one line for them all: a neighbour's names squatting the next holds must not flood the log
        text = (f"hold file {unreadable[0]}: ignored" if len(unreadable) == 1 else
                f"{len(unreadable)} hold files of {gpu_uuid} cannot be read as holds: ignored "
                f"({_many(len(unreadable), unreadable[:SHOWN])})")
        problems.append(Problem(text, key=f"unreadable:{gpu_uuid}"))
    return HoldsView(tuple(honoured), tuple(problems), expired=tuple(expired), mtimes_ns=mtimes_ns,
                     named=tuple(holders))


def all_holds(hold_dir: str, listing: Listing | None = None) -> tuple[list[Hold], list[str]]:
    """Every readable hold in the directory (expired ones too), by GPU then holder, and the problems; from one look."""
    listing = listing if listing is not None else list_dir(hold_dir)
    holds: list[Hold] = []
    problems: dict[str, str] = {}
    for uuid in sorted(listing.holds):
        view = read_holds(hold_dir, uuid, -math.inf, dataclasses.replace(listing, truncated=None))
        holds.extend(view.holds)
        for problem in view.problems:
            problems.setdefault(problem_key(problem), problem)
    if listing.truncated is not None:
        problems["truncated"] = f"{listing.truncated}: only the first were read"
    return holds, list(problems.values())


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


def _ours(hold_dir: str, name: str) -> bool:
    """Whether `name` is a regular file of this user's (so ours to rewrite or remove)."""
    try:
        info = os.lstat(os.path.join(hold_dir, name))
    except OSError:
        return False
    return info.st_uid == os.geteuid() and stat.S_ISREG(info.st_mode)


def _taken(hold_dir: str, name: str) -> bool:
    """Whether something other than a regular file of this user's is at `name` (a directory, another's file)."""
    try:
        return os.path.lexists(os.path.join(hold_dir, name)) and not _ours(hold_dir, name)
    except OSError:
        return False


def place(hold_dir: str, hold: Hold) -> Hold:
    """Write (or refresh) a hold; a refresh keeps the first `since_unix_s` (of a file of this user's). Where the
    hold's name is taken (a directory, another user's file it may not replace), under a name of its own. Returns the
    hold as written."""
    if not valid_gpu_uuid(hold.gpu_uuid) or not valid_holder(hold.holder):
        raise HoldError(f"not a GPU UUID and holder: {hold.gpu_uuid!r} {hold.holder!r}")
    hold = dataclasses.replace(hold, gpu_uuid=canonical_gpu_uuid(hold.gpu_uuid))
    name = hold_name(hold.gpu_uuid, hold.holder)
    try:
        listing = list_dir(hold_dir)
    except HoldError:
        listing = Listing()
    mine = [n for n in sorted(listing.names.get((hold.gpu_uuid, hold.holder), [name])) if _ours(hold_dir, n)]
    for previous_name in mine:
        with contextlib.suppress(FileNotFoundError, HoldError):
            previous = hold_from_json(read_small(os.path.join(hold_dir, previous_name)), hold.gpu_uuid, hold.holder)
            hold = dataclasses.replace(hold, since_unix_s=previous.since_unix_s)
            break
    data = hold_to_json(hold)
    if len(data) > HOLD_MAX_BYTES:
        raise HoldError(f"the hold would be larger than {HOLD_MAX_BYTES} bytes: shorten the reason")
    own_names = [n for n in mine if n != name]
    for target in [name, *own_names, hold_name(hold.gpu_uuid, hold.holder, new_tag())]:
        try:
            write_atomic(hold_dir, target, data)
        except OSError as error:
            if _taken(hold_dir, target):
                continue  # a neighbour's: placed under a name of its own
            raise HoldError(f"cannot write {os.path.join(hold_dir, target)} ({error.strerror or error})") from None
        for other in own_names:  # a hold has one name of ours: no older one outlives a refresh's until
            if other != target:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(hold_dir, other))
        return hold
    raise HoldError(f"cannot write {os.path.join(hold_dir, name)}: taken, and so is a name of its own")


def release(hold_dir: str, gpu_uuid: str, holder: str) -> bool:
    """Remove a hold under every name of it this user may remove; False when there was none. Another user's file
    under its name (a directory with the sticky bit) stays: read_holds then says whether it still holds."""
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
            if _taken(hold_dir, name):
                continue  # not ours to remove
            raise HoldError(f"cannot remove {name} from {hold_dir} ({error.strerror or error})") from None
    return removed
