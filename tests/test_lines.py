"""forge_load.control.lines: LineGate writes a filler's lines, the kinds a storm can repeat at most once a second."""

from __future__ import annotations

import io
import json

from forge_load.control.lines import LINES_EVERY_S, LineGate
from forge_load.log import EventLog

START_S = 100.0


class Gate:
    """A LineGate on a JSON EventLog, and the lines written so far."""

    def __init__(self) -> None:
        self.out = io.StringIO()
        self.gate = LineGate(EventLog("json", self.out), START_S)

    def emit(self, t_s: float, event: str, **fields: object) -> None:
        self.gate.emit(START_S + t_s, event, dict(fields))

    def lines(self) -> list[dict[str, object]]:
        return [json.loads(line) for line in self.out.getvalue().splitlines()]

    def said(self) -> list[tuple[object, object, object]]:
        """(event, t, coalesced) of every line written."""
        return [(e["event"], e["t"], e.get("coalesced")) for e in self.lines()]


def test_a_line_of_no_coalesced_kind_is_written_at_once_each_time() -> None:
    g = Gate()
    for t_s in (0.0, 0.1, 0.2):
        g.emit(t_s, "status", state="filling")
    assert g.said() == [("status", 0.0, None), ("status", 0.1, None), ("status", 0.2, None)]
    assert g.lines()[0]["state"] == "filling"
    assert g.gate.due_s == float("inf")


def test_a_second_line_of_a_kind_within_the_second_waits_and_the_latest_stands_for_the_rest() -> None:
    g = Gate()
    g.emit(1.0, "pause", reason="SIGUSR1")
    g.emit(1.2, "unpause", reason="SIGUSR2")  # pause and unpause are one kind
    g.emit(1.4, "pause", reason="SIGUSR1 again")
    assert g.said() == [("pause", 1.0, None)]
    assert g.gate.due_s == START_S + 1.0 + LINES_EVERY_S
    g.gate.flush(START_S + 2.0)
    assert g.said() == [("pause", 1.0, None), ("pause", 1.4, 1)]  # its own time, and one change without a line
    assert g.lines()[-1]["reason"] == "SIGUSR1 again"
    assert g.gate.due_s == float("inf")


def test_a_line_held_alone_says_no_coalesced() -> None:
    g = Gate()
    g.emit(0.0, "drained")
    g.emit(0.5, "drained")
    g.gate.flush(START_S + 1.0)
    assert g.said() == [("drained", 0.0, None), ("drained", 0.5, None)]


def test_every_held_line_goes_before_the_next_line_in_the_order_they_came() -> None:
    g = Gate()
    for event in ("power_capped", "pause", "drained"):
        g.emit(0.0, event)
    g.emit(0.3, "drained")
    g.emit(0.4, "power_capped")
    g.emit(0.5, "unpause")
    g.emit(0.6, "status")  # not held: what was held is written first
    assert [e for e, _t, _c in g.said()] == ["power_capped", "pause", "drained", "drained", "power_capped", "unpause",
                                             "status"]
    assert [t for _e, t, _c in g.said()][3:] == [0.3, 0.4, 0.5, 0.6]


def test_the_second_counts_from_when_a_held_line_was_written() -> None:
    g = Gate()
    g.emit(0.0, "pause")
    g.emit(0.5, "unpause")
    g.gate.flush(START_S + 1.0)  # the unpause is written at 1.0: the next pause waits until 2.0
    g.emit(1.5, "pause")
    assert g.gate.due_s == START_S + 2.0
    assert g.said() == [("pause", 0.0, None), ("unpause", 0.5, None)]
    g.emit(2.5, "unpause")  # a second after the last line written, yet one is held: it replaces it
    assert g.said() == [("pause", 0.0, None), ("unpause", 0.5, None)]
    g.gate.flush(START_S + 2.5)
    assert g.said()[-1] == ("unpause", 2.5, 1)


def test_kinds_wait_apart_and_a_flush_with_nothing_held_writes_nothing() -> None:
    g = Gate()
    g.emit(0.0, "pause")
    g.emit(0.2, "power_capped")  # another kind: its own second
    g.emit(0.4, "power_capped")
    assert g.gate.due_s == START_S + 0.2 + LINES_EVERY_S
    g.gate.flush(START_S + 1.2)
    g.gate.flush(START_S + 1.3)
    assert g.said() == [("pause", 0.0, None), ("power_capped", 0.2, None), ("power_capped", 0.4, None)]
