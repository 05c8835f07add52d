"""NVML's utilization samples, read the one way the filler reads them (the Monitor, and the benchmark's sampler).

The driver keeps a buffer of samples, one per sample window; each read asks for those newer than the last
one seen. Where the GPU keeps no buffer (`utilization_samples` gives None), the latest window's ratio is read
instead, once per window; where the buffer stays empty for longer than two of the longest windows (none while
idle, on some products), the latest window too. The window length is learnt from the buffered samples' stamps.
"""

from __future__ import annotations

from statistics import median

from forge_load.control.probe import Probe, UtilSample

DEFAULT_WINDOW_S = 1.0 / 6.0
FALLBACK_AFTER_S = 2.5  # longer than two of the longest (1 s) sample windows
GAPS_KEPT = 9  # the window is the median of the latest gaps between buffered samples
EARLY_S = 0.02  # the buffer is asked again from this long before the next sample is due (stamps run a hair ahead)


class SampleReader:
    """New utilization samples on each `read(now_s)`, on the probe's clock (the caller's `now_s`)."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self._last_sample_s = float("-inf")
        self._last_buffered_s = float("-inf")
        self._gaps_s: list[float] = []
        # Whether the GPU answered each query at its latest call (None: not asked yet).
        self.samples_offered: bool | None = None
        self.ratio_offered: bool | None = None

    @property
    def blind(self) -> bool:
        """The GPU offers neither buffered samples nor the latest window's ratio (as on a MIG instance)."""
        return self.samples_offered is False and self.ratio_offered is False

    @property
    def window_s(self) -> float:
        """The sample window, from the buffered samples' spacing; 1/6 s until two have been seen."""
        return median(self._gaps_s) if self._gaps_s else DEFAULT_WINDOW_S

    def read(self, now_s: float) -> list[UtilSample]:
        """The samples since the previous read, oldest first ([] when none is new).

        Once the window is known, the buffer is not asked before its next sample can be there: a query costs
        more CPU than the rest of a poll (docs/design.md §7). A stamp may run a hair ahead of our clock, so
        the buffer is asked from EARLY_S before."""
        if self._gaps_s and now_s < self._last_buffered_s + self.window_s - EARLY_S:
            return []
        fresh = self.probe.utilization_samples(self._last_sample_s)
        self.samples_offered = fresh is not None
        if fresh:
            for sample in fresh:
                if self._last_buffered_s > float("-inf"):
                    self._gaps_s = (self._gaps_s + [sample.t_s - self._last_buffered_s])[-GAPS_KEPT:]
                self._last_buffered_s = sample.t_s
            self._last_sample_s = fresh[-1].t_s
            return list(fresh)
        if now_s - self._last_sample_s >= (self.window_s if fresh is None else FALLBACK_AFTER_S):
            # No buffered samples (unsupported, or none while idle): read the latest window instead.
            ratio = self.probe.utilization_ratio()
            self.ratio_offered = ratio is not None
            if ratio is not None:
                self._last_sample_s = now_s
                return [UtilSample(now_s, ratio)]
        return []
