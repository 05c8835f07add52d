"""One GPU's run as the plot draws it, for plot/logs.py: curves of (t, value) points in compact arrays, the spans
in which nothing of ours ran, restarts and an exclusive-mode supervisor's children followed on one timeline. Pure:
no matplotlib, no GPU library.

A number no filler writes (not finite, not a number, or beyond any GPU's range) makes its line Impossible: a log
is input, and may be corrupt.
"""

from __future__ import annotations

import itertools
import math
import operator
from array import array
from collections.abc import Iterator
from typing import TYPE_CHECKING

from forge_load.plot.lines import text

if TYPE_CHECKING:
    from forge_load.plot.lines import Shape

# The states in which the filler runs nothing of its own, each drawn as a span (control/policy.py's names).
SPAN_STATES = ("yielding", "paused", "held")
SHARES = ("util", "own", "foreign")  # NVML's utilization and its split: each status line's mean over its interval
# The held metrics other than NVML's utilization: each status line has `<name>` and its own share `<name>_own`.
HELD_METRICS = ("sm_activity", "gr_activity")
METRIC_FIELDS = tuple(name for metric in HELD_METRICS for name in (metric, f"{metric}_own"))
# What a number of each kind can be; beyond it the line is corrupt (a ratio a little outside [0, 1] is noise).
_T_MAX_S = 1e9
_RATIO_LOW, _RATIO_HIGH = -1.0, 10.0
_POWER_MAX_W = 1e5

class Impossible(ValueError):
    """A number no filler writes: not finite, not a number, or beyond its kind's range."""


def _number(value: object, low: float, high: float) -> float | None:
    """A field as a float: JSON gives numbers, key=value text; `-` and null are None (nothing known)."""
    if value is None or value == "-" or value == "null":
        return None
    if value is True or value is False:
        raise Impossible(value)
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        raise Impossible(value) from None
    if low <= number <= high:  # NaN fails too
        return number
    raise Impossible(value)


class Curve:
    """One series as (t seconds, value) points in compact arrays. A NaN value is a gap: nothing known from the
    point before it up to its t (drawn as steps that end at each point, it leaves that stretch empty)."""

    __slots__ = ("t", "v", "gaps", "has_values")

    def __init__(self) -> None:
        self.t = array("d")
        self.v = array("d")
        self.gaps: list[int] = []  # where the NaN points are, in order (few: one a run, or a `-` in a while)
        self.has_values = False

    def add(self, t: float, value: float) -> None:
        self.t.append(t)
        self.v.append(value)
        self.has_values = True

    def gap(self, t: float) -> None:
        """Nothing known up to t: one NaN point, moved on while nothing more is known."""
        if self.v and math.isnan(self.v[-1]):
            self.t[-1] = t
        else:
            self.gaps.append(len(self.t))
            self.t.append(t)
            self.v.append(math.nan)

    def extend(self, t: array[float], values: array[float]) -> None:
        self.t.extend(t)
        self.v.extend(values)
        self.has_values = self.has_values or len(values) > 0

    def points(self) -> list[tuple[float, float]]:
        return list(zip(self.t, self.v))

    def __len__(self) -> int:
        return len(self.t)


class Series:
    """One GPU's (or MIG device's) run: target, shares, power and the held metric as curves, the spans in which
    nothing of ours ran; runs after a restart follow on, offset. `key` names its panel: the GPU's index, or a MIG
    device's UUID (its `gpu` is its GPU's index, shared with its siblings)."""

    def __init__(self, key: str, gpu: str) -> None:
        self.key = key
        self.gpu = gpu
        self.uuid = key if key.startswith("MIG-") else ""
        self.gpu_uuid = ""  # a MIG device's GPU
        self.mig_profile = ""
        self.gpu_instance = ""
        self.metric = ""  # the start line's: what the target is a target of
        self.target = Curve()  # kept where it changes; holds from each point on
        self.util, self.own, self.foreign, self.power_w = Curve(), Curve(), Curve(), Curve()
        self.metric_curves: dict[str, Curve] = {}  # METRIC_FIELDS that the log has
        self._end_curves = {"util": self.util, "own": self.own, "foreign": self.foreign}  # and the metric's
        self._target_token: object = None  # the target as the last line wrote it (add_status compares it)
        self._rows: list[tuple[str, ...]] = []  # status lines taken by add_status, not yet read (flush)
        self._plan: StatusPlan | None = None  # their shape's
        self.impossible_lines = 0  # of those, lines with an impossible number
        self.span_kind = array("b")  # SPAN_STATES' index, begin and end of every span
        self.span_begin_t = array("d")
        self.span_end_t = array("d")
        self._restarts_t = array("d")  # where a later run's start line continues the plot
        self.end_t = 0.0
        self._offset_s = 0.0
        self._last_t = -math.inf
        self._run_begin_t = 0.0
        self._state: str | None = None
        self._state_since_t = 0.0
        # Exclusive compute mode: a supervisor's lines (no state of their own) and its children's, on one timeline.
        self._supervised = False
        self._child_running = False
        self._holders = 0

    @property
    def spans(self) -> list[tuple[str, float, float]]:
        """(state, begin t, end t) for every span in SPAN_STATES."""
        return [(SPAN_STATES[k], b, e) for k, b, e in zip(self.span_kind, self.span_begin_t, self.span_end_t)]

    @property
    def restarts_t(self) -> list[float]:
        return list(self._restarts_t)

    def curves(self) -> Iterator[tuple[str, Curve]]:
        """Every curve drawn as steps that end at their points: the shares, the held metric's, power."""
        yield "util", self.util
        yield "own", self.own
        yield "foreign", self.foreign
        yield from self.metric_curves.items()
        yield "power_w", self.power_w

    def drawable(self) -> bool:
        return len(self.target) > 0 or len(self.span_kind) > 0 or any(c.has_values for _, c in self.curves())

    def add(self, record: dict[str, object]) -> None:
        """One line of this GPU's; Impossible (and nothing changed) when a number in it is."""
        if self._rows:
            self.flush()  # the status lines before it first
        get = record.get
        t = _number(get("t"), 0.0, _T_MAX_S)
        if t is None:
            return
        event = get("event")
        target = _number(get("target"), _RATIO_LOW, _RATIO_HIGH)
        power = _number(get("power_w"), 0.0, _POWER_MAX_W)
        if event == "status" or event == "stop":  # a status line's means, or a stop line's latest (the last interval)
            ends = [(name, _number(raw, _RATIO_LOW, _RATIO_HIGH)) for name in _END_FIELDS
                    if (raw := get(name, _ABSENT)) is not _ABSENT]
        else:
            ends = []
        if event == "start" or event == "exclusive":
            self._details(record)
            t = self._begin(t, event, record)
        else:
            if event == "settings":
                self._details(record)
            t = t + self._offset_s
            if t < self._last_t:  # a run's lines are in order: a clock step back is not drawn as a loop
                t = self._last_t
        self._last_t = self.end_t = t
        state = get("state")
        if self._supervised or state != self._state:
            self._follow_state(t, event, record, state)
        if target is not None:
            self._target_token = get("target")
            if not self.target.v or self.target.v[-1] != target:
                self.target.add(t, target)
        curves = self._end_curves
        for name, value in ends:
            curve = curves.get(name) or self._new_curve(name)
            if value is None:
                curve.gap(t)
            else:
                curve.t.append(t)
                curve.v.append(value)
                curve.has_values = True
        if power is not None:
            curve = self.power_w
            curve.t.append(t)
            curve.v.append(power)
            curve.has_values = True

    def add_status(self, groups: tuple[str, ...], plan: StatusPlan) -> bool:
        """A status line read by its shape (lines.Shape), the common case: True when taken, its numbers read with
        the others of its batch (flush()); False, having changed nothing, for add() to read it (a change of state
        or target, a curve not begun, a line of a supervisor's not running a child)."""
        state = groups[plan.state][1:-1] if plan.quoted else groups[plan.state]
        if (state != self._state or groups[plan.event] != plan.status
                or (plan.target >= 0 and groups[plan.target] != self._target_token)
                or (self._supervised and not self._child_running)):
            return False
        if plan is not self._plan:
            if not plan.end_names <= self._end_curves.keys():
                return False
            self.flush()
            self._plan = plan
        self._rows.append(groups)
        if len(self._rows) >= _BATCH_LINES:
            self.flush()
        return True

    def flush(self) -> None:
        """The status lines taken by add_status() and not yet read: their numbers read a column at a time (in C),
        or, where one is out of the ordinary (a `-`, a number out of range), each line by add()."""
        rows, plan = self._rows, self._plan
        if not rows or plan is None:
            return
        self._rows = []
        try:
            t_column = _column(rows, plan.t, 0.0, _T_MAX_S)
            columns = [_column(rows, index, _RATIO_LOW, _RATIO_HIGH) for _, index in plan.ends]
            power = _column(rows, plan.power, 0.0, _POWER_MAX_W) if plan.power >= 0 else None
        except ValueError:
            for groups in rows:
                try:
                    self.add(plan.record(groups))
                except Impossible:
                    self.impossible_lines += 1
            return
        offset_s = self._offset_s
        # in order, as add() keeps them: a clock step back is not drawn as a loop
        t_column = array("d", itertools.accumulate(map(offset_s.__add__, t_column), max, initial=self._last_t))
        del t_column[0]
        self._last_t = self.end_t = t_column[-1]
        curves = self._end_curves
        for (name, _), column in zip(plan.ends, columns):
            curves[name].extend(t_column, column)
        if power is not None:
            self.power_w.extend(t_column, power)

    def _new_curve(self, name: str) -> Curve:
        """A held metric's curve, at its first field: nothing known before it in this run."""
        curve = self._end_curves[name] = self.metric_curves[name] = Curve()
        curve.gap(self._run_begin_t)
        return curve

    def _details(self, record: dict[str, object]) -> None:
        for name in ("metric", "uuid", "gpu_uuid", "mig_profile", "gpu_instance"):
            value = text(record.get(name))
            if isinstance(value, (str, int)) and not isinstance(value, bool):
                setattr(self, name, str(value)[:200])

    def _begin(self, t: float, event: object, record: dict[str, object]) -> float:
        """A start line (a filler's, or an exclusive-mode child's) or a supervisor's first line: where a run begins."""
        child = (event == "start" and self._supervised and self._child_running
                 and t + self._offset_s >= self._last_t - _CHILD_LAG_S)
        if not child and self._last_t > -math.inf and (event == "start" or t + self._offset_s < self._last_t):
            # A restarted filler (docker logs keeps every run): its t begins at 0 again; draw it after the last.
            self._close_state(self._last_t)
            self._state = None
            self._offset_s = self._last_t
            self._restarts_t.append(self._offset_s)
            self._child_running = False
            self._holders = 0
        t = max(t + self._offset_s, self._last_t)
        if event == "exclusive":
            self._supervised = True
            self._close_state(t)  # no hold directory: nothing is filled until it appears (a later line says so)
            self._state = "paused" if record.get("filling") in (False, "false") else None
        elif not child:
            self._supervised = False
        self._run_begin_t = t
        for _, curve in self.curves():
            curve.gap(t)
        return t

    def _follow_state(self, t: float, event: object, record: dict[str, object], state: object) -> None:
        if self._supervised:
            state = self._supervised_state(event, record, state)
        if isinstance(state, str) and state != self._state:
            self._close_state(t)
            self._state, self._state_since_t = state, t
        elif state is _NOT_HELD and self._state == "held":
            self._close_state(t)
            self._state = None

    def _supervised_state(self, event: object, record: dict[str, object], state: object) -> object:
        """The state a supervisor's line means (its lines carry none), or a child's line's own state while the
        child runs; a child's lines after it was told to end (its stop) say nothing of the GPU's state."""
        count = str(record.get("count", "1"))
        holders = int(count) if count.isdigit() and len(count) < 7 else 1
        if event == "child_start":
            self._child_running = True
        elif event == "child_end" or (event == "drained" and "child_pid" in record):  # told to end, or gone
            self._child_running = False
            reason = str(text(record.get("reason", "")))
            if event == "child_end":
                for prefix, meant in (("held by", "held"), ("paused", "paused"), ("foreign job", "yielding"),
                                      ("no foreign job", "yielding")):
                    if reason.startswith(prefix):
                        return meant
        elif event == "hold" and state is None:
            self._holders += holders
            return "held"
        elif event == "release" and state is None:
            self._holders = max(self._holders - holders, 0)
            return _NOT_HELD if self._holders == 0 else None
        return state if self._child_running else None

    def finish(self) -> None:
        self.flush()
        self._close_state(self.end_t)
        self._state = None

    def _close_state(self, t: float) -> None:
        if self._state in SPAN_STATES and t > self._state_since_t:
            self.span_kind.append(SPAN_STATES.index(self._state))
            self.span_begin_t.append(self._state_since_t)
            self.span_end_t.append(t)
        self._state_since_t = t


_ABSENT = object()
_END_FIELDS = SHARES + METRIC_FIELDS
_NOT_HELD = object()  # a supervisor's last release: the held span ends, and no other state begins
# An exclusive-mode child's start line comes after its supervisor's child_start line; lines of the two processes
# may pass each other by a little. A start line further back than this is a new filler's (a restart).
_CHILD_LAG_S = 5.0


_BATCH_LINES = 4096  # status lines read at once by flush()


def _column(rows: list[tuple[str, ...]], index: int, low: float, high: float) -> array[float]:
    """One field of every row as numbers, all from `low` to `high`; ValueError for any other (`-` included)."""
    column = array("d", map(float, map(operator.itemgetter(index), rows)))
    if any(map(math.isnan, column)) or min(column) < low or max(column) > high:
        raise ValueError("out of range")
    return column


# Fields no status line has: a shape with one of them is read by add() alone.
_NOT_STATUS = ("reason", "count", "child_pid", "filling", "metric", "gpu_uuid", "mig_profile", "gpu_instance")


class StatusPlan:
    """Where the fields add_status() reads are in the groups of one shape of status line."""

    def __init__(self, shape: Shape) -> None:
        index = shape.index
        self.t, self.event, self.state = index["t"], index["event"], index["state"]
        self.target = index.get("target", -1)
        self.power = index.get("power_w", -1)
        self.ends = tuple((name, index[name]) for name in _END_FIELDS if name in index)
        self.end_names = frozenset(name for name, _ in self.ends)
        self.quoted = shape.is_json  # a JSON shape's strings are in their quotes
        self.status = '"status"' if shape.is_json else "status"
        self.names = shape.names
        self.pattern = shape.pattern
        # what names the line's series: its GPU's index and UUID as written (the series of a MIG device is its UUID's)
        self.key = operator.itemgetter(index["gpu"], index.get("uuid", index["gpu"]))

    def record(self, groups: tuple[str, ...]) -> dict[str, object]:
        """A line's fields, as LineReader gives them."""
        if self.quoted:
            return {name: None if raw == "null" else raw[1:-1] if raw[:1] == '"' else raw
                    for name, raw in zip(self.names, groups)}
        return dict(zip(self.names, groups))


def status_plan(shape: Shape) -> StatusPlan | None:
    """The shape's plan (made once, kept on the shape), or None for a shape that is no status line's."""
    if shape.plan is None:
        index = shape.index
        usable = all(name in index for name in ("t", "event", "state", "gpu")) and not any(
            name in index for name in _NOT_STATUS)
        shape.plan = StatusPlan(shape) if usable else False
    return shape.plan or None  # type: ignore[return-value]
