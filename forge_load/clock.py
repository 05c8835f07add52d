"""The host's clocks: its boot clock, and one clock's offset from the monotonic clock read at one instant."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

PAIR_TRIES = 5
# Two monotonic reads this close apart had nothing between them but the read they bracket (each read takes well
# under a microsecond; a preemption or a wait for the GIL, milliseconds).
CLEAN_PAIR_S = 20e-6


def clock_minus_monotonic_s(clock: Callable[[], float],
                            monotonic: Callable[[], float] = time.monotonic) -> float:
    """`clock()` minus `monotonic()` at one instant (the wall clock's: the Unix time of monotonic time 0).

    Two reads one after the other are off by whatever ran between them (a preemption on a busy host, another
    thread holding the GIL: milliseconds), so `clock` is read between two monotonic reads, up to PAIR_TRIES
    times, and the try whose monotonic reads lie closest counts, on their midpoint."""
    best_gap_s, best_offset_s = math.inf, 0.0
    for _ in range(PAIR_TRIES):
        before_s = monotonic()
        clock_s = clock()
        after_s = monotonic()
        if after_s - before_s < best_gap_s:
            best_gap_s, best_offset_s = after_s - before_s, clock_s - (before_s + after_s) / 2
        if best_gap_s <= CLEAN_PAIR_S:
            break
    return best_offset_s


def boot_time_s() -> float | None:
    """Seconds since the host booted (CLOCK_BOOTTIME: suspend included, not stepped with the wall clock, the same in
    every container of the host); None where the platform has no such clock."""
    clock_id = getattr(time, "CLOCK_BOOTTIME", None)
    if clock_id is None:
        return None
    try:
        return time.clock_gettime(clock_id)
    except OSError:
        return None
