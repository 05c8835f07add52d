"""NVML by need (docs/design.md §7): what the Monitor asks of a driver, polled in virtual time on the fake pynvml.
Memory and the energy counter at every poll; the process lists, the dearest queries, when memory moved or after a
gap that grows while nothing changes; power and temperature about once a second; and every signal still as quick."""

from __future__ import annotations

from typing import Any

import pynvml
from fake_pynvml import MIB, FakeNvml, FakeProcess
from nvml_support import Clocks, clocks, fake

__all__ = ["clocks", "fake"]  # fixtures, imported for pytest


OWN_PID, FOREIGN_PID, POLL_S = 4242, 777, 0.1
PROCESS_LISTS = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3")


class Polled:
    """A Monitor on the fake pynvml, polled every POLL_S of virtual time (the probe's clocks follow)."""

    def __init__(self, fake: FakeNvml, clocks: Clocks) -> None:
        from forge_load.control.monitor import Monitor
        from forge_load.control.worker import BusyLog

        self.fake, self.clocks = fake, clocks
        self.dev = fake.devices[0]
        self.dev.memory_used_bytes = 600 * MIB
        self.dev.compute_processes = [FakeProcess(OWN_PID, 600 * MIB)]
        busy = BusyLog()
        busy.mark_complete_until(1e12)
        self.t0 = clocks.mono_s
        self.monitor = Monitor(clocks.probe(fake), busy, own_pid=OWN_PID, baseline_mem_mib=0.0,
                               own_mem_context_mib=600.0, poll_interval_s=POLL_S)
        self.due_s = self.t0

    def until(self, seconds: float) -> list[Any]:
        """Poll up to t0 + seconds; the readings."""
        readings = []
        while self.due_s <= self.t0 + seconds + 1e-9:
            self.clocks.mono_s = self.due_s
            self.due_s = self.monitor.step(self.due_s)
            readings.append(self.monitor.latest())
        return readings

    def count(self, names: tuple[str, ...] | str, since: int = 0) -> int:
        names = (names,) if isinstance(names, str) else names
        return sum(1 for name, _, _ in self.fake.calls[since:] if name in names)


def test_monitor_reads_the_process_lists_about_once_a_second_or_less_while_nothing_changes(
        fake: FakeNvml, clocks: Clocks) -> None:
    """Memory and the energy counter at every poll; the process lists (dear on a real driver) at most once a
    second, less while memory and the lists stay still; power and temperature about once a second."""
    polled = Polled(fake, clocks)
    polled.until(10.0)
    mark = len(fake.calls)
    readings = polled.until(30.0)
    assert polled.count("nvmlDeviceGetMemoryInfo", mark) == len(readings) == 200  # the cheap query, every poll
    assert polled.count("nvmlDeviceGetTotalEnergyConsumption", mark) == len(readings)
    compute = polled.count(PROCESS_LISTS[0], mark)
    assert 1 <= compute <= 20 / 2.0  # at most one refresh every 2 s once still (and never none)
    for name in ("nvmlDeviceGetPowerUsage", "nvmlDeviceGetTemperature"):
        assert 19 <= polled.count(name, mark) <= 21, name  # about once a second: as often as NVML refreshes them
    assert len({r.power_t_s for r in readings}) in (polled.count("nvmlDeviceGetPowerUsage", mark),
                                                    polled.count("nvmlDeviceGetPowerUsage", mark) + 1)
    assert all(r.power_w == 70.0 and r.temperature_c == 35.0 for r in readings)  # the last read, between reads
    assert all(r.reason is None for r in readings)


def test_a_new_context_is_seen_by_the_process_and_memory_signals_at_the_same_poll(fake: FakeNvml,
                                                                                    clocks: Clocks) -> None:
    """A new context costs hundreds of MiB: the poll that sees memory move reads the lists again, so neither
    signal is a poll later than when the lists were read at every poll; and the same when the job leaves."""
    polled = Polled(fake, clocks)
    polled.until(20.0)  # still for long: the lists are read least often now
    polled.dev.memory_used_bytes += 300 * MIB
    polled.dev.compute_processes = [*polled.dev.compute_processes, FakeProcess(FOREIGN_PID, 300 * MIB)]
    first = polled.until(20.0 + POLL_S)[0]
    assert first.foreign_pids == (FOREIGN_PID,) and {"process", "memory"} <= set(first.signals), first
    polled.until(30.0)
    polled.dev.memory_used_bytes -= 300 * MIB
    polled.dev.compute_processes = polled.dev.compute_processes[:1]
    after = polled.until(30.0 + POLL_S)[0]
    assert after.foreign_pids == () and after.reason is None, after


def test_memory_below_the_move_threshold_does_not_read_the_lists_but_a_small_job_is_still_seen(
        fake: FakeNvml, clocks: Clocks) -> None:
    """Memory creeping by less than half the memory signal's threshold leaves the lists alone; a process that
    came without moving memory (none real: every context costs memory) is still listed within the longest gap."""
    from forge_load.control.monitor import PROCESS_REFRESH_MAX_S

    polled = Polled(fake, clocks)
    polled.until(20.0)
    mark = len(fake.calls)
    polled.dev.memory_used_bytes += 16 * MIB  # below 64 / 2 MiB
    polled.until(20.0 + POLL_S)
    assert polled.count(PROCESS_LISTS[0], mark) == 0
    polled.dev.compute_processes = [*polled.dev.compute_processes, FakeProcess(FOREIGN_PID, 0)]
    readings = polled.until(20.0 + POLL_S + PROCESS_REFRESH_MAX_S)
    assert readings[-1].foreign_pids == (FOREIGN_PID,) and "process" in readings[-1].signals
    assert PROCESS_REFRESH_MAX_S <= 4.0  # about once a second or less, and a job seen within seconds


def test_lists_and_power_are_read_at_every_poll_when_memory_cannot_be_read(fake: FakeNvml, clocks: Clocks) -> None:
    """Without a memory reading nothing says the lists are stale: they are read at every poll, as before."""
    polled = Polled(fake, clocks)
    polled.dev.errors["nvmlDeviceGetMemoryInfo"] = pynvml.NVMLError_NotSupported
    readings = polled.until(5.0)
    assert polled.count(PROCESS_LISTS[0]) == len(readings)


def test_without_an_energy_counter_power_is_read_at_every_poll(fake: FakeNvml, clocks: Clocks) -> None:
    """The filler then integrates the power readings: they stay as frequent as before."""
    polled = Polled(fake, clocks)
    polled.dev.errors["nvmlDeviceGetTotalEnergyConsumption"] = pynvml.NVMLError_NotSupported
    readings = polled.until(5.0)
    assert polled.count("nvmlDeviceGetPowerUsage") == len(readings)
    assert len({r.power_t_s for r in readings}) == len(readings)
