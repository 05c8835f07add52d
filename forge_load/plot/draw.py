"""A run's series drawn with matplotlib, imported here only, inside render(): the filler and every other command
run without it (it is the optional extra `forge-load[plot]`).

One panel per GPU or MIG device: the target (a step), NVML's utilization, our own share and the foreign share, the
held metric and its own share where the metric is not NVML's utilization (each status line's mean over the interval
that ends at it, so drawn as steps that end there), board power the same way on a second axis with one scale for
every panel, and the yielding, paused and held spans shaded. Every artist has an SVG id (`gid`) named after its
series, so a test or a script can find the series in the file.

A long log is thinned before it is drawn, so that days of log draw in seconds: each curve is cut into THIN_BUCKETS
stretches of equal time (about two to a pixel of the panel), and of each only the first and last point and the
lowest and the highest between gaps are kept, and every gap; drawn as steps, they cover the same pixels as every
point would. Spans closer than a bucket's time to the next of their kind are drawn as one.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import IO, Any

from forge_load.plot.series import METRIC_FIELDS, SHARES, SPAN_STATES, Curve, Series

SUFFIXES = (".png", ".svg")
THIN_BUCKETS = 2000  # a panel is about 850 pixels wide
_COLOURS = {"target": "black", "util": "tab:blue", "own": "tab:green", "foreign": "tab:red", "power_w": "tab:purple",
            "yielding": "tab:red", "paused": "tab:gray", "held": "tab:orange", "metric": "tab:cyan",
            "metric_own": "tab:olive"}
_LABELS = {"target": "target", "util": "NVML utilization", "own": "own share", "foreign": "foreign share",
           "power_w": "power (W)", "yielding": "yielding", "paused": "paused", "held": "held"}
_PANEL_HEIGHT_IN = 3.2
# The time axis in the unit that keeps its numbers short: seconds up to 3 hours, then hours up to 3 days, then days.
_UNITS = ((3 * 3600.0, 1.0, "s"), (3 * 86400.0, 3600.0, "h"), (math.inf, 86400.0, "days"))


class MissingExtra(Exception):
    """matplotlib is not installed."""


def thin(curve: Curve, buckets: int = THIN_BUCKETS) -> tuple[Sequence[float], Sequence[float]]:
    """The points of a curve worth drawing, in order: all of them when they are few, else per bucket of equal
    time its first and last point, its lowest and highest value between gaps, and its gaps (NaN). Slices, min(),
    max() and index() of the arrays do the work, in C."""
    t, v = curve.t, curve.v
    size = len(t)
    if size <= 4 * buckets:
        return t, v
    width = (t[-1] - t[0]) / buckets or 1.0
    keep: set[int] = set(curve.gaps)
    low = 0
    for bucket in range(1, buckets + 1):
        high = bisect.bisect_left(t, t[0] + bucket * width, low) if bucket < buckets else size
        if high <= low:
            continue
        keep.update((low, high - 1))
        begin, gap_at = low, bisect.bisect_left(curve.gaps, low)
        while begin < high:
            end = curve.gaps[gap_at] if gap_at < len(curve.gaps) and curve.gaps[gap_at] < high else high
            if end > begin:  # a stretch without a gap: its lowest and highest
                stretch = v[begin:end]
                keep.add(v.index(min(stretch), begin, end))
                keep.add(v.index(max(stretch), begin, end))
            begin, gap_at = end + 1, gap_at + 1
        low = high
    chosen = sorted(keep)
    return [t[i] for i in chosen], [v[i] for i in chosen]


def _merged_spans(series: Series, state: int, tolerance: float) -> list[tuple[float, float]]:
    """(begin, width) of the spans of one state, those closer than `tolerance` to the next drawn as one."""
    merged: list[list[float]] = []
    for kind, begin, end in zip(series.span_kind, series.span_begin_t, series.span_end_t):
        if kind != state:
            continue
        if merged and begin - merged[-1][1] < tolerance:
            merged[-1][1] = end
        else:
            merged.append([begin, end])
    return [(begin, end - begin) for begin, end in merged]


def render(panels: list[Series], title: str = "") -> tuple[Any, list[str]]:
    """The figure of these panels, and the series drawn, as "key:name"."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
    except ImportError as error:
        raise MissingExtra(str(error)) from None
    end_t = max((series.end_t for series in panels), default=0.0)
    _, scale, unit = next(u for u in _UNITS if end_t <= u[0])
    power_max_w = max((w for s in panels for w in thin(s.power_w)[1] if w == w), default=0.0)  # w == w: no gap
    figure = Figure(figsize=(10.0, 1.0 + _PANEL_HEIGHT_IN * len(panels)), layout="constrained")
    axes_list: list[Any] = list(figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0])
    drawn: list[str] = []
    for axes, series in zip(axes_list, panels):
        drawn += [f"{series.key}:{name}" for name in _panel(axes, series, scale, end_t, power_max_w)]
    axes_list[-1].set_xlim(0.0, max(end_t / scale, 1e-9))
    axes_list[-1].set_xlabel(f"t ({unit} since start)")
    if title:
        figure.suptitle(title, parse_math=False)
    return figure, drawn


def draw(panels: list[Series], out: IO[bytes], suffix: str, title: str = "") -> list[str]:
    """Draws the panels into `out` as PNG or SVG (`suffix`); returns the series drawn, as "key:name"."""
    figure, drawn = render(panels, title)
    figure.savefig(out, format=suffix.lstrip(".").lower(), dpi=100, metadata=_metadata(suffix))
    return drawn


def _metadata(suffix: str) -> dict[str, Any]:
    # No date in the file: the same log draws the same bytes (the README's picture is checked into git).
    return {"Date": None} if suffix.lower() == ".svg" else {"Software": "forge-load plot"}


def _panel_title(series: Series) -> str:
    def cut(text: str) -> str:
        return text if len(text) <= 60 else text[:57] + "..."

    if not series.key.startswith("MIG-"):
        return f"GPU {cut(series.gpu)}"
    profile = f"MIG {cut(series.mig_profile)} " if series.mig_profile else ""
    instance = f"(instance {cut(series.gpu_instance)}) " if series.gpu_instance else ""
    return f"GPU {cut(series.gpu)}, {profile}{instance}{cut(series.key)}"


def _curve_style(series: Series, name: str) -> dict[str, Any]:
    if name in SHARES:
        # A MIG device's util is GPM's graphics activity: NVML has no utilization there (docs/operating.md).
        label = "graphics activity (GPM)" if name == "util" and series.key.startswith("MIG-") else _LABELS[name]
        return {"color": _COLOURS[name], "lw": 3.0 if name == "util" else 1.2, "alpha": 0.45 if name == "util" else 1,
                "label": label}
    if name.endswith("_own"):
        return {"color": _COLOURS["metric_own"], "lw": 1.2, "ls": "-.", "label": f"{name[:-4]}, own share"}
    held = " (held)" if series.metric == name else ""
    return {"color": _COLOURS["metric"], "lw": 3.0, "alpha": 0.55, "label": f"{name}{held}"}


def _same_as_held(series: Series) -> bool:
    """A MIG device holding gr_activity: its util, own and foreign are that same reading, drawn once as the held
    metric's."""
    return series.key.startswith("MIG-") and series.metric == "gr_activity" and "gr_activity" in series.metric_curves


def _panel(axes: Any, series: Series, scale: float, end_t: float, power_max_w: float) -> list[str]:
    drawn: list[str] = []
    tolerance = end_t / THIN_BUCKETS
    for index, state in enumerate(SPAN_STATES):
        spans = [(begin / scale, width / scale) for begin, width in _merged_spans(series, index, tolerance)]
        if spans:
            axes.broken_barh(spans, (0, 1), transform=axes.get_xaxis_transform(), facecolor=_COLOURS[state],
                             alpha=0.15, lw=0, label=_LABELS[state], gid=f"span-{state}")
            drawn.append(f"span-{state}")
    if series.restarts_t:
        axes.vlines([t / scale for t in series.restarts_t], 0, 1, transform=axes.get_xaxis_transform(),
                    color="black", ls=":", lw=1, gid="restart")
    for name, curve in series.curves():  # NVML's under the shares it splits into; the held metric's after
        if name == "power_w" or not curve.has_values or (name in SHARES and _same_as_held(series)):
            continue
        xs, ys = thin(curve)
        axes.plot([x / scale for x in xs], ys, drawstyle="steps-pre", gid=name, **_curve_style(series, name))
        drawn.append(name)
    if len(series.target):
        xs, ys = [*series.target.t, series.end_t], [*series.target.v, series.target.v[-1]]
        axes.plot([x / scale for x in xs], ys, drawstyle="steps-post", color=_COLOURS["target"], lw=1, ls="--",
                  label=_LABELS["target"], gid="target")
        drawn.append("target")
    axes.set_ylim(0.0, 1.3)  # the headroom above 1 holds the legend, clear of the lines
    axes.set_yticks([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    held_metric = any(name in METRIC_FIELDS for name in drawn)
    axes.set_ylabel("ratio" if held_metric else "utilization (ratio)")
    axes.set_title(_panel_title(series), loc="left", fontsize="medium", parse_math=False)
    axes.grid(True, alpha=0.3)
    handles, labels = axes.get_legend_handles_labels()
    if series.power_w.has_values:
        power_axes = axes.twinx()
        xs, ys = thin(series.power_w)
        power_axes.plot([x / scale for x in xs], ys, drawstyle="steps-pre", color=_COLOURS["power_w"], lw=0.8,
                        alpha=0.7, label=_LABELS["power_w"], gid="power_w")
        power_axes.set_ylabel("board power (W)")
        power_axes.set_ylim(0.0, max(power_max_w, 1.0) * 1.3)  # one scale for every panel
        # Power behind the utilization lines: the twin axes go below, the main axes' background is cleared.
        power_axes.set_zorder(axes.get_zorder() - 1)
        axes.patch.set_visible(False)
        more_handles, more_labels = power_axes.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
        drawn.append("power_w")
    axes.legend(handles, labels, loc="upper center", fontsize="small", ncols=min(len(labels), 6), frameon=False)
    return drawn
