"""The fillers' directories of their own (docs/holds.md: on disk; who can do what): `filler.<uid>/` in the hold
directory (or, for the status of a filler that has none there, in its runtime directory), which only user <uid>
can write, where that user's fillers write what a reader must be able to trust: acknowledgements, status rows,
liveness and exclusive mode's context lock. Pure stdlib, no clock.

The writer's side is OwnDir: its directory made safely (mkdir, then opened without following a link and checked
by owner and mode with fstat; where the name is taken, `filler.<uid>.<tag>/`), written through its descriptor, and
found again when something moved it. The reader's side is open_filler_dirs: a directory counts only where its
name's uid owns it and nobody else can write it, and only its user's (or root's) regular files in it.

Liveness and the context lock are `fcntl` write locks (open file description locks), which only a descriptor open
for writing can take: only the filler's user can open its files for writing, so no reader can take a lock that
says a filler lives (a reader's `flock` or read lock is not a write lock, and is not looked at; design §14).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

from forge_load.steering.hold_files import (
    DIR_MODE,
    FILE_MODE,
    HoldError,
    canonical_gpu_uuid,
    new_tag,
    read_regular,
    valid_gpu_uuid,
    write_atomic,
)

DIR_PREFIX = "filler."
ACK_SUFFIX, STATUS_SUFFIX, ALIVE_SUFFIX, CONTEXT_SUFFIX = ".ack.json", ".status.json", ".alive", ".context"
OF = ".of."  # a MIG device's acknowledgement: <MIG-UUID>.of.<GPU-UUID>.ack.json
MAX_FILLER_DIRS = 64  # fillers' directories read in one look
MAX_DIRS_PER_USER = 4  # of one user: its directory, and where that was taken, its own-named ones
MAX_DIR_ENTRIES = 1024  # names kept from one filler's directory
MAX_SCAN = 65536  # entries listed in one directory in one look
HOST_RUNTIME_DIR = "/run/forge-load"  # root's runtime directory, and the systemd unit's ($RUNTIME_DIRECTORY)
_OWN_DIR_RE = re.compile(r"filler\.([0-9]{1,10})(?:\.([0-9a-f]{16}))?", re.ASCII)


def own_dir_name(uid: int, tag: str = "") -> str:
    return f"{DIR_PREFIX}{uid}" + (f".{tag}" if tag else "")


def parse_own_dir_name(name: str) -> tuple[int, str] | None:
    """(uid, tag) of a filler's directory's name; None for any other name."""
    match = _OWN_DIR_RE.fullmatch(name)
    return (int(match.group(1)), match.group(2) or "") if match else None


def ack_file(gpu_uuid: str, of_gpu: str = "") -> str:
    uuid = canonical_gpu_uuid(gpu_uuid)
    return f"{uuid}{OF}{canonical_gpu_uuid(of_gpu)}{ACK_SUFFIX}" if of_gpu else f"{uuid}{ACK_SUFFIX}"


def parse_ack_file(name: str) -> tuple[str, str] | None:
    """(GPU UUID, and for a MIG device its GPU's UUID or "") of an acknowledgement's name in a filler's directory."""
    if not name.endswith(ACK_SUFFIX):
        return None
    uuid, of, of_gpu = name[:-len(ACK_SUFFIX)].partition(OF)
    if not valid_gpu_uuid(uuid) or (of and not valid_gpu_uuid(of_gpu)):
        return None
    return canonical_gpu_uuid(uuid), canonical_gpu_uuid(of_gpu) if of else ""


def status_file(gpu_uuid: str) -> str:
    return f"{canonical_gpu_uuid(gpu_uuid)}{STATUS_SUFFIX}"


def parse_status_file(name: str) -> str | None:
    uuid = name.removesuffix(STATUS_SUFFIX)
    return canonical_gpu_uuid(uuid) if name.endswith(STATUS_SUFFIX) and valid_gpu_uuid(uuid) else None


def alive_file(gpu_uuid: str) -> str:
    return f"{canonical_gpu_uuid(gpu_uuid)}{ALIVE_SUFFIX}"


def context_file(gpu_uuid: str) -> str:
    return f"{canonical_gpu_uuid(gpu_uuid)}{CONTEXT_SUFFIX}"


def trusted_dir_problem(info: os.stat_result, uid: int) -> str | None:
    """None where `info` is a directory (not a link) of `uid` that nobody else can write."""
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid != uid:
        return f"is uid {info.st_uid}'s, not uid {uid}'s"
    if info.st_mode & 0o022:
        return f"is writable by others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def default_runtime_dir() -> str:
    """Where a filler reports its status when it has no directory in the hold directory: a systemd unit's runtime
    directory ($RUNTIME_DIRECTORY), root's /run/forge-load, a user's $XDG_RUNTIME_DIR/forge-load, else
    $TMPDIR/forge_load-<uid> (/tmp without TMPDIR: the directory of the filler's heartbeat)."""
    first = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if first.startswith("/"):
        return first
    if os.geteuid() == 0:
        return HOST_RUNTIME_DIR
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if xdg.startswith("/"):
        return os.path.join(xdg, "forge-load")
    tmp = os.environ.get("TMPDIR", "")
    return os.path.join(tmp if tmp.startswith("/") else "/tmp", f"forge_load-{os.geteuid()}")


# --- fcntl write locks ---------------------------------------------------------------------------------------

def _flock_struct(kind: int) -> bytes:
    return struct.pack("hhqqi4x", kind, os.SEEK_SET, 0, 0, 0)  # struct flock: the whole file; l_pid 0 (OFD)


def write_lock(dir_fd: int, name: str) -> int:
    """A file made afresh at `name` (mode 0600 until it is locked, so that no reader takes a lock on it first) under
    an open file description write lock, then made readable by all: its descriptor, which holds the lock until it
    closes (at this process's exit at the latest). OSError where it cannot be had; BlockingIOError where another
    process of this user holds the lock now (it is not taken from it)."""
    if write_locked(dir_fd, name, None):
        raise BlockingIOError(errno.EAGAIN, f"{name} is locked by another live process")
    for _ in range(10):  # each retry: another process of this user made it between our unlink and our create
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dir_fd)
        except FileExistsError:
            continue
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock_struct(fcntl.F_WRLCK))
            os.fchmod(fd, FILE_MODE)  # every reader may ask it (F_OFD_GETLK); none can take a write lock
        except OSError:
            os.close(fd)
            raise
        return fd
    raise BlockingIOError(errno.EAGAIN, f"{name} is being made by another process")


def write_locked(dir_fd: int, name: str, owners: Iterable[int] | None) -> bool | None:
    """Whether a process holds a write lock on the regular file at `name` now (owned by one of `owners`, where
    given); None when that cannot be told (no such file, not a regular file, not theirs, unreadable). A reader's
    read lock answers False: a write lock excludes it, so none is held."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or (owners is not None and info.st_uid not in set(owners)):
            return None
        answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock_struct(fcntl.F_WRLCK))
        return bool(struct.unpack("hhqqi4x", answer)[0] == fcntl.F_WRLCK)
    except OSError:
        return None
    finally:
        os.close(fd)


# --- the writer's side ---------------------------------------------------------------------------------------

class OwnDir:
    """This process's user's directory in `base` (the hold directory, or the runtime directory): made where missing,
    trusted only once fstat says it is this user's and nobody else's to write, found again (or made again) when
    something moved it. `fd()` is its descriptor now; HoldError says why there is none (FileNotFoundError: no
    `base`). Several fillers of one user share it; `close` removes it once empty."""

    def __init__(self, base: str, make_base: bool = False) -> None:
        self.base = base
        self.make_base = make_base  # the runtime directory is made where missing; the hold directory never
        self.uid = os.geteuid()
        self.name = ""
        self._base_fd: int | None = None
        self._fd: int | None = None
        self._ids: tuple[int, int, int, int] | None = None  # (base dev, base ino, dir dev, dir ino)

    @property
    def path(self) -> str:
        return os.path.join(self.base, self.name) if self.name else ""

    def fd(self) -> int:
        if self._fd is not None and self._still_there():
            return self._fd
        self._close_fds()
        self._open()
        assert self._fd is not None
        return self._fd

    def base_fd(self) -> int:
        self.fd()
        assert self._base_fd is not None
        return self._base_fd

    def _still_there(self) -> bool:
        assert self._ids is not None
        try:
            base, here = os.stat(self.base), os.stat(self.name, dir_fd=self._base_fd, follow_symlinks=False)
        except OSError:
            return False
        return (base.st_dev, base.st_ino, here.st_dev, here.st_ino) == self._ids

    def _open(self) -> None:
        if self.make_base and not os.path.lexists(self.base):
            with contextlib.suppress(FileExistsError):
                os.makedirs(self.base, mode=DIR_MODE if self.uid == 0 else 0o700)
        try:
            base_fd = os.open(self.base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise
        except OSError as error:
            raise HoldError(f"cannot open {self.base} ({error.strerror or error})") from None
        why = ""
        for name in self._candidates(base_fd):
            fd, why = self._take(base_fd, name)
            if fd is not None:
                base, here = os.fstat(base_fd), os.fstat(fd)
                self._base_fd, self._fd, self.name = base_fd, fd, name
                self._ids = (base.st_dev, base.st_ino, here.st_dev, here.st_ino)
                return
        os.close(base_fd)
        raise HoldError(f"cannot make a directory of its own in {self.base}: {why}")

    def _candidates(self, base_fd: int) -> Iterable[str]:
        yield own_dir_name(self.uid)
        with contextlib.suppress(OSError), os.scandir(base_fd) as entries:  # taken: an own-named one of ours
            for count, entry in enumerate(entries):
                if count >= MAX_SCAN:
                    break
                parsed = parse_own_dir_name(entry.name)
                if parsed is not None and parsed[0] == self.uid and parsed[1]:
                    yield entry.name
        yield own_dir_name(self.uid, new_tag())

    def _take(self, base_fd: int, name: str) -> tuple[int | None, str]:
        try:
            os.mkdir(name, DIR_MODE, dir_fd=base_fd)
        except FileExistsError:
            pass
        except OSError as error:
            return None, f"{name}: {error.strerror or error}"
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=base_fd)
        except OSError as error:
            why = "a symbolic link" if error.errno == errno.ELOOP else error.strerror or str(error)
            return None, f"{name} is taken ({why})"
        info = os.fstat(fd)
        if info.st_uid == self.uid and stat.S_ISDIR(info.st_mode) and info.st_mode & 0o022:
            with contextlib.suppress(OSError):
                os.fchmod(fd, DIR_MODE)  # ours, made under a loose umask: nobody else writes it
            info = os.fstat(fd)
        problem = trusted_dir_problem(info, self.uid)
        if problem is not None:
            os.close(fd)
            return None, f"{name} is taken ({problem})"
        return fd, ""

    def write(self, name: str, data: bytes) -> None:
        """`name` in it holds `data` (atomically); OSError or HoldError where it cannot be written."""
        write_atomic(self.path, name, data, dir_fd=self.fd())

    def locked(self, name: str) -> bool:
        """Whether a process holds a write lock on `name` in it now."""
        return self._fd is not None and write_locked(self._fd, name, None) is True

    def remove(self, name: str) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=self._fd)

    def close(self) -> None:
        """Let go of it: removed where nothing is left in it (another filler of this user may still use it)."""
        if self._fd is not None and self._base_fd is not None and self._still_there():
            with contextlib.suppress(OSError):
                os.rmdir(self.name, dir_fd=self._base_fd)
        self._close_fds()

    def forget(self) -> None:
        """Let go of its descriptors, leaving the directory as it is."""
        self._close_fds()

    def _close_fds(self) -> None:
        for fd in (self._fd, self._base_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._base_fd = None
        self._ids = None


# --- the reader's side ---------------------------------------------------------------------------------------

@dataclass
class FillerDir:
    """One user's filler directory, opened and checked: its entries (at most MAX_DIR_ENTRIES) by name."""

    name: str
    uid: int
    fd: int
    path: str
    entries: list[str] = field(default_factory=list)
    truncated: bool = False

    @property
    def owners(self) -> tuple[int, ...]:
        return (self.uid, 0)

    def read(self, name: str, max_bytes: int) -> tuple[bytes, os.stat_result]:
        return read_regular(name, max_bytes, dir_fd=self.fd, owners=self.owners)

    def locked(self, name: str) -> bool | None:
        return write_locked(self.fd, name, self.owners)


def open_filler_dirs(base: str, names: Iterable[str]) -> tuple[list[FillerDir], list[str], bool]:
    """The fillers' directories among `names` (from one listing of `base`) that are trusted, opened and listed:
    at most MAX_DIRS_PER_USER of one user (its own name first) and MAX_FILLER_DIRS in all; what was left out, in one
    line each; and whether every trusted one was read whole. Close them with close_all."""
    by_uid: dict[int, list[tuple[str, str]]] = {}
    for name in names:
        parsed = parse_own_dir_name(name)
        if parsed is not None:
            by_uid.setdefault(parsed[0], []).append((parsed[1], name))
    problems: list[str] = []
    try:
        base_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return [], problems, True
    found: list[FillerDir] = []
    untrusted: list[str] = []
    skipped = 0
    try:
        for uid in sorted(by_uid):
            kept = 0
            for _tag, name in sorted(by_uid[uid]):
                if kept >= MAX_DIRS_PER_USER or len(found) >= MAX_FILLER_DIRS:
                    skipped += 1
                    continue
                opened = _open_trusted(base_fd, base, name, uid, untrusted)
                if opened is not None:
                    found.append(opened)
                    kept += 1
    finally:
        os.close(base_fd)
    if untrusted:
        shown = "; ".join(untrusted[:3]) + (f"; and {len(untrusted) - 3} more" if len(untrusted) > 3 else "")
        problems.append(f"{len(untrusted)} fillers' directories in {base} are not their user's alone: ignored "
                        f"({shown})")
    if skipped:
        problems.append(f"{skipped} fillers' directories in {base} beyond the {MAX_DIRS_PER_USER} read of one user "
                        f"or the {MAX_FILLER_DIRS} in all: not read")
    truncated = [d.name for d in found if d.truncated]
    if truncated:
        problems.append(f"fillers' directories {', '.join(truncated[:3])} in {base} have more than "
                        f"{MAX_DIR_ENTRIES} entries: only the first were read")
    return found, problems, not skipped and not truncated


def _open_trusted(base_fd: int, base: str, name: str, uid: int, untrusted: list[str]) -> FillerDir | None:
    try:  # first what lstat says (one call for a name that is not one): then, opened, what fstat says
        problem = trusted_dir_problem(os.stat(name, dir_fd=base_fd, follow_symlinks=False), uid)
    except OSError:
        return None  # gone since the listing
    if problem is not None:
        untrusted.append(f"{name} {problem}" if "directory" not in problem else f"{name}: not a directory")
        return None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=base_fd)
    except OSError as error:
        untrusted.append(f"{name}: {'a symbolic link' if error.errno == errno.ELOOP else 'not a directory'}")
        return None
    problem = trusted_dir_problem(os.fstat(fd), uid)
    if problem is not None:
        os.close(fd)
        untrusted.append(f"{name} {problem}")
        return None
    entries: list[str] = []
    truncated = False
    try:
        with os.scandir(fd) as listing:
            for count, entry in enumerate(listing):
                if count >= MAX_SCAN or len(entries) >= MAX_DIR_ENTRIES:
                    truncated = True
                    break
                if not entry.name.startswith("."):  # the writes' temporary files
                    entries.append(entry.name)
    except OSError:
        pass
    return FillerDir(name, uid, fd, os.path.join(base, name), entries, truncated)


def close_all(dirs: Iterable[FillerDir]) -> None:
    for found in dirs:
        with contextlib.suppress(OSError):
            os.close(found.fd)
