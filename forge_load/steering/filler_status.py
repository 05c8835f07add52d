"""A filler's status file, for `forge-load status` (commands/status.py): what one GPU's filler is doing, written by
it and read by anyone. Pure stdlib; the clocks are read here only through the functions passed in, or at the
reader's call.

On disk (format 2): `<GPU-UUID>.status.json` in the filler's own directory (filler_dirs.py: `filler.<uid>/`, which
only its user can write) in the hold directory, or, where it has none there (no hold directory, or one it may not
write), in its runtime directory (FORGE_RUNTIME_DIR; filler_dirs.default_runtime_dir). Written atomically at once
on every change of state and at least once a second (of real time, also on the simulated GPU), and removed when the
filler stops. It is a file of its own, not the acknowledgement (`<GPU-UUID>.ack.json`), which `hold --wait` judges:
the two change for different reasons.

Whether the filler behind a file still runs is judged three ways. Its lock: the filler holds an `fcntl` write lock on
`<GPU-UUID>.alive` beside it for as long as it runs, which the kernel lets go the moment the process dies, however it
dies, which any reader can ask about in any container of the host, and which no reader can take (a write lock needs
a descriptor open for writing: filler_dirs.write_lock). Its process, where the reader can see it (the same PID
namespace: the PID must name a process started at the tick the file says, so a reused PID is not taken for it). And
the file's age (on CLOCK_BOOTTIME where both sides have it: a wall-clock step moves neither). A killed filler's file
stays behind: the reader shows it as `gone` (lock free or process dead) or `stale` (older than STALE_S).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from forge_load.clock import boot_time_s
from forge_load.steering import filler_dirs
from forge_load.steering.filler_dirs import FillerDir, OwnDir, alive_file, status_file
from forge_load.steering.hold_files import HoldError, canonical_gpu_uuid, parsed
from forge_load.steering.holds import list_dir

FORMAT: int = 2
REFRESH_S: float = 1.0  # real seconds between two writes while nothing changes
STALE_S: float = 3.0  # older than this, no live filler is behind the file (as an acknowledgement: ACK_STALE_S)
MAX_BYTES: int = 16384
MAX_INDEX: int = 65535  # a GPU's index: NVML's, of a host's few dozen GPUs
MAX_PID: int = 1 << 22  # Linux's pid_max at most
status_name = status_file  # in the filler's directory
alive_name = alive_file


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
    uuid = loaded.get("gpu_uuid")
    if (not isinstance(uuid, str) or canonical_gpu_uuid(uuid) != canonical_gpu_uuid(gpu_uuid) or not ints_ok
            or not isinstance(state, str) or written is None
            or not isinstance(held_by, list) or not all(isinstance(h, str) for h in held_by)):
        raise HoldError("is not a filler status of this GPU")
    assert isinstance(index, int) and isinstance(pid, int)
    if not 0 <= index <= MAX_INDEX or not 0 < pid <= MAX_PID:  # a row must not widen every row of the table
        raise HoldError(f"is not a filler status (a GPU index of 0 to {MAX_INDEX} and a PID of 1 to {MAX_PID})")
    reason, ns, ticks = loaded.get("reason"), loaded.get("pid_namespace"), loaded.get("pid_start_ticks")
    return FillerStatus(
        canonical_gpu_uuid(gpu_uuid), index, pid, state, _ratio(loaded.get("target_ratio")),
        _ratio(loaded.get("util_ratio")),
        _ratio(loaded.get("own_ratio")), _ratio(loaded.get("power_w")), reason if isinstance(reason, str) else None,
        tuple(held_by), loaded.get("simulated") is True, ns if isinstance(ns, str) else None,
        ticks if isinstance(ticks, int) and not isinstance(ticks, bool) else None, written,
        _ratio(loaded.get("written_boot_s")), loaded.get("locked") is True, _metric(loaded.get("metric")),
        _ratio(loaded.get("metric_ratio")), _ratio(loaded.get("metric_own_ratio")))


# --- the filler's side -----------------------------------------------------------------------------------

class StatusWriter:
    """One GPU's status file, kept by its filler: `due` is cheap (asked at every step of the loop), `write` makes
    the record and writes it, in the filler's own directory in the hold directory where it exists and the filler
    may write there, else in the runtime directory (`runtime_dir`, default filler_dirs.default_runtime_dir(); made
    where missing). A write that fails is given up quietly until the next refresh: the acknowledgement's warning
    already names the hold directory."""

    def __init__(self, hold_dir: str, gpu_uuid: str, gpu_index: int, pid: int, simulated: bool = False,
                 monotonic: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 runtime_dir: str | None = None) -> None:
        self.hold_dir = hold_dir
        self.gpu_uuid = gpu_uuid
        self.gpu_index = gpu_index
        self.pid = pid
        self.simulated = simulated
        self.monotonic = monotonic  # real time, also on the simulated GPU: the reader judges age on it
        self.wall_clock = wall_clock
        self.runtime_dir = runtime_dir or filler_dirs.default_runtime_dir()
        self._dirs = [OwnDir(d, make_base=d == self.runtime_dir) for d in dict.fromkeys(
            [hold_dir, self.runtime_dir] if hold_dir else [self.runtime_dir])]
        self._at: OwnDir | None = None  # where its files are now
        self._said: tuple[str, tuple[str, ...]] | None = None
        self._written_s = -math.inf
        self._ns = pid_namespace()
        self._ticks = process_start_ticks(pid)
        self._alive_fd: int | None = None  # its lock in self._at

    @property
    def path(self) -> str:
        """Its status file's path now ("" before it has written one)."""
        return os.path.join(self._at.path, status_name(self.gpu_uuid)) if self._at is not None else ""

    def due(self, state: str, held_by: tuple[str, ...]) -> bool:
        return (state, held_by) != self._said or self.monotonic() - self._written_s >= REFRESH_S

    def write(self, state: str, held_by: tuple[str, ...], target_ratio: float | None = None,
              util_ratio: float | None = None, own_ratio: float | None = None, power_w: float | None = None,
              reason: str | None = None, metric: str | None = None, metric_ratio: float | None = None,
              metric_own_ratio: float | None = None) -> None:
        self._said, self._written_s = (state, held_by), self.monotonic()
        for own in self._dirs:
            try:
                if own.base != self.runtime_dir and not os.path.isdir(own.base):
                    continue  # the filler never makes the hold directory
                fd = own.fd()
            except (OSError, HoldError):
                continue  # not there, or not writable: the runtime directory, or again at the next refresh
            if self._at is not own:
                if self._at is not None:
                    self._let_go(self._at)  # moved (the hold directory appeared, or went): no row left behind
                self._at = own
            if self._alive_fd is None:
                self._alive_fd = claim_alive(fd, self.gpu_uuid)
            record = FillerStatus(self.gpu_uuid, self.gpu_index, self.pid, state, target_ratio, util_ratio,
                                  own_ratio, power_w, reason, held_by, self.simulated, self._ns, self._ticks,
                                  self.wall_clock(), boot_time_s(), self._alive_fd is not None, metric,
                                  metric_ratio, metric_own_ratio)
            with contextlib.suppress(OSError, HoldError):
                own.write(status_name(self.gpu_uuid), to_json(record))
            return

    def _let_go(self, own: OwnDir) -> None:
        """Its files in `own` go (the lock's while still held: a reader never finds it free beside the status file
        of a filler that stopped cleanly, which is gone first)."""
        own.remove(status_name(self.gpu_uuid))
        if self._alive_fd is not None:
            own.remove(alive_name(self.gpu_uuid))
            with contextlib.suppress(OSError):
                os.close(self._alive_fd)
            self._alive_fd = None
        own.close()

    def close(self) -> None:
        """The filler stops: its files go with it."""
        if self._at is not None:
            self._let_go(self._at)
            self._at = None
        for own in self._dirs:
            own.close()


def claim_alive(dir_fd: int, gpu_uuid: str) -> int | None:
    """A write lock on the GPU's alive file in the filler's directory, held until the process ends; None when it
    cannot be had now (not writable, another live filler of this user and GPU)."""
    try:
        return filler_dirs.write_lock(dir_fd, alive_name(gpu_uuid))
    except OSError:
        return None


# --- the reader's side ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Seen:
    """A status file as the reader judges it: `state` is the file's, or `gone` (its process is dead) or `stale`
    (older than STALE_S); `alive` is None where neither its lock nor its process can tell; `uid`, the user whose
    directory it is in (its writer, as the kernel says: no file says it of itself)."""

    status: FillerStatus
    state: str
    age_s: float
    alive: bool | None
    uid: int = -1


def judge(status: FillerStatus, now_unix_s: float, now_boot_s: float | None, own_ns: str | None,
          locked: bool | None = None, uid: int = -1) -> Seen:
    """`locked`: whether the GPU's alive lock is held now (FillerDir.locked), trusted where the writer held it."""
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
    return Seen(status, state, age_s, alive, uid)


def read_all(bases: Sequence[str]) -> tuple[list[Seen], list[str]]:
    """Every filler's status in the fillers' directories of `bases` (the hold directory, runtime directories: one
    look at each; a base that does not exist has none), judged now, by GPU index then UUID, one row per user and GPU
    (the newest, where a filler moved between bases); and the problems (one line each)."""
    now_unix_s, now_boot_s, own_ns = time.time(), boot_time_s(), pid_namespace()
    rows: dict[tuple[int, str], Seen] = {}
    problems: list[str] = []
    for base in dict.fromkeys(bases):
        try:
            listing = list_dir(base)
        except HoldError as error:
            problems.append(str(error))
            continue
        if listing.truncated is not None:
            problems.append(f"{listing.truncated}: only the first were read")
        dirs, dir_problems, _ = filler_dirs.open_filler_dirs(base, listing.filler_dirs)
        problems += dir_problems
        try:
            for found in dirs:
                for seen in _rows(found, now_unix_s, now_boot_s, own_ns, problems):
                    key = (seen.uid, seen.status.gpu_uuid)
                    if key not in rows or _newer(seen, rows[key]):
                        rows[key] = seen
        finally:
            filler_dirs.close_all(dirs)
    seen_all = sorted(rows.values(), key=lambda s: (s.status.gpu_index, s.status.gpu_uuid, s.uid))
    return seen_all, problems


def _newer(one: Seen, other: Seen) -> bool:
    return (one.alive is not False, -one.age_s) > (other.alive is not False, -other.age_s)


def _rows(found: FillerDir, now_unix_s: float, now_boot_s: float | None, own_ns: str | None,
          problems: list[str]) -> list[Seen]:
    seen: list[Seen] = []
    for name in found.entries:
        uuid = filler_dirs.parse_status_file(name)
        if uuid is None:
            continue
        try:
            data, info = found.read(name, MAX_BYTES)
            status = parsed(info, data, from_json, uuid)
        except FileNotFoundError:
            continue  # its filler stopped while we read
        except HoldError as error:
            problems.append(f"{os.path.join(found.path, name)} {error}: skipped")
            continue
        locked = found.locked(alive_name(uuid)) if status.locked else None
        seen.append(judge(status, now_unix_s, now_boot_s, own_ns, locked, found.uid))
    return seen
