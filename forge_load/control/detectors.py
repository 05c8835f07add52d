"""The foreign-job signals: small pure functions over one poll's facts and the thresholds (docs/design.md §4).

Each signal returns why it fired, or None. Any one is enough to yield. A new signal is a function here and a
line in SIGNALS; its thresholds, if any, a field of Thresholds and a setting in config/settings.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from forge_load.config.settings import MAX_FOREIGN_SAMPLES, Config


@dataclass(frozen=True)
class ShareSample:
    """One NVML sample window (or one GPM reading's span) split into our share and the rest."""

    t_s: float
    util_ratio: float
    own_ratio: float

    @property
    def foreign_ratio(self) -> float:
        return max(self.util_ratio - self.own_ratio, 0.0)


@dataclass(frozen=True)
class Thresholds:
    """What counts as a foreign job: built once from the config."""

    mem_mib: float = 64.0  # device memory beyond ours and the baseline
    util_ratio: float = 0.1  # utilization beyond our own share ...
    util_samples: int = 2  # ... for this many samples running
    use_process_list: bool = True  # another process on the GPU

    @classmethod
    def from_config(cls, config: Config) -> Thresholds:
        return cls(config.foreign_mem_mib, config.foreign_util_ratio, config.foreign_util_samples,
                   config.use_process_list)


@dataclass(frozen=True)
class Observation:
    """What one poll found (None where the GPU does not tell)."""

    foreign_pids: tuple[int, ...]  # processes on the GPU other than ours, as far as our PID namespace shows
    foreign_mem_mib: float | None  # device memory beyond ours and the baseline
    recent: tuple[ShareSample, ...]  # the latest judged sample windows, oldest first
    # The latest GPM readings' SM activity against our own SM activity of each span, oldest first (docs/design.md §12):
    # our busy share times the share of the SMs our kernels keep a warp on (control/shape.py), which our own load
    # never exceeds.
    activity: tuple[ShareSample, ...] = ()


DEFAULT_THRESHOLDS = Thresholds()

Signal = Callable[[Observation, Thresholds], "str | None"]


def process_signal(seen: Observation, limits: Thresholds) -> str | None:
    if not (limits.use_process_list and seen.foreign_pids):
        return None
    return "process " + ",".join(map(str, seen.foreign_pids[:5])) + " on the GPU"


def memory_signal(seen: Observation, limits: Thresholds) -> str | None:
    if seen.foreign_mem_mib is None or seen.foreign_mem_mib <= limits.mem_mib:
        return None
    return f"{seen.foreign_mem_mib:.0f} MiB of device memory beyond ours and the baseline"


def _run_over(shares: tuple[ShareSample, ...], limits: Thresholds) -> int:
    """How many of the newest shares running are beyond our own by more than the threshold; 0 when too few."""
    run = 0
    for share in reversed(shares):
        if share.foreign_ratio <= limits.util_ratio:
            break
        run += 1
    return run if run >= limits.util_samples else 0


def utilization_signal(seen: Observation, limits: Thresholds) -> str | None:
    if not (run := _run_over(seen.recent, limits)):
        return None
    last = seen.recent[-1]
    return f"utilization {last.util_ratio:.2f} beyond our own {last.own_ratio:.2f} for {run} samples"


def sm_activity_signal(seen: Observation, limits: Thresholds) -> str | None:
    """GPM's SM activity beyond our own (our busy share times the share of the SMs our kernels hold): the same
    tolerance as utilization's. The tails of our sleeps or last waves read below it, which can only hide a job's SM
    activity behind ours, never make ours look foreign; a single warp of ours counts for one SM only, so a job on the
    others is seen."""
    if not (run := _run_over(seen.activity, limits)):
        return None
    last = seen.activity[-1]
    return f"SM activity {last.util_ratio:.2f} beyond our own {last.own_ratio:.2f} for {run} GPM readings"


# (name, signal), in the order reasons are logged.
SIGNALS: tuple[tuple[str, Signal], ...] = (
    ("process", process_signal),
    ("memory", memory_signal),
    ("utilization", utilization_signal),
    ("sm_activity", sm_activity_signal),
)
GPM_SIGNALS = frozenset({"sm_activity"})  # read GPM: not a signal at all on a GPU without it (not a blind one)
RECENT_SAMPLES = MAX_FOREIGN_SAMPLES  # judged windows the Monitor keeps: the most a signal may look back
