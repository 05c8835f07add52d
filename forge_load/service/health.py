"""Liveness from outside the process: the run loop touches a heartbeat file, and check() judges it for the health
command (`forge-load health`, `python -m forge_load.health`: forge_load/commands/health.py), which exits 0 while it
is fresh (with the metrics server on: while the filler's own /health says so), 1 otherwise.

The heartbeat is written without trusting what is at its path: opened without following a symbolic link,
without blocking on a FIFO, and written only when what was opened is a regular file of our own with no other
name (a hard link could point at someone else's file). Anything else is refused: the filler warns once on
stderr and the health check reports unhealthy, saying why. The default path is in a directory of our own,
$TMPDIR/forge_load-<uid>/ (/tmp without TMPDIR; mode 0700, created at need), which is refused too when it is a
link, someone else's, or open to others: on a shared host no other user can make the filler write anywhere else, or
look healthy. In a systemd unit it is the unit's runtime directory ($RUNTIME_DIRECTORY, outside the unit's private
/tmp), where an operator's `forge-load health` with the filler's settings finds it (check_unit).

One heartbeat, one filler: the default file is named after the GPUs the settings select (heartbeat-gpu0,
heartbeat-gpus-0,1, heartbeat-sim-gpu0, heartbeat-sim-seed7-gpu0, ...), so the health check given a filler's
settings judges that filler and no other of the same user. A filler holds its heartbeat (an flock on
`<heartbeat>.lock`, released when the process ends); a second filler that finds it held refuses to start (exit 2):
with the default file it would fill the same GPUs, where the two would only yield to each other. A simulated one,
which shares no GPU, warns and runs without.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

from forge_load.config.settings import Config
from forge_load.log import escape_controls

DEFAULT_BASE = Path("/tmp")
UNIT_RUNTIME_DIR = Path("/run/forge-load")  # deploy/systemd/forge-load.service's RuntimeDirectory=forge-load
FILE_NAME = "heartbeat"


def heartbeat_name(config: Config) -> str:
    """heartbeat-<the GPUs the settings select>: one per filler of a user on a host, found again from the same
    settings by the health check (a filler's GPUs are what tell it from the user's others: one per GPU)."""
    if config.gpus is None:
        key = f"gpu{config.gpu}"
    elif config.gpus == "all":
        key = "gpus-all"
    else:
        key = "gpus-" + ",".join(sorted(config.gpus))
    if config.simulate:  # the seed is part of the simulated GPUs' UUIDs: other seeds, other GPUs
        key = f"sim-{key}" if config.sim.seed == 0 else f"sim-seed{config.sim.seed}-{key}"
    key = re.sub(r"[^A-Za-z0-9,._-]", "_", key)
    if len(key) > 80:  # many UUIDs: short enough for a file name, still one per selection
        key = f"{key[:40]}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    return f"{FILE_NAME}-{key}"


def temp_base() -> Path:
    """$TMPDIR where it is an absolute path (as mktemp reads it), else /tmp."""
    tmpdir = os.environ.get("TMPDIR", "")
    return Path(tmpdir) if tmpdir.startswith("/") else DEFAULT_BASE


def runtime_directory() -> Path | None:
    """The service's own directory that systemd made and named in $RUNTIME_DIRECTORY (RuntimeDirectory=: the
    first, where it names several); None outside such a unit."""
    first = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    return Path(first) if first.startswith("/") else None


def state_dir(base: Path | None = None, uid: int | None = None) -> Path:
    """Where the heartbeat and the GPU locks are by default: a systemd unit's runtime directory
    ($RUNTIME_DIRECTORY, outside its private /tmp, so the operator's `forge-load health` finds it), else
    $TMPDIR/forge_load-<uid> (/tmp without TMPDIR), a directory of this user's own."""
    if base is None and uid is None and (runtime := runtime_directory()) is not None:
        return runtime
    return (base or temp_base()) / f"forge_load-{os.geteuid() if uid is None else uid}"


def default_heartbeat_path(base: Path | None = None, uid: int | None = None, config: Config | None = None) -> Path:
    """<state_dir>/heartbeat-<GPUs>: per user and per filler, so that a filler and the health check given its
    settings (same user) agree, and no other filler of the user answers for it."""
    return state_dir(base, uid) / heartbeat_name(config or Config())


def heartbeat_location(config: Config) -> tuple[Path, bool]:
    """Where the heartbeat is, and whether its directory must be a private one of our own (the default's)."""
    if config.heartbeat_file:
        return Path(config.heartbeat_file), False
    return default_heartbeat_path(config=config), True


def _shown(path: Path) -> str:
    return escape_controls(str(path))


def _private_dir_problem(path: Path, create: bool) -> str | None:
    """None when `path` is a directory only we can write (made, mode 0700, when missing and `create`)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not create:
            return f"{_shown(path)} does not exist"
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass  # made at the same moment by another process: judged below like any other
        except OSError as error:
            return f"cannot create {_shown(path)}: {error.strerror}"
        return _private_dir_problem(path, create=False)
    except OSError as error:
        return f"cannot look at {_shown(path)}: {error.strerror}"
    if problem := _kind_problem(st, path, directory=True):
        return problem
    if st.st_mode & 0o022:
        return f"{_shown(path)} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _file_problem(st: os.stat_result, path: Path) -> str | None:
    """None when `st` is a heartbeat file we may write and trust: a regular file of ours, with one name."""
    if problem := _kind_problem(st, path, directory=False):
        return problem
    if st.st_nlink != 1:
        return f"{_shown(path)} has {st.st_nlink} names (hard links)"
    return None


def _kind_problem(st: os.stat_result, path: Path, directory: bool) -> str | None:
    """None when `st` is a directory (or a regular file) of this user's, not reached through a link."""
    if stat.S_ISLNK(st.st_mode):
        return f"{_shown(path)} is a symbolic link"
    if directory != stat.S_ISDIR(st.st_mode):
        return f"{_shown(path)} is {'not a directory' if directory else 'a directory'}"
    if not directory and not stat.S_ISREG(st.st_mode):
        return f"{_shown(path)} is not a regular file"
    if st.st_uid != os.geteuid():
        return f"{_shown(path)} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    return None


class Heartbeat:
    """Touches the file at most once per `every_s` of wall time, however often (and from however many GPU
    threads) it is called. A path it must not write is left alone; `on_refused` hears why, once per reason."""

    def __init__(self, path: Path, every_s: float = 1.0, private_dir: bool = False,
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.path = path
        self.every_s = every_s
        self.private_dir = private_dir
        self.on_refused = on_refused
        self._last_s = float("-inf")
        self._lock = threading.Lock()
        self._refused: set[str] = set()
        self._written = False
        self._claim_fd: int | None = None
        self.writes = True  # False: another filler holds this heartbeat (claim()); this one leaves it alone

    def __call__(self) -> None:
        if not self.writes:
            return
        with self._lock:
            now_s = time.monotonic()
            if now_s - self._last_s < self.every_s:
                return
            self._last_s = now_s
            problem = self._write()
            if problem is not None and problem not in self._refused:
                self._refused.add(problem)
                if self.on_refused is not None:
                    self.on_refused(problem)

    def _write(self) -> str | None:
        if self.private_dir and (problem := _private_dir_problem(self.path.parent, create=True)):
            return problem
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as error:
            if error.errno == errno.ELOOP:
                return f"{_shown(self.path)} is a symbolic link"
            if error.errno == errno.EISDIR:
                return f"{_shown(self.path)} is a directory"
            if error.errno == errno.ENXIO:  # a FIFO nobody reads
                return f"{_shown(self.path)} is not a regular file"
            return f"cannot write {_shown(self.path)}: {error.strerror}"
        try:
            if problem := _file_problem(os.fstat(fd), self.path):
                return problem
            os.ftruncate(fd, 0)
            os.write(fd, f"{time.time():.3f}\n".encode())
            self._written = True
            return None
        except OSError as error:
            return f"cannot write {_shown(self.path)}: {error.strerror}"
        finally:
            os.close(fd)

    def claim(self) -> str | None:
        """Hold this heartbeat for this process: None when held now (or when it cannot be held: a path refused,
        whose writes will say why), else the other holder's PID, as it wrote it ("?" when unreadable)."""
        if self.private_dir and _private_dir_problem(self.path.parent, create=True):
            return None
        self._claim_fd, holder = claim_lock(self.path.with_name(self.path.name + ".lock"))
        return holder

    def clear(self) -> None:
        """Remove the file at exit, if it is still the one we wrote."""
        with self._lock:
            try:
                if self._written and _file_problem(os.lstat(self.path), self.path) is None:
                    os.unlink(self.path)
            except OSError:
                pass
            if self._claim_fd is not None:
                release_lock(self._claim_fd, self.path.with_name(self.path.name + ".lock"))
                self._claim_fd = None


def claim_lock(lock: Path, mode: int = 0o600) -> tuple[int | None, str | None]:
    """An exclusive hold on `lock` (flock, released when the process ends or the descriptor is closed), made with
    `mode` where missing.

    (fd, None): held by this process now; (None, pid): held by another process, by the PID it wrote ("?" when
    unreadable); (None, None): it cannot be held here (not a regular file of ours, or not writable): nothing is
    claimed, and nothing refused for it. Its holder removes the file when it lets go (release_lock): a lock taken
    on a file that was removed meanwhile is no lock, so it is taken again on the file now at the path."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    for _ in range(100):  # each retry means another filler let go just now: a few at most
        try:
            fd = os.open(lock, flags, mode)
        except OSError:
            return None, None
        try:
            if _file_problem(os.fstat(fd), lock):
                os.close(fd)
                return None, None
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            except OSError:
                holder = ""
            os.close(fd)
            return None, holder if holder.isdigit() else "?"
        except OSError:
            os.close(fd)
            return None, None
        try:
            if os.stat(lock, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                break
        except OSError:
            pass
        os.close(fd)  # removed (or replaced) by its last holder between our open and our flock: again
    else:
        return None, None
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd, None


def release_lock(fd: int, lock: Path) -> None:
    """Let go of a lock claim_lock gave: the file is removed first, while still held (so that no lock file is left
    behind: `gpu-<UUID>.lock` piled up by the dozen), then the descriptor closed. A claim that opened the file just
    before its removal sees that it locked a removed file, and claims again."""
    with contextlib.suppress(OSError):
        if os.stat(lock, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
            os.unlink(lock)
    os.close(fd)


def gpu_lock_path(uuid: str, base: Path | None = None) -> Path:
    return state_dir(base) / f"gpu-{re.sub(r'[^A-Za-z0-9._-]', '_', uuid)}.lock"


def claim_gpu(uuid: str, base: Path | None = None) -> tuple[int | None, str | None]:
    """Hold a GPU for this filler among the user's fillers on this host (claim_lock on gpu-<UUID>.lock in the
    user's private directory), whatever names it in the settings: an index, a UUID, FORGE_GPUS."""
    lock = gpu_lock_path(uuid, base)
    if _private_dir_problem(lock.parent, create=True):
        return None, None  # a planted directory: the heartbeat warns about it
    return claim_lock(lock)


def check(path: Path, max_age_s: float, private_dir: bool = False) -> tuple[bool, str]:
    if private_dir and (problem := _private_dir_problem(path.parent, create=False)):
        return False, f"no heartbeat: {problem}"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False, f"no heartbeat at {_shown(path)}"
    except OSError as error:
        return False, f"cannot read the heartbeat at {_shown(path)}: {error.strerror}"
    if problem := _file_problem(st, path):
        return False, f"no heartbeat: {problem}"
    age_s = time.time() - st.st_mtime
    if age_s > max_age_s:
        return False, f"heartbeat {_shown(path)} {age_s:.0f} s old (limit {max_age_s:g} s)"
    return True, f"heartbeat {_shown(path)} {age_s:.1f} s old"


def unit_heartbeat(path: Path, unit_dir: Path) -> Path | None:
    """The deploy unit's heartbeat of the same name (deploy/systemd: RuntimeDirectory=forge-load), where the
    filler runs as that unit and the caller, outside it, finds no heartbeat of its own; None otherwise."""
    if runtime_directory() is not None or os.path.lexists(path):
        return None
    candidate = unit_dir / path.name
    return candidate if os.path.lexists(candidate) else None


def unit_heartbeats(unit_dir: Path) -> list[str]:
    """The heartbeats in the deploy unit's runtime directory (a hint for a caller that named other GPUs)."""
    try:
        names = sorted(name for name in os.listdir(unit_dir)
                       if name.startswith(FILE_NAME + "-") and not name.endswith(".lock"))
    except OSError:
        return []
    return [escape_controls(name) for name in names[:8]]


def check_unit(path: Path, max_age_s: float) -> tuple[bool, str]:
    """check() on a heartbeat that a service's own user wrote in its runtime directory: trusted as that user's when
    the file and the directory are that user's (or ours) and nobody else may write the directory."""
    try:
        dir_st, st = os.lstat(path.parent), os.lstat(path)
    except OSError as error:
        return False, f"cannot read the heartbeat at {_shown(path)}: {error.strerror}"
    if not stat.S_ISDIR(dir_st.st_mode) or dir_st.st_mode & 0o022 or dir_st.st_uid not in (st.st_uid, 0):
        return False, f"no heartbeat: {_shown(path.parent)} is not a directory that only the unit's user may write"
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        return False, f"no heartbeat: {_shown(path)} is not a regular file with one name"
    age_s = time.time() - st.st_mtime
    if age_s > max_age_s:
        return False, f"heartbeat {_shown(path)} {age_s:.0f} s old (limit {max_age_s:g} s)"
    return True, f"heartbeat {_shown(path)} {age_s:.1f} s old (the systemd unit's)"
