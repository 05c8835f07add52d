"""What `forge-load hold` accepts and `forge-load holds` lists (docs/holds.md): every hold that `hold` accepted is
listed, whatever its times; a reason is limited in the characters a user types, and a reason too long is one line
naming --reason; an index that does not resolve costs only itself (fail open: the job's other GPUs are held);
a file is never renamed into place short of what was written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from forge_load.commands import hold as hold_command
from forge_load.steering import holds
from forge_load.steering.holds import HOLD_MAX_BYTES, Hold
from tests.test_holds_cli import GPU0, GPU1, run

# --- holds lists every hold, whatever its times -----------------------------------------------------------------

def test_an_until_beyond_what_hold_accepts_is_one_line_naming_until(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["hold", "--gpu", "0", "--holder", "far", "--until", "99999999999999d"], tmp_path, capsys)
    assert code == 2 and not out and len(err) == 1, err
    assert "--until='99999999999999d'" in err[0] and "9999-12-31T23:59:59Z" in err[0]
    assert not list(tmp_path.iterdir())  # nothing written


def test_holds_lists_every_hold_hold_accepted_and_any_time_a_file_holds(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["hold", "--gpu", "0", "--holder", "healthy"], tmp_path, capsys)[0] == 0
    assert run(["hold", "--gpu", "1", "--holder", "longest", "--until", "253402300799"], tmp_path, capsys)[0] == 0
    for holder, since_s, until_s in (("huge", 1e300, 1e300), ("tiny", -1e300, None), ("far", 1.0, 253402300800.0)):
        holds.write_atomic(str(tmp_path), holds.hold_name(GPU1, holder), json.dumps(
            {"format": 1, "gpu": GPU1, "holder": holder, "reason": "by hand", "since_unix_s": since_s,
             "until_unix_s": until_s}).encode())
    code, out, err = run(["holds"], tmp_path, capsys)
    assert code == 0 and not err, err
    assert [line.split()[1] for line in out[1:]] == ["healthy", "far", "huge", "longest", "tiny"]
    huge = next(line for line in out if " huge " in line)
    assert "1e+300" in huge  # a time no calendar shows is shown as the number it is
    code, out, err = run(["holds", "--json"], tmp_path, capsys)
    assert code == 0 and len(out) == 5 and not err


# --- --reason ------------------------------------------------------------------------------------------------

def test_a_long_non_ascii_reason_within_the_limit_is_held(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    reason = "é" * 700
    code, _, err = run(["hold", "--gpu", "0", "--holder", "h", "--reason", reason], tmp_path, capsys)
    assert code == 0 and not err, err
    assert holds.read_holds(str(tmp_path), GPU0, 0.0).holds[0].reason == reason


def test_the_longest_reason_of_the_widest_characters_fits_the_file(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The limit is in characters, and any MAX_REASON_CHARS characters fit a file of HOLD_MAX_BYTES beside the
    longest GPU id, holder and times."""
    mig = "MIG-51a00000-0000-4000-8000-000000000000"
    most = hold_command.MAX_REASON_CHARS
    reason = ("\U0001f600" + '"\\') * (most // 3) + "\U0001f600" * (most % 3)
    assert len(reason) == hold_command.MAX_REASON_CHARS
    code, _, err = run(["hold", "--gpu", mig, "--holder", "h" * 64, "--reason", reason,
                        "--until", "9999-12-31T23:59:59Z"], tmp_path, capsys)
    assert code == 0 and [line for line in err if "no filler" not in line] == [], err  # no filler knows it: said
    (name,) = os.listdir(tmp_path)
    assert (tmp_path / name).stat().st_size <= HOLD_MAX_BYTES
    longest = Hold(mig, "h" * 64, reason, -1.2345678901234567e-300, -1.2345678901234567e-300)
    assert len(holds.hold_to_json(longest)) <= HOLD_MAX_BYTES


@pytest.mark.parametrize("reason", ["é" * (hold_command.MAX_REASON_CHARS + 1), "a\udcffb"])
def test_a_reason_too_long_or_not_text_is_one_line_naming_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                 reason: str) -> None:
    code, out, err = run(["hold", "--gpu", "0", "--holder", "h", "--reason", reason], tmp_path, capsys)
    assert code == 2 and not out and len(err) == 1, err
    assert "--reason=" in err[0] and f"at most {hold_command.MAX_REASON_CHARS} characters" in err[0]
    assert "--hold-dir" not in err[0]
    assert not list(tmp_path.iterdir())


# --- one index that does not resolve -------------------------------------------------------------------------

def test_an_index_that_does_not_resolve_costs_only_itself(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["hold", "--gpu", "0,7,1", "--holder", "job-7"], tmp_path, capsys)
    assert code == 0, err
    assert out == [f"{GPU0} held by job-7", f"{GPU1} held by job-7"]
    assert len(err) == 1 and "--gpu='0,7,1'" in err[0] and "index 7" in err[0] and "not held" in err[0]
    assert sorted(h.gpu_uuid for h in holds.all_holds(str(tmp_path))[0]) == [GPU0, GPU1]


def test_when_no_index_resolves_nothing_is_held_and_it_is_bad_input(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["hold", "--gpu", "7,8", "--holder", "job-7"], tmp_path, capsys)
    assert code == 2 and not out and len(err) == 1 and "--gpu='7,8'" in err[0]
    assert not list(tmp_path.iterdir())


# --- a short write -------------------------------------------------------------------------------------------

def test_a_short_write_is_written_on_until_the_file_is_whole(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = os.write
    calls: list[int] = []

    def short_write(fd: int, data: bytes | memoryview) -> int:  # what a full disk or a signal can make it do
        calls.append(len(data))
        return real_write(fd, bytes(data[:7]))

    monkeypatch.setattr(holds.os, "write", short_write)
    hold = Hold(GPU0, "h", "a reason " * 20, 1.0, None)
    holds.place(str(tmp_path), hold)
    monkeypatch.undo()
    assert len(calls) > 1
    assert (tmp_path / holds.hold_name(GPU0, "h")).read_bytes() == holds.hold_to_json(hold)


def test_a_write_that_writes_nothing_leaves_nothing_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(holds.os, "write", lambda fd, data: 0)
    with pytest.raises(holds.HoldError):
        holds.place(str(tmp_path), Hold(GPU0, "h", "r", 1.0, None))
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []
