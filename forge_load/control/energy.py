"""The device's energy while we fill (forge_load_energy_joules_total, the stop line's energy_j): from NVML's
energy counter where the GPU has one, else its power readings integrated. Pure: the readings are handed in."""

from __future__ import annotations

from forge_load.control.monitor import Reading


class EnergyMeter:
    """Counts the energy between two readings when we were filling at the first (`counting`, set by the Filler)."""

    def __init__(self) -> None:
        self.energy_j = 0.0
        self.source = "none"  # counter (NVML's energy counter), power (integrated readings) or none
        self._previous: tuple[float, float | None, float | None] | None = None  # (t_s, energy_j, power_w)
        self.counting = False

    @staticmethod
    def source_of(reading: Reading | None) -> str:
        """How this GPU's energy is counted: NVML's energy counter, integrated power readings, or not at all."""
        if reading is not None and reading.energy_j is not None:
            return "counter"
        return "power" if reading is not None and reading.power_w is not None else "none"

    def add(self, reading: Reading) -> None:
        """The device's energy between the previous reading and this one, if we were filling at the previous one:
        from NVML's energy counter where it has one, else the power readings integrated (trapezoids)."""
        previous = self._previous
        self._previous = (reading.t_s, reading.energy_j, reading.power_w)
        self.source = self.source_of(reading)
        if previous is None or not self.counting:
            return
        then_s, then_j, then_w = previous
        if reading.energy_j is not None and then_j is not None:
            if reading.energy_j >= then_j:  # a counter that went back (the driver reloaded) loses this interval
                self.energy_j += reading.energy_j - then_j
        elif reading.power_w is not None and then_w is not None:
            self.energy_j += (then_w + reading.power_w) / 2 * max(reading.t_s - then_s, 0.0)
