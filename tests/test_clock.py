"""clock_minus_monotonic_s: a clock's offset from the monotonic clock, not shifted by a preemption between reads."""

from __future__ import annotations

from forge_load.clock import PAIR_TRIES, clock_minus_monotonic_s

OFFSET_S = 1_000_000_000.0


class Clocks:
    """A monotonic clock and a wall clock OFFSET_S ahead of it, each read taking 1 µs; the thread is preempted
    right after the wall read of each try for the seconds `preempted_s` gives that try."""

    def __init__(self, *preempted_s: float, mono_s: float = 100.0) -> None:
        self.true_s = mono_s
        self.preempted_s = list(preempted_s)

    def mono(self) -> float:
        self.true_s += 1e-6
        return self.true_s

    def wall(self) -> float:
        self.true_s += 1e-6
        wall_s = self.true_s + OFFSET_S
        self.true_s += self.preempted_s.pop(0) if self.preempted_s else 0.0
        return wall_s


def test_a_preempted_pair_is_read_again() -> None:
    clocks = Clocks(0.05, 0.01)
    assert abs(clock_minus_monotonic_s(clocks.wall, clocks.mono) - OFFSET_S) < 1e-5
    assert clocks.preempted_s == []


def test_always_preempted_the_closest_pair_counts_on_its_midpoint() -> None:
    # Preempted at every try, the least (4 ms) sets the error bound: half of it either way.
    clocks = Clocks(*[0.05] * (PAIR_TRIES - 1), 0.004, 0.0)
    assert abs(clock_minus_monotonic_s(clocks.wall, clocks.mono) - OFFSET_S) <= 0.002 + 1e-5
    assert clocks.preempted_s == [0.0]  # no try beyond PAIR_TRIES


def test_a_clean_pair_is_read_once() -> None:
    clocks = Clocks()
    assert abs(clock_minus_monotonic_s(clocks.wall, clocks.mono) - OFFSET_S) < 1e-5
    assert abs(clocks.true_s - 100.0 - 3e-6) < 1e-9  # three reads
