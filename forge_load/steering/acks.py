"""The fillers' word about holds (docs/holds.md: on disk): a filler's acknowledgement, in its own directory
(filler_dirs.py), and exclusive mode's context lock beside it; read for `hold --wait` and `holds` in one look a poll
(FillersLook), and judged on the host's boot clock. Pure stdlib; the only clock read is boot_stamp(), the host's
boot clock (forge_load/clock.py), and only when a caller asks for it.

The files of format 1 in the hold directory itself (`filler.<GPU-UUID>.json` and the `flock` of
`filler.<GPU-UUID>.lock`), which a neighbour could plant or lock, are written for the hold commands of earlier
releases and read here only for a GPU no filler of this release acknowledges: a filler of an earlier release is
seen as it was.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import stat
from dataclasses import dataclass

from forge_load.clock import boot_time_s
from forge_load.steering.filler_dirs import (
    FillerDir,
    OwnDir,
    ack_file,
    close_all,
    context_file,
    open_filler_dirs,
    parse_ack_file,
)
from forge_load.steering.hold_files import (
    ACK_MAX_BYTES,
    ACK_STALE_S,
    FORMAT,
    LEGACY_ACK_MAX_BYTES,
    Ack,
    BootStamp,
    HoldError,
    ack_from_json,
    ack_to_json,
    canonical_gpu_uuid,
    legacy_ack_name,
    legacy_context_lock_name,
    parsed,
    read_regular,
    write_atomic,
)
from forge_load.steering.holds import Listing, list_dir

MAX_MIG_ACKS = 64  # acknowledgements of one GPU's MIG devices read in one look (a GPU has at most seven)


def write_ack(own: OwnDir | str, ack: Ack) -> None:
    """This release's acknowledgement, in the filler's own directory (`own`, or this user's in the hold directory
    `own` names); OSError or HoldError where it cannot be."""
    if isinstance(own, str):
        opened = OwnDir(own)
        try:
            write_ack(opened, ack)
        finally:
            opened.forget()
        return
    own.write(ack_file(ack.gpu_uuid, ack.of_gpu), ack_to_json(ack))


def write_legacy_ack(hold_dir: str, ack: Ack) -> None:
    """Format 1's, in the hold directory itself, for the hold commands of earlier releases."""
    write_atomic(hold_dir, legacy_ack_name(ack.gpu_uuid), ack_to_json(ack, FORMAT))


def remove_legacy_ack(hold_dir: str, gpu_uuid: str) -> None:
    """Format 1's acknowledgement goes with its filler, where it is this user's."""
    path = os.path.join(hold_dir, legacy_ack_name(gpu_uuid))
    with contextlib.suppress(OSError):
        if os.lstat(path).st_uid == os.geteuid():
            os.unlink(path)


@dataclass(frozen=True)
class Word:
    """What the fillers of one GPU say in one look: `acks`, those of the GPU and of its MIG devices, live or not;
    `unreadable`, acknowledgements of it that could not be read (a filler there whose word is unknown); `context`,
    whether a context of ours may be on it or its MIG devices (a context lock held); `complete`, whether the look
    saw every filler's directory; `legacy`, read from format 1 (no filler of this release acknowledges it)."""

    acks: tuple[Ack, ...] = ()
    unreadable: int = 0
    context: bool = False
    complete: bool = True
    legacy: bool = False


class FillersLook:
    """The fillers' acknowledgements and context locks in a hold directory, from one look at it: each file read at
    most once (and not again while unchanged: hold_files.parsed), each GPU's word made once. Use it in a `with`."""

    def __init__(self, hold_dir: str, listing: Listing | None = None) -> None:
        self.hold_dir = hold_dir
        try:
            self.listing = listing if listing is not None else list_dir(hold_dir)
        except HoldError as error:
            self.listing = Listing(truncated=str(error))
        self.dirs, self.problems, whole = open_filler_dirs(hold_dir, self.listing.filler_dirs)
        self.complete = self.listing.truncated is None and whole
        self._own: dict[str, list[tuple[FillerDir, str]]] = {}  # GPU -> its acknowledgements' files
        self._migs: dict[str, list[tuple[FillerDir, str, str]]] = {}  # GPU -> its MIG devices' (dir, file, MIG UUID)
        for found in self.dirs:
            for name in found.entries:
                names = parse_ack_file(name)
                if names is None:
                    continue
                uuid, of_gpu = names
                self._own.setdefault(uuid, []).append((found, name))
                if of_gpu:
                    self._migs.setdefault(of_gpu, []).append((found, name, uuid))
        self._words: dict[str, Word] = {}

    def __enter__(self) -> FillersLook:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        close_all(self.dirs)
        self.dirs = []

    def word(self, gpu_uuid: str) -> Word:
        gpu_uuid = canonical_gpu_uuid(gpu_uuid)
        if gpu_uuid not in self._words:
            self._words[gpu_uuid] = self._word(gpu_uuid)
        return self._words[gpu_uuid]

    def _word(self, gpu_uuid: str) -> Word:
        files = [(found, name, gpu_uuid) for found, name in self._own.get(gpu_uuid, [])]
        migs = self._migs.get(gpu_uuid, [])
        unreadable = max(len(migs) - MAX_MIG_ACKS, 0)
        files += migs[:MAX_MIG_ACKS]
        context = self._context({gpu_uuid, *(uuid for _, _, uuid in migs)})
        if not files:
            return self._legacy(gpu_uuid, context)
        acks: list[Ack] = []
        for found, name, uuid in files:
            try:
                data, info = found.read(name, ACK_MAX_BYTES)
                acks.append(parsed(info, data, ack_from_json, uuid))
            except FileNotFoundError:
                continue  # its filler stopped while we read
            except HoldError:
                unreadable += 1
        return Word(tuple(acks), unreadable, context, self.complete)

    def _context(self, uuids: set[str]) -> bool:
        """Whether a context lock of these GPUs is held in a filler's directory (whatever its acknowledgements say:
        a supervisor that could not write its own, or has stopped)."""
        return any(found.locked(context_file(uuid)) for found in self.dirs for uuid in sorted(uuids)
                   if context_file(uuid) in found.entries)

    def _legacy(self, gpu_uuid: str, context: bool) -> Word:
        """Format 1's acknowledgements and context locks of the GPU and its MIG devices: no filler of this release
        acknowledges it (a filler of an earlier release, or none)."""
        acks: list[Ack] = []
        for uuid, name in self.listing.legacy_acks.items():
            if uuid != gpu_uuid and not uuid.upper().startswith("MIG-"):
                continue
            try:
                data, info = read_regular(os.path.join(self.hold_dir, name), LEGACY_ACK_MAX_BYTES)
                ack = parsed(info, data, ack_from_json, uuid, FORMAT)
            except (FileNotFoundError, HoldError):
                continue
            if uuid == gpu_uuid or ack.of_gpu == gpu_uuid:
                acks.append(ack)
        uuids = [gpu_uuid, *(a.gpu_uuid for a in acks if a.gpu_uuid != gpu_uuid)]
        context = context or self._context(set(uuids)) or any(
            lock_taken(os.path.join(self.hold_dir, legacy_context_lock_name(u))) for u in uuids)
        return Word(tuple(sorted(acks, key=lambda a: a.gpu_uuid)), 0, context, self.complete, legacy=True)


def lock_taken(path: str) -> bool | None:
    """Whether a process holds an exclusive flock on the regular file at `path` now (format 1's context lock), asked
    without blocking by a shared lock let go at once; None when that cannot be told."""
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


# --- one GPU at a time (the tests', and a caller's with one question) --------------------------------------

def read_ack(hold_dir: str, gpu_uuid: str) -> Ack | None:
    """The acknowledgement of one GPU's own filler (not its MIG devices'); None when there is none."""
    uuid = canonical_gpu_uuid(gpu_uuid)
    with FillersLook(hold_dir) as look:
        return next((a for a in look.word(uuid).acks if a.gpu_uuid == uuid), None)


def mig_acks(hold_dir: str, gpu_uuid: str) -> list[Ack]:
    """The acknowledgements of the MIG devices of one GPU (those whose `of_gpu` names it), by UUID."""
    uuid = canonical_gpu_uuid(gpu_uuid)
    with FillersLook(hold_dir) as look:
        return sorted((a for a in look.word(uuid).acks if a.of_gpu == uuid), key=lambda a: a.gpu_uuid)


def context_held(hold_dir: str, gpu_uuid: str) -> bool:
    """Whether a live process of ours holds (or is about to create) a CUDA context on this GPU or a MIG device of
    it in exclusive mode: its child's context lock is held (service/exclusive_child.py)."""
    with FillersLook(hold_dir) as look:
        return look.word(gpu_uuid).context


# --- judging -----------------------------------------------------------------------------------------------

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
    ACK_STALE_S: fail open), or its filler honours `holder` (or every holder, fail safe), has drained, and said so
    after the hold was placed. Age and order are judged on the boot clock where the filler stamped it and the caller
    gives `placed_boot` and `now_boot`: a step of either side's wall clock then changes nothing."""
    if placed_boot is None or now_boot is None:
        placed_boot = now_boot = None  # one clock for all three times
    if ack is None or not ack_live(ack, now_unix_s, now_boot):
        return True
    times = _ack_times(ack, now_unix_s, now_boot)
    assert times is not None
    placed_s = placed_boot.boot_s if ack.written_boot is not None and placed_boot is not None else placed_unix_s
    return (holder in ack.held_by or ack.fail_safe) and ack.drained and times[1] >= placed_s
