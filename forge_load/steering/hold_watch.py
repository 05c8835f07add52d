"""The filler's side of the holds: the holds kept in this process (HoldBoard, the kubelet's), one GPU's watch over
the directory and the board (HoldWatch), and what the filler honours and acknowledges (FillerHolds), in its own
directory (filler_dirs.py). The directory's API is holds.py, the acknowledgements' acks.py."""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from forge_load.steering import acks
from forge_load.steering import holds as disk
from forge_load.steering.filler_dirs import OwnDir, ack_file
from forge_load.steering.holds import (
    ACK_REFRESH_S,
    DEFAULT_IDLE_AGE_OUT_S,
    Ack,
    BootStamp,
    Hold,
    HoldError,
    HoldsView,
    problem_key,
)
from forge_load.steering.listeners import Listeners

FAIL_SAFE_HOLDER = "-"  # no holder's name (HOLDER_RE): the GPU held because its holds cannot be counted or read


@dataclass(frozen=True)
class HoldChange:
    event: str  # "hold" or "release"; holder FAIL_SAFE_HOLDER for the fail safe
    holder: str
    reason: str  # the hold's reason ("hold"), or why it ended: released, expired, aged out ("release")
    until_unix_s: float | None = None
    count: int = 1  # the holders it stands for (coalesce): `holder` is the first of them by name


def coalesce(changes: list[HoldChange]) -> list[HoldChange]:
    """One change (one log line) per kind in one look at the holds, however many holders it stands for: 1,000 pods
    the kubelet assigns one GPU in one poll are one `hold` with count 1000, not 1,000 lines. Holds begun are one;
    holds ended are one per why (released, expired, aged out); the fail safe's stand apart. Order is kept, each
    group where its first change was."""
    out: list[HoldChange] = []
    at: dict[tuple[str, str], int] = {}  # (event, why) -> its change's place in out
    for change in changes:
        if change.holder == FAIL_SAFE_HOLDER:
            out.append(change)
            continue
        key = (change.event, change.reason if change.event == "release" else "")
        if key in at:
            first = out[at[key]]
            out[at[key]] = dataclasses.replace(first, count=first.count + change.count)
        else:
            at[key] = len(out)
            out.append(change)
    return out

class HoldBoard:
    """Holds kept in this process, never on disk: what an engine the filler asks itself says (the kubelet's
    pod-resources List, service/kubelet.py). One writer replaces them all at once; every GPU's HoldWatch reads
    its own. Such a hold has no end time: it ends when the writer leaves it out, or by the idle age-out; its
    `since_unix_s` stamps it, so one that ends and comes back is a new hold."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holds: dict[str, tuple[Hold, ...]] = {}
        self.listeners = Listeners()  # told after every change
        self.generation = 0  # moves on every change

    def replace(self, holds: Iterable[Hold]) -> bool:
        """Every hold of the board, at once; whether anything changed (listeners are told then)."""
        by_gpu: dict[str, list[Hold]] = {}
        for hold in holds:  # by the one spelling of its UUID: a kubelet's `GPU-5FD4...` is NVML's `GPU-5fd4...`
            hold = dataclasses.replace(hold, gpu_uuid=disk.canonical_gpu_uuid(hold.gpu_uuid))
            by_gpu.setdefault(hold.gpu_uuid, []).append(hold)
        new = {gpu: tuple(sorted(held, key=lambda h: h.holder)) for gpu, held in by_gpu.items()}
        with self._lock:
            if new == self._holds:
                return False
            self._holds = new
            self.generation += 1
        self.listeners.tell()
        return True

    def holds_for(self, gpu_uuid: str) -> tuple[Hold, ...]:
        with self._lock:
            return self._holds.get(disk.canonical_gpu_uuid(gpu_uuid), ())

    def holds_of(self, gpu_uuids: tuple[str, ...]) -> tuple[Hold, ...]:
        """The holds of each of `gpu_uuids` in turn (held_uuids: a MIG device's, then its GPU's)."""
        return tuple(hold for uuid in gpu_uuids for hold in self.holds_for(uuid))


def held_uuids(gpu_uuid: str, whole_gpu_uuid: str = "") -> tuple[str, ...]:
    """Whose holds hold a GPU's filler: its own, and on a MIG device its GPU's (`whole_gpu_uuid`), since a job given
    the whole GPU runs on every MIG device of it."""
    return (gpu_uuid, whole_gpu_uuid) if whole_gpu_uuid else (gpu_uuid,)


def jobs_announced(hold_dir: str, board: HoldBoard | None) -> bool:
    """Whether holds can tell a filler of a job: the kubelet's board, or a hold directory that exists."""
    return board is not None or disk.configured(hold_dir)


class HoldWatch:
    """One GPU's holds as its filler sees them, asked on every poll.

    The directory is listed again only when its mtime moved, or a second has passed since it was last listed (a
    change in the same clock tick as a listing would not move the mtime), so polling ten times a second costs a
    stat. `board` adds the holds kept in this process (HoldBoard): honoured like a file's, a file's hold of the
    same holder first. `check` says what began and ended since the last call, and each problem once. The idle age-out:
    a hold that has seen no foreign work on its GPU for `idle_age_out_s` (filler time, counted from when this
    filler first saw it, or from the last foreign work) is no longer honoured until its file is rewritten.
    `whole_gpu_uuid`: this is a MIG device of that GPU, whose holds it honours as its own (a job given the whole GPU
    runs on every MIG device of it).
    """

    def __init__(self, hold_dir: str, gpu_uuid: str, idle_age_out_s: float = DEFAULT_IDLE_AGE_OUT_S,
                 board: HoldBoard | None = None, whole_gpu_uuid: str = "") -> None:
        self.hold_dir = hold_dir
        self.gpu_uuid = gpu_uuid
        self.uuids = held_uuids(gpu_uuid, whole_gpu_uuid)
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

    def stamp(self, holder: str) -> int | None:
        """The mtime (ns) of an honoured holder's file (its `since` for the board's): a refresh moves it."""
        return self._stamp.get(holder)

    def aged_out(self) -> dict[str, int]:
        """The holders aged out, not honoured until their file is rewritten, and their file's mtime (ns) then."""
        return dict(self._aged)

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
            self._view = disk.read_holds_of(self.hold_dir, self.uuids, now_unix_s)
            if self._view.mtimes_ns != before:
                self.generation += 1  # a hold of this GPU placed, refreshed or removed: acknowledge it at once
        view = self._view
        holds, stamps = list(view.holds), dict(view.mtimes_ns)
        if self.board is not None:
            from_files = {h.holder for h in view.holds} | {h.holder for h in view.expired}
            for hold in self.board.holds_of(self.uuids):
                if hold.holder not in from_files:
                    from_files.add(hold.holder)  # one holder of the device and of its GPU: one hold
                    holds.append(hold)
                    stamps[hold.holder] = round(hold.since_unix_s * 1e9)
        problems = [p for p in view.problems if problem_key(p) not in self._said]
        # only what is there now, each kind once however its count changes: bounded, and said again if it comes back
        self._said = {problem_key(p) for p in view.problems}
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
    """A filler's side of one GPU's holds: the watch, and the acknowledgement it keeps in its own directory in the
    hold directory (written at once on every change of what it honours, its state or its drain, and at least every
    ACK_REFRESH_S), and format 1's in the hold directory itself for the hold commands of earlier releases.

    The acknowledgement is written only where the hold directory exists (the filler never creates it). A filler that
    cannot have its own directory there (not writable, its names taken) says so once (`ack_problem`), writes no
    acknowledgement anywhere (never one that says drained) and tries again at the next change or refresh; `ack_ok`
    says whether its last one was written."""

    def __init__(self, hold_dir: str, gpu_uuid: str, pid: int, wall_clock: Callable[[], float],
                 idle_age_out_s: float = DEFAULT_IDLE_AGE_OUT_S, board: HoldBoard | None = None,
                 boot_clock: Callable[[], BootStamp] = acks.boot_stamp, whole_gpu_uuid: str = "") -> None:
        self.watch = HoldWatch(hold_dir, gpu_uuid, idle_age_out_s, board, whole_gpu_uuid)
        self.whole_gpu_uuid = whole_gpu_uuid
        self.boot_clock = boot_clock  # the host's, even in a simulated run: `hold --wait` reads it in real time
        self.hold_dir = hold_dir
        self.gpu_uuid = gpu_uuid
        self.pid = pid
        self.wall_clock = wall_clock
        self.own = OwnDir(hold_dir)
        self.ack_ok = False
        self._last: tuple[str, tuple[str, ...], bool, int] | None = None
        self._written_s = -math.inf
        self._failed: str | None = None
        self._legacy_failed = False

    @property
    def held(self) -> bool:
        return self.watch.held

    @property
    def ack_failing(self) -> bool:
        """Its last acknowledgement could not be written where a hold directory exists (said once: ack_problem)."""
        return self._failed is not None

    @property
    def generation(self) -> int:
        """Moves when the in-process holds change: the filler asks again at once, not at its next reading."""
        return self.watch.board.generation if self.watch.board is not None else 0

    def check(self, now_s: float) -> tuple[list[HoldChange], list[str]]:
        return self.watch.check(now_s, self.wall_clock())

    def foreign_seen(self, now_s: float) -> None:
        self.watch.foreign_seen(now_s)

    @property
    def ack_due_s(self) -> float:
        """When the acknowledgement is due to be refreshed (the filler's loop wakes for it even while a burst's
        wake-ups take the readings in between)."""
        return self._written_s + ACK_REFRESH_S

    def acknowledge(self, now_s: float, state: str, drained: bool) -> str | None:
        """Write the acknowledgement if it changed or is due; a problem line the first time a write fails."""
        said = (state, self.watch.holders, drained, self.watch.generation)  # a refreshed hold is acknowledged too
        if said == self._last and now_s < self.ack_due_s:  # the same sum: woken at it, it writes
            return None
        self._last, self._written_s = said, now_s
        ack = Ack(self.gpu_uuid, self.pid, state, said[1], drained, self.wall_clock(), self.boot_clock(),
                  self.whole_gpu_uuid, fail_safe=self.watch.fail_safe is not None)
        try:
            acks.write_ack(self.own, ack)
        except FileNotFoundError:
            self.ack_ok = False
            return None  # no hold directory (not mounted): nothing to acknowledge to
        except (OSError, HoldError) as error:
            self.ack_ok = False
            why = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
            problem = (f"cannot write its acknowledgement in {self.hold_dir} ({why}): `forge-load hold --wait` "
                       "cannot see this filler drain; is the hold directory mounted read-write, and writable by "
                       "this user?")
            first, self._failed = self._failed is None, problem
            return problem if first else None
        self._failed, self.ack_ok = None, True
        try:  # for the hold commands of earlier releases, where it can (a neighbour may have taken the name)
            acks.write_legacy_ack(self.hold_dir, ack)
        except OSError as error:
            if not self._legacy_failed:
                self._legacy_failed = True
                return (f"cannot write the acknowledgement for the hold commands of earlier releases "
                        f"({error.strerror or error}): they see no filler of this GPU; this release's commands "
                        f"read {os.path.join(self.own.path, ack_file(self.gpu_uuid, self.whole_gpu_uuid))}")
        return None

    def close(self) -> None:
        """The filler stops: no acknowledgement left behind (`hold --wait` need not wait for it to go stale)."""
        self.own.remove(ack_file(self.gpu_uuid, self.whole_gpu_uuid))
        acks.remove_legacy_ack(self.hold_dir, self.gpu_uuid)
        self.own.close()
