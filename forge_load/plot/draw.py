"""A run's series drawn with matplotlib, imported here only, inside draw(): the filler and every other command
run without it (it is the optional extra `forge-load[plot]`).

One panel per GPU: the target (a step), NVML's utilization, our own share and the foreign share as logged on the
status lines (each the mean of the interval that ends at its point, so drawn as steps that end there), the
yielding, paused and held spans shaded, and board power on a second axis where the log has it. Every artist has
an SVG id (`gid`) named after its series, so a test or a script can find the series in the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from forge_load.plot.logs import SPAN_STATES, Run, Series

SUFFIXES = (".png", ".svg")
_COLOURS = {"target": "black", "util": "tab:blue", "own": "tab:green", "foreign": "tab:red", "power_w": "tab:purple",
            "yielding": "tab:red", "paused": "tab:gray", "held": "tab:orange"}
_LABELS = {"target": "target", "util": "NVML utilization", "own": "own share", "foreign": "foreign share",
           "power_w": "power (W)", "yielding": "yielding", "paused": "paused", "held": "held"}
_PANEL_HEIGHT_IN = 3.2
_MAX_PANELS = 16  # a host's GPUs; beyond that the picture is unreadable anyway


class MissingExtra(Exception):
    """matplotlib is not installed."""


def drawable(run: Run) -> list[Series]:
    """The GPUs with something to draw (the process's own error lines carry no GPU and no numbers)."""
    return [s for s in run.gpus.values() if s.target or s.util or s.spans or s.power_w][:_MAX_PANELS]


def _xy(points: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    return [p[0] for p in points], [p[1] for p in points]


def draw(run: Run, out: Path, title: str = "") -> list[str]:
    """Draws `run` into `out` (PNG or SVG by its suffix); returns the series drawn, as "gpu:name"."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
    except ImportError as error:
        raise MissingExtra(str(error)) from None
    panels = drawable(run)
    figure = Figure(figsize=(10.0, 1.0 + _PANEL_HEIGHT_IN * len(panels)), layout="constrained")
    axes_list: list[Any] = list(figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0])
    drawn: list[str] = []
    for axes, series in zip(axes_list, panels):
        drawn += [f"{series.gpu}:{name}" for name in _panel(axes, series)]
    axes_list[-1].set_xlabel("t (s since start)")
    if title:
        figure.suptitle(title)
    figure.savefig(out, dpi=100, metadata=_metadata(out))
    return drawn


def _metadata(out: Path) -> dict[str, Any]:
    # No date in the file: the same log draws the same bytes (the README's picture is checked into git).
    return {"Date": None} if out.suffix.lower() == ".svg" else {"Software": "forge-load plot"}


def _panel(axes: Any, series: Series) -> list[str]:
    drawn: list[str] = []
    seen_states: set[str] = set()
    for state, begin_t, end_t in series.spans:
        label = _LABELS[state] if state not in seen_states else None
        seen_states.add(state)
        axes.axvspan(begin_t, end_t, color=_COLOURS[state], alpha=0.15, lw=0, label=label, gid=f"span-{state}")
    drawn += [f"span-{state}" for state in SPAN_STATES if state in seen_states]
    for restart_t in series.restarts_t:
        axes.axvline(restart_t, color="black", ls=":", lw=1, gid="restart")
    for name, width in (("util", 3.0), ("own", 1.2), ("foreign", 1.2)):  # NVML's under the shares it splits into
        points = getattr(series, name)
        if points:
            xs, ys = _xy(points)
            axes.step(xs, ys, where="pre", color=_COLOURS[name], lw=width, alpha=0.45 if name == "util" else 1.0,
                      label=_LABELS[name], gid=name)
            drawn.append(name)
    if series.target:
        xs, ys = _xy(series.target + [(series.end_t, series.target[-1][1])])
        axes.step(xs, ys, where="post", color=_COLOURS["target"], lw=1, ls="--", label=_LABELS["target"], gid="target")
        drawn.append("target")
    axes.set_ylim(0.0, 1.3)  # the headroom above 1 holds the legend, clear of the lines
    axes.set_yticks([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    axes.set_ylabel("utilization (ratio)")
    axes.set_title(f"GPU {series.gpu}", loc="left", fontsize="medium")
    axes.grid(True, alpha=0.3)
    handles, labels = axes.get_legend_handles_labels()
    if series.power_w:
        power_axes = axes.twinx()
        xs, ys = _xy(series.power_w)
        power_axes.plot(xs, ys, color=_COLOURS["power_w"], lw=0.8, alpha=0.7, label=_LABELS["power_w"], gid="power_w")
        power_axes.set_ylabel("board power (W)")
        power_axes.set_ylim(0.0, max(ys) * 1.3)
        # Power behind the utilization lines: the twin axes go below, the main axes' background is cleared.
        power_axes.set_zorder(axes.get_zorder() - 1)
        axes.patch.set_visible(False)
        more_handles, more_labels = power_axes.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
        drawn.append("power_w")
    axes.legend(handles, labels, loc="upper center", fontsize="small", ncols=len(labels), frameon=False)
    return drawn
