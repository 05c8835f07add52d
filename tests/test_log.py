"""forge_load/log.py: text and JSON event lines, the same fields in the same order, escaped onto one line."""

from __future__ import annotations

import io
import json
import shlex

import pytest

from forge_load.log import CORE_FIELDS, EventLog


def emit_both(event: str, static: dict[str, object] | None = None, **fields: object) -> tuple[str, str]:
    """The same event as a text line and as a JSON line."""
    lines = []
    for fmt in ("text", "json"):
        out = io.StringIO()
        EventLog(fmt, out, static=static).emit(event, **dict(fields))
        lines.append(out.getvalue())
    return lines[0], lines[1]


def parse_text(line: str) -> dict[str, str]:
    """logfmt as written: key=value, values with spaces in double quotes."""
    assert line.endswith("\n") and line.count("\n") == 1
    pairs = [token.split("=", 1) for token in shlex.split(line)]
    return {k: v for k, v in pairs}


STATUS = dict(t=12.3456, state="filling", target=0.5, util=0.4987, own=0.4912, foreign=0.0075,
              multiplier=20, gpu_mem_mib=512.25, reason=None, power_w=312.5, extra_flag=True)


def test_text_and_json_have_the_same_fields_in_the_same_order() -> None:
    # Given in a scrambled order, with static fields: both come out core fields first, then the rest.
    scrambled = dict(reversed(list(STATUS.items())))
    text, js = emit_both("status", static={"gpu": 0, "uuid": "GPU-abc"}, **scrambled)
    record = json.loads(js)
    text_fields = parse_text(text)
    # ts: JSON lines only, in the place of key=value lines' time
    assert [k for k in text_fields if k != "time"] == [k for k in record if k != "ts"]
    core = [k for k in CORE_FIELDS if k in record]
    assert list(record)[:len(core)] == core == [k for k in CORE_FIELDS if k != "time"]
    assert list(text_fields)[:len(core)] == [k for k in CORE_FIELDS if k != "ts"]
    assert set(record) == set(STATUS) | {"event", "gpu", "uuid", "ts"}
    assert list(record)[-1] == list(text_fields)[-1] == "uuid"


def test_json_values() -> None:
    _, js = emit_both("status", **STATUS)
    assert js.count("\n") == 1 and js.endswith("\n")
    record = json.loads(js)
    assert record["t"] == 12.346
    assert record["event"] == "status"
    assert record["state"] == "filling"
    assert record["target"] == 0.5
    assert record["util"] == 0.4987
    assert record["multiplier"] == 20
    assert record["reason"] is None
    assert record["extra_flag"] is True


def test_text_values() -> None:
    text, _ = emit_both("status", **STATUS)
    f = parse_text(text)
    assert f["t"] == "12.35"
    assert f["event"] == "status"
    assert f["util"] == "0.499"
    assert f["multiplier"] == "20"
    assert f["gpu_mem_mib"] == "512.2"  # >= 10: one decimal
    assert f["reason"] == "-"
    assert f["extra_flag"] == "true"
    assert text.startswith("t=12.35 event=status time=") and " state=filling target=0.500 " in text


def test_text_quotes_values_with_spaces_quotes_or_equals() -> None:
    reason = 'process 4242 on the GPU; util="0.9"'
    text, js = emit_both("yield", reason=reason, note="a=b", empty="")
    assert ' reason="process 4242 on the GPU; util=\\"0.9\\""' in text
    f = parse_text(text)
    assert f["reason"] == reason
    assert f["note"] == "a=b"
    assert f["empty"] == ""
    assert json.loads(js)["reason"] == reason


def test_text_value_with_spaces_and_a_newline_stays_on_one_line() -> None:
    text, js = emit_both("error", reason="CUDA_ERROR_ILLEGAL_ADDRESS\nan illegal memory access")
    assert js.count("\n") == 1
    assert text.count("\n") == 1
    assert parse_text(text)["reason"] == "CUDA_ERROR_ILLEGAL_ADDRESS\\nan illegal memory access"


@pytest.mark.parametrize("value", ["first\nsecond", "a\tb\r\nc"])
def test_text_value_with_a_bare_newline_stays_on_one_line(value: str) -> None:
    text, _ = emit_both("error", reason=value)
    assert text.count("\n") == 1 and "\r" not in text and "\t" not in text


def test_none_and_non_finite() -> None:
    text, js = emit_both("status", reason=None, util=float("nan"), own=float("inf"))
    record = json.loads(js)
    assert record["reason"] is None
    assert record["util"] is None and record["own"] is None  # strict JSON: no NaN, no Infinity
    assert "NaN" not in js and "Infinity" not in js
    assert parse_text(text)["reason"] == "-"


def test_time_from_the_clock_relative_to_start() -> None:
    out = io.StringIO()
    now = [105.25]
    log = EventLog("json", out, clock=lambda: now[0], start_s=100.0)
    log.emit("resume")
    now[0] = 107.5
    record = log.emit("status", util=0.5)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["t"] for line in lines] == [5.25, 7.5]
    assert record["t"] == 7.5
    out2 = io.StringIO()
    EventLog("json", out2, clock=lambda: 1e9, start_s=0.0).emit("x", t=3.0)  # an explicit t wins
    assert json.loads(out2.getvalue())["t"] == 3.0


def test_no_clock_no_time() -> None:
    text, js = emit_both("start")
    assert json.loads(js)["t"] is None
    assert parse_text(text)["t"] == "-"


def test_every_json_line_parses() -> None:
    out = io.StringIO()
    log = EventLog("json", out, static={"gpu": 1})
    for k, event in enumerate(["start", "status", "yield", "resume", "boost", "stop"]):
        log.emit(event, t=float(k), reason=f"reason {k} with \"quotes\" and = signs", util=k / 7)
    lines = out.getvalue().splitlines()
    assert len(lines) == 6
    records = [json.loads(line) for line in lines]
    assert [r["event"] for r in records] == ["start", "status", "yield", "resume", "boost", "stop"]
    assert all(r["gpu"] == 1 for r in records)


def test_a_mig_note_reads_as_written_in_a_text_line() -> None:
    from forge_load.gpu.backend import MIG_GPM_NOTE, MIG_NOTE

    for note in (MIG_NOTE, MIG_GPM_NOTE):
        text, _ = emit_both("mig", note=note)
        assert "\\u" not in text and note in text


def test_no_text_the_code_writes_is_escaped_in_a_text_line() -> None:
    # A text value beyond ASCII is written escaped (\u00a7 for a section sign), so a line the code writes itself
    # (a note, a reason, an error) must be ASCII to read as written; its docstrings and comments may be anything.
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "forge_load"
    found = []
    for path in sorted(root.rglob("*.py")):
        if "podresources" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        found += [f"{path.relative_to(root)}:{node.lineno}: {node.value[:60]!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and not node.value.isascii()
                  and id(node) not in docstrings]
    assert found == []
