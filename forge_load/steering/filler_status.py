"""A filler's status file beside the holds, for `forge-load status` (commands/status.py): what one GPU's filler
is doing, written by it and read by anyone. Pure stdlib; the clocks are read here only through the functions
passed in, or at the reader's call.

On disk (format 1), in the hold directory: `filler.<GPU-UUID>.status.json`, written atomically (holds.py's
write_atomic) at once on every change of state and at least once a second (of real time, also on the simulated
GPU), and removed when the filler stops. It is a file of its own, not the acknowledgement (`filler.<UUID>.json`),
which `hold --wait` judges: the two change for different reasons. `filler.*.json` is never read as a hold.

Whether the filler behind a file still runs is judged three ways. Its lock: the filler holds an flock on
`.filler.<GPU-UUID>.alive` beside it for as long as it runs (a dot file: never a hold), which the kernel lets go the
moment the process dies, however it dies, and which any reader of the directory can test, in any container of the
host (a shared mount is the same file). Its process, where the reader can see it (the same PID namespace: the PID
must name a process started at the tick the file says, so a reused PID is not taken for it). And the file's age (on
CLOCK_BOOTTIME where both sides have it: a wall-clock step moves neither). A killed filler's file stays behind: the
reader shows it as `gone` (lock free or process dead) or `stale` (older than STALE_S).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from forge_load.clock import boot_time_s
from forge_load.steering import holds as disk
from forge_load.steering.holds import HoldError

FORMAT: int = 1
STATUS_SUFFIX: str = ".status.json"
REFRESH_S: float = 1.0  # real seconds between two writes while nothing changes
STALE_S: float = 3.0  # older than this, no live filler is behind the file (as an acknowledgement: holds.ACK_STALE_S)
MAX_BYTES: int = 16384
MAX_FILES: int = 1024  # status files read per call: a host has at most a few dozen GPUs


def status_name(gpu_uuid: str) -> str:
    return f"{disk.ACK_PREFIX}{gpu_uuid}{STATUS_SUFFIX}"


def alive_name(gpu_uuid: str) -> str:
    return f".{disk.ACK_PREFIX}{gpu_uuid}.alive"


def parse_status_name(name: str) -> str | None:
    """The GPU UUID of a status file's name; None for any other name."""
    if not (name.startswith(disk.ACK_PREFIX) and name.endswith(STATUS_SUFFIX)):
        return None
    uuid = name[len(disk.ACK_PREFIX):-len(STATUS_SUFFIX)]
    return uuid if disk.valid_gpu_uuid(uuid) else None


def pid_namespace() -> str | None:
    """This process's PID namespace ("pid:[4026531836]"); None where /proc does not say."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def process_start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot, /proc/<pid>/stat field 22); None when there is no such
    process visible here."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            data = file.read(4096)
    except OSError:
        return None
    try:  # the name (field 2) may hold spaces and parentheses: count from the last ")"
        return int(data.rsplit(b")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True)
class FillerStatus:
    """One GPU's filler as its status file says. Ratios 0 to 1; None where unknown."""

    gpu_uuid: str
    gpu_index: int
    pid: int
    state: str  # filling, yielding, boosted, paused, held (the exclusive mode's supervisor: also stopped)
    target_ratio: float | None = None
    util_ratio: float | None = None
    own_ratio: float | None = None
    power_w: float | None = None
    reason: str | None = None  # why it is not filling (the last change's reason)
    held_by: tuple[str, ...] = ()
    simulated: bool = False
    pid_namespace: str | None = None
    pid_start_ticks: int | None = None
    written_unix_s: float = 0.0
    written_boot_s: float | None = None
    locked: bool = False  # the writer held its alive lock: a free lock means it has ended
    # The held metric (FORGE_METRIC) over its latest 2 s, and our own share of it; None from an older filler
    metric: str | None = None
    metric_ratio: float | None = None
    metric_own_ratio: float | None = None


def to_json(status: FillerStatus) -> bytes:
    fields = asdict(status)
    fields["held_by"] = list(status.held_by)
    return json.dumps({"format": FORMAT, **fields}).encode("utf-8")


def _ratio(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _metric(value: object) -> str | None:
    """A metric's name as a filler writes it (utilization, sm_activity...); None for anything else."""
    return value if isinstance(value, str) and re.fullmatch(r"[a-z][a-z0-9_]{0,31}", value) else None


def from_json(data: bytes, gpu_uuid: str) -> FillerStatus:
    """The status a file named for `gpu_uuid` holds; HoldError for anything but a format-1 status of that GPU."""
    try:
        loaded = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise HoldError("is not JSON") from None
    if not isinstance(loaded, dict) or loaded.get("format") != FORMAT or isinstance(loaded.get("format"), bool):
        raise HoldError(f"is not a format-{FORMAT} filler status")
    index, pid, state = loaded.get("gpu_index"), loaded.get("pid"), loaded.get("state")
    held_by = loaded.get("held_by")
    written = _ratio(loaded.get("written_unix_s"))
    ints_ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (index, pid))
    if (loaded.get("gpu_uuid") != gpu_uuid or not ints_ok or not isinstance(state, str) or written is None
            or not isinstance(held_by, list) or not all(isinstance(h, str) for h in held_by)):
        raise HoldError("is not a filler status of this GPU")
    assert isinstance(index, int) and isinstance(pid, int)
    reason, ns, ticks = loaded.get("reason"), loaded.get("pid_namespace"), loaded.get("pid_start_ticks")
    return FillerStatus(
        gpu_uuid, index, pid, state, _ratio(loaded.get("target_ratio")), _ratio(loaded.get("util_ratio")),
        _ratio(loaded.get("own_ratio")), _ratio(loaded.get("power_w")), reason if isinstance(reason, str) else None,
        tuple(held_by), loaded.get("simulated") is True, ns if isinstance(ns, str) else None,
        ticks if isinstance(ticks, int) and not isinstance(ticks, bool) else None, written,
        _ratio(loaded.get("written_boot_s")), loaded.get("locked") is True, _metric(loaded.get("metric")),
        _ratio(loaded.get("metric_ratio")), _ratio(loaded.get("metric_own_ratio")))


# --- the filler's side -----------------------------------------------------------------------------------

class StatusWriter:
    """One GPU's status file, kept by its filler: `due` is cheap (asked at every step of the loop), `write` makes
    the record and writes it. Only where the directory exists (the filler never creates it); a write that fails is
    given up quietly until the next refresh: the acknowledgement's warning already names the directory."""

    def __init__(self, hold_dir: str, gpu_uuid: str, gpu_index: int, pid: int, simulated: bool = False,
                 monotonic: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time) -> None:
        self.hold_dir = hold_dir
        self.gpu_uuid = gpu_uuid
        self.gpu_index = gpu_index
        self.pid = pid
        self.simulated = simulated
        self.monotonic = monotonic  # real time, also on the simulated GPU: the reader judges age on it
        self.wall_clock = wall_clock
        self.path = os.path.join(hold_dir, status_name(gpu_uuid))
        self._said: tuple[str, tuple[str, ...]] | None = None
        self._written_s = -math.inf
        self._wrote = False
        self._ns = pid_namespace()
        self._ticks = process_start_ticks(pid)
        self._alive_fd: int | None = None

    def due(self, state: str, held_by: tuple[str, ...]) -> bool:
        return (state, held_by) != self._said or self.monotonic() - self._written_s >= REFRESH_S

    def write(self, state: str, held_by: tuple[str, ...], target_ratio: float | None = None,
              util_ratio: float | None = None, own_ratio: float | None = None, power_w: float | None = None,
              reason: str | None = None, metric: str | None = None, metric_ratio: float | None = None,
              metric_own_ratio: float | None = None) -> None:
        self._said, self._written_s = (state, held_by), self.monotonic()
        if self._alive_fd is None:
            self._alive_fd = claim_alive(self.hold_dir, self.gpu_uuid)
        record = FillerStatus(self.gpu_uuid, self.gpu_index, self.pid, state, target_ratio, util_ratio, own_ratio,
                              power_w, reason, held_by, self.simulated, self._ns, self._ticks, self.wall_clock(),
                              boot_time_s(), self._alive_fd is not None, metric, metric_ratio, metric_own_ratio)
        try:
            disk.write_atomic(self.hold_dir, status_name(self.gpu_uuid), to_json(record))
            self._wrote = True
        except OSError:
            pass  # no hold directory (not mounted, not made), or not writable: tried again at the next refresh

    def close(self) -> None:
        """The filler stops: its files go with it (the lock's while still held: a reader never finds it free
        beside a status file of a filler that stopped cleanly, which is gone first)."""
        if self._wrote:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        if self._alive_fd is not None:
            alive = os.path.join(self.hold_dir, alive_name(self.gpu_uuid))
            with contextlib.suppress(OSError):
                if os.stat(alive, follow_symlinks=False).st_ino == os.fstat(self._alive_fd).st_ino:
                    os.unlink(alive)
            os.close(self._alive_fd)
            self._alive_fd = None


def claim_alive(hold_dir: str, gpu_uuid: str) -> int | None:
    """An exclusive flock on the GPU's alive file, held until the process ends; None when it cannot be had now
    (no directory, not writable, a reader's test this very moment, another live filler of the same UUID)."""
    path = os.path.join(hold_dir, alive_name(gpu_uuid))
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, disk.FILE_MODE)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")  # planted: no lock, the reader falls back
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.fchmod(fd, disk.FILE_MODE)  # every reader must be able to open it to test the lock
        if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
            return fd
    except OSError:
        pass
    os.close(fd)  # held by another, or removed under us by a filler that stopped: again at the next write
    return None


def lock_alive(hold_dir: str, gpu_uuid: str) -> bool | None:
    """Whether a process holds the GPU's alive lock now; None when that cannot be told (no such file, unreadable)."""
    return disk.lock_taken(os.path.join(hold_dir, alive_name(gpu_uuid)))


# --- the reader's side ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Seen:
    """A status file as the reader judges it: `state` is the file's, or `gone` (its process is dead) or `stale`
    (older than STALE_S); `alive` is None where neither its lock nor its process can tell."""

    status: FillerStatus
    state: str
    age_s: float
    alive: bool | None


def judge(status: FillerStatus, now_unix_s: float, now_boot_s: float | None, own_ns: str | None,
          locked: bool | None = None) -> Seen:
    """`locked`: whether the GPU's alive lock is held now (lock_alive), trusted where the writer held it."""
    if status.written_boot_s is not None and now_boot_s is not None:
        age_s = now_boot_s - status.written_boot_s
    else:
        age_s = now_unix_s - status.written_unix_s
    alive: bool | None = None
    if own_ns is not None and status.pid_namespace == own_ns:
        ticks = process_start_ticks(status.pid)
        alive = ticks is not None and (status.pid_start_ticks is None or ticks == status.pid_start_ticks)
    if status.locked and locked is False:
        alive = False  # its process ended, whichever namespace it ran in
    elif status.locked and locked and alive is None:
        alive = True  # held by a process we cannot see (another PID namespace): its filler, or one of its GPU
    if alive is False:
        state = "gone"
    elif age_s > STALE_S or age_s < -STALE_S:  # a stamp from the future: another boot's, or a forged one
        state = "stale"
    else:
        state = status.state
    return Seen(status, state, age_s, alive)


def read_all(hold_dir: str) -> tuple[list[Seen], list[str]]:
    """Every filler's status in the directory, judged now, by GPU index then UUID; and the problems (one line each).
    HoldError when the directory cannot be listed (FileNotFoundError, NotADirectoryError: it is not there)."""
    try:
        with os.scandir(hold_dir) as entries:
            names = [entry.name for _, entry in zip(range(disk.MAX_ENTRIES), entries)]
    except (FileNotFoundError, NotADirectoryError):
        raise
    except OSError as error:
        raise HoldError(f"cannot list {hold_dir} ({error.strerror or error})") from None
    now_unix_s, now_boot_s, own_ns = time.time(), boot_time_s(), pid_namespace()
    seen: list[Seen] = []
    problems: list[str] = []
    for name in sorted(names)[:MAX_FILES]:
        uuid = parse_status_name(name)
        if uuid is None:
            continue
        try:
            status = from_json(disk.read_small(os.path.join(hold_dir, name), MAX_BYTES), uuid)
        except FileNotFoundError:
            continue  # its filler stopped while we read
        except HoldError as error:
            problems.append(f"{os.path.join(hold_dir, name)} {error}: skipped")
            continue
        locked = lock_alive(hold_dir, uuid) if status.locked else None
        seen.append(judge(status, now_unix_s, now_boot_s, own_ns, locked))
    seen.sort(key=lambda s: (s.status.gpu_index, s.status.gpu_uuid))
    return seen, problems
