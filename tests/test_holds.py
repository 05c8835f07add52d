"""forge_load.steering.holds: the on-disk format, safe reads, expiry and the idle age-out (no clock read)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from forge_load.steering import acks, hold_watch, holds
from forge_load.steering.hold_watch import HoldWatch
from forge_load.steering.holds import Ack, Hold

GPU0 = "GPU-51a00000-0000-4000-8000-000000000000"
GPU1 = "GPU-51a00000-0000-4000-8000-000000000001"


def _hold(holder: str = "slurm-42", gpu: str = GPU0, reason: str = "Slurm job 42", since: float = 100.0,
          until: float | None = None) -> Hold:
    return Hold(gpu, holder, reason, since, until)


def test_place_writes_format_1_atomically_and_read_holds_honours_it(tmp_path: Path) -> None:
    holds.place(str(tmp_path), _hold())
    path = tmp_path / f"hold.{GPU0}.slurm-42.json"
    assert json.loads(path.read_text()) == {"format": 1, "gpu": GPU0, "holder": "slurm-42", "reason": "Slurm job 42",
                                            "since_unix_s": 100.0, "until_unix_s": None}
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    view = holds.read_holds(str(tmp_path), GPU0, now_unix_s=200.0)
    assert view.holds == (_hold(),) and view.held and not view.problems
    assert not holds.read_holds(str(tmp_path), GPU1, now_unix_s=200.0).held


def test_a_refresh_keeps_since_and_takes_the_new_reason_and_until(tmp_path: Path) -> None:
    holds.place(str(tmp_path), _hold(since=100.0))
    written = holds.place(str(tmp_path), _hold(reason="again", since=150.0, until=500.0))
    assert written == _hold(reason="again", since=100.0, until=500.0)
    assert holds.read_holds(str(tmp_path), GPU0, 200.0).holds == (written,)


def test_release_removes_and_says_whether_there_was_one(tmp_path: Path) -> None:
    holds.place(str(tmp_path), _hold())
    assert holds.release(str(tmp_path), GPU0, "slurm-42") is True
    assert holds.release(str(tmp_path), GPU0, "slurm-42") is False
    assert not holds.read_holds(str(tmp_path), GPU0, 200.0).held


def test_an_expired_hold_is_not_honoured(tmp_path: Path) -> None:
    holds.place(str(tmp_path), _hold(until=300.0))
    assert holds.read_holds(str(tmp_path), GPU0, 299.9).held
    view = holds.read_holds(str(tmp_path), GPU0, 300.0)
    assert not view.held and view.expired == (_hold(until=300.0),)


@pytest.mark.parametrize("name", ["hold.GPU-1.a.json", f"hold.{GPU0}..json", f"hold.{GPU0}.-x.json",
                                  f"hold.{GPU0}.{'a' * 65}.json", "notes.txt"])
def test_names_that_do_not_parse_are_ignored_with_a_line(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_text("{}")
    view = holds.read_holds(str(tmp_path), GPU0, 0.0)
    assert not view.held and len(view.problems) == 1 and name in view.problems[0]


def test_dot_files_and_acknowledgements_are_never_holds_nor_problems(tmp_path: Path) -> None:
    (tmp_path / f".hold.{GPU0}.x.json.12.tmp").write_text("{}")
    acks.write_ack(str(tmp_path), Ack(GPU0, 1, "held", ("x",), True, 5.0))
    view = holds.read_holds(str(tmp_path), GPU0, 0.0)
    assert view == holds.HoldsView()


def _bad(tmp_path: Path, kind: str) -> str:
    path = tmp_path / f"hold.{GPU0}.bad.json"
    good = holds.hold_to_json(_hold("bad"))
    if kind == "link":
        target = tmp_path.parent / f"{tmp_path.name}-elsewhere"
        target.write_bytes(good)
        path.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "big":
        path.write_bytes(good[:-1] + b"," + b" " * 4096 + b"}")
    elif kind == "json":
        path.write_text("{not json")
    elif kind == "format":
        path.write_text(json.dumps({**json.loads(good), "format": 2}))
    elif kind == "other_gpu":
        path.write_text(json.dumps({**json.loads(good), "gpu": GPU1}))
    elif kind == "types":
        path.write_text(json.dumps({**json.loads(good), "since_unix_s": "yesterday"}))
    elif kind == "dir":
        path.mkdir()
    return str(path)


@pytest.mark.parametrize(("kind", "says"), [
    ("link", "symbolic link"), ("fifo", "not a regular file"), ("big", "larger than 4096 bytes"),
    ("json", "not JSON"), ("format", "format 2, this forge-load reads format 1"), ("other_gpu", "another GPU"),
    ("types", "lacks"), ("dir", "not a regular file")])
def test_what_is_not_a_readable_hold_is_ignored_with_a_line_and_never_blocks(tmp_path: Path, kind: str,
                                                                             says: str) -> None:
    path = _bad(tmp_path, kind)
    holds.place(str(tmp_path), _hold("good"))
    view = holds.read_holds(str(tmp_path), GPU0, 0.0)
    assert [h.holder for h in view.holds] == ["good"]
    assert len(view.problems) == 1 and path in view.problems[0] and says in view.problems[0], view.problems


def test_more_than_max_holds_on_a_gpu_holds_it_fail_safe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(holds, "MAX_HOLDS", 3)
    for k in range(4):
        (tmp_path / f"hold.{GPU0}.h{k}.json").write_text("garbage: never opened")
    view = holds.read_holds(str(tmp_path), GPU0, 0.0)
    assert view.held and view.fail_safe is not None and "more than 3 holds" in view.problems[0]
    assert not holds.read_holds(str(tmp_path), GPU1, 0.0).held


def test_a_directory_too_long_to_read_holds_every_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(holds, "MAX_ENTRIES", 5)  # names read: holds (and fillers' directories)
    for k in range(6):
        (tmp_path / holds.hold_name(GPU0, f"h{k}")).write_text("never opened")
    view = holds.read_holds(str(tmp_path), GPU1, 0.0)
    assert view.fail_safe is not None and "more than 5 holds" in view.fail_safe
    monkeypatch.setattr(holds, "MAX_ENTRIES", 4096)
    monkeypatch.setattr(holds, "MAX_SCAN", 5)  # entries listed, of any kind
    view = holds.read_holds(str(tmp_path), GPU1, 0.0)
    assert view.fail_safe is not None and "more than 5 entries" in view.fail_safe


def test_a_missing_directory_holds_nothing(tmp_path: Path) -> None:
    assert holds.read_holds(str(tmp_path / "none"), GPU0, 0.0) == holds.HoldsView()


def test_ack_round_trip_and_what_hold_wait_accepts(tmp_path: Path) -> None:
    assert acks.read_ack(str(tmp_path), GPU0) is None
    ack = Ack(GPU0, 123, "held", ("slurm-42",), True, 1000.0)
    acks.write_ack(str(tmp_path), ack)
    assert acks.read_ack(str(tmp_path), GPU0) == ack
    assert acks.acknowledged(ack, "slurm-42", placed_unix_s=999.0, now_unix_s=1000.5)
    assert not acks.acknowledged(ack, "slurm-42", placed_unix_s=1000.1, now_unix_s=1000.5)  # said before the hold
    assert not acks.acknowledged(ack, "other", placed_unix_s=999.0, now_unix_s=1000.5)
    assert not acks.acknowledged(Ack(GPU0, 1, "held", ("slurm-42",), False, 1000.0), "slurm-42", 999.0, 1000.5)
    assert acks.acknowledged(ack, "other", placed_unix_s=999.0, now_unix_s=1003.1)  # no live filler: fail open
    assert acks.acknowledged(None, "other", placed_unix_s=999.0, now_unix_s=0.0)


def test_all_holds_lists_every_gpu(tmp_path: Path) -> None:
    holds.place(str(tmp_path), _hold("b", GPU1))
    holds.place(str(tmp_path), _hold("a", GPU0, until=1.0))
    found, problems = holds.all_holds(str(tmp_path))
    assert [(h.gpu_uuid, h.holder) for h in found] == [(GPU0, "a"), (GPU1, "b")] and not problems


# --- the filler's watch ------------------------------------------------------------------------------------

def test_watch_says_hold_and_release_once_each_with_why(tmp_path: Path) -> None:
    watch = HoldWatch(str(tmp_path), GPU0, idle_age_out_s=0)
    assert watch.check(0.0, 1000.0) == ([], [])
    holds.place(str(tmp_path), _hold("a", until=1005.0))
    holds.place(str(tmp_path), _hold("b"))
    changes, _ = watch.check(0.1, 1000.1)
    assert [(c.event, c.holder, c.reason) for c in changes] == [("hold", "a", "Slurm job 42"),
                                                                ("hold", "b", "Slurm job 42")]
    assert watch.check(0.2, 1000.2) == ([], []) and watch.holders == ("a", "b")
    changes, _ = watch.check(5.0, 1005.0)  # a's until passed (no change on disk)
    assert [(c.event, c.holder, c.reason) for c in changes] == [("release", "a", "expired")]
    holds.release(str(tmp_path), GPU0, "b")
    changes, _ = watch.check(5.1, 1005.1)
    assert [(c.event, c.holder, c.reason) for c in changes] == [("release", "b", "released")]
    assert not watch.held


def test_watch_reads_the_directory_only_when_it_changed_or_once_a_second(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[str] = []
    real = holds.read_holds
    monkeypatch.setattr(holds, "read_holds", lambda *a, **k: reads.append("r") or real(*a, **k))
    watch = HoldWatch(str(tmp_path), GPU0)
    for k in range(10):
        watch.check(k * 0.1, 1000.0)
    assert len(reads) == 1
    holds.place(str(tmp_path), _hold())
    os.utime(tmp_path, ns=(1, 1))  # the directory's mtime moved (to anything else)
    changes, _ = watch.check(0.95, 1000.0)
    assert len(reads) == 2 and [c.event for c in changes] == ["hold"]
    watch.check(1.96, 1000.0)
    assert len(reads) == 3


def test_watch_says_each_problem_once(tmp_path: Path) -> None:
    (tmp_path / "stray").write_text("")
    watch = HoldWatch(str(tmp_path), GPU0)
    assert len(watch.check(0.0, 0.0)[1]) == 1
    assert watch.check(1.5, 0.0)[1] == []


def test_a_hold_over_an_idle_gpu_ages_out_and_a_busy_one_does_not(tmp_path: Path) -> None:
    holds.place(str(tmp_path), _hold("dead"))
    watch = HoldWatch(str(tmp_path), GPU0, idle_age_out_s=3600.0)
    assert [c.event for c in watch.check(0.0, 0.0)[0]] == ["hold"]
    for t in range(60, 3600 * 48, 60):  # two days of training: foreign work all along
        watch.foreign_seen(t - 30.0)
        assert watch.check(float(t), 0.0) == ([], [])
    start = 3600.0 * 48 - 90.0  # the job's last foreign work (t - 30 for the last t)
    assert watch.check(start + 3599.0, 0.0) == ([], [])
    changes, _ = watch.check(start + 3600.0, 0.0)
    assert [(c.event, c.holder, c.reason) for c in changes] == [("release", "dead", "aged out")]
    assert not watch.held and watch.check(start + 7200.0, 0.0) == ([], [])  # stays out, said once


def test_an_aged_out_hold_counts_again_once_rewritten(tmp_path: Path) -> None:
    holds.place(str(tmp_path), _hold("h"))
    watch = HoldWatch(str(tmp_path), GPU0, idle_age_out_s=10.0)
    watch.check(0.0, 0.0)
    assert [c.reason for c in watch.check(10.0, 0.0)[0]] == ["aged out"]
    path = tmp_path / f"hold.{GPU0}.h.json"
    os.utime(path, ns=(5, 5))
    holds.place(str(tmp_path), _hold("h"))  # refreshed by a live holder: a new file
    os.utime(path, ns=(7, 7))
    changes, _ = watch.check(11.0, 0.0)
    assert [(c.event, c.holder) for c in changes] == [("hold", "h")]


def test_age_out_zero_never_ages_out(tmp_path: Path) -> None:
    holds.place(str(tmp_path), _hold())
    watch = HoldWatch(str(tmp_path), GPU0, idle_age_out_s=0.0)
    watch.check(0.0, 0.0)
    assert watch.check(1e9, 0.0) == ([], []) and watch.held


def test_ensure_dir_makes_it_0755_whatever_the_umask_and_leaves_an_existing_one_alone(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        holds.ensure_dir(str(tmp_path / "a" / "holds"))
    finally:
        os.umask(old)
    assert (tmp_path / "a" / "holds").stat().st_mode & 0o777 == 0o755
    (tmp_path / "mine").mkdir(mode=0o700)
    holds.ensure_dir(str(tmp_path / "mine"))
    assert (tmp_path / "mine").stat().st_mode & 0o777 == 0o700  # its owner's decision
    (tmp_path / "file").write_text("")
    with pytest.raises(holds.HoldError, match="not a directory"):
        holds.ensure_dir(str(tmp_path / "file"))


def test_the_watch_holds_fail_safe_with_holder_dash_and_lets_go_when_readable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(holds, "MAX_HOLDS", 2)
    for name in ("a", "b", "c"):
        holds.place(str(tmp_path), _hold(name))
    watch = HoldWatch(str(tmp_path), GPU0)
    changes, problems = watch.check(0.0, 0.0)
    assert [(c.event, c.holder) for c in changes] == [("hold", hold_watch.FAIL_SAFE_HOLDER)] and len(problems) == 1
    assert watch.held and watch.holders == ("a", "b", "c")  # hold --wait of any of them is acknowledged
    holds.release(str(tmp_path), GPU0, "c")
    changes, _ = watch.check(1.5, 0.0)
    assert [(c.event, c.holder) for c in changes] == [("release", "-"), ("hold", "a"), ("hold", "b")]
    assert watch.holders == ("a", "b")


# --- a directory shared with neighbours ----------------------------------------------------------------------

def test_dot_files_and_names_of_no_hold_do_not_use_up_the_listing(tmp_path: Path) -> None:
    # Only the names a reader reads count towards its bound: a neighbour's dot files (here 5,000 hard links to one
    # file) and other names neither hide a hold nor turn the listing into the fail safe.
    (tmp_path / ".x").write_text("")
    for k in range(5000):
        os.link(tmp_path / ".x", tmp_path / f".x{k}")
    for k in range(200):
        (tmp_path / f"notes{k}.txt").write_text("")
    holds.place(str(tmp_path), _hold())
    view = holds.read_holds(str(tmp_path), GPU0, 200.0)
    assert view.fail_safe is None and view.holds == (_hold(),)
    assert len(view.problems) == 1 and "and 195 more" in view.problems[0]  # the other names: one line for all


def test_a_flood_of_unreadable_hold_names_is_one_line(tmp_path: Path) -> None:
    # Directories named as Slurm's next holds would be: one line, not one per name (256 of them and a hold are more
    # than MAX_HOLDS: the GPU is held fail safe, as it is for so many holds).
    for job in range(100, 300):
        (tmp_path / f"hold.{GPU0}.slurm-{job}.json").mkdir()
    holds.place(str(tmp_path), _hold("good"))
    view = holds.read_holds(str(tmp_path), GPU0, 0.0)
    assert [h.holder for h in view.holds] == ["good"]
    assert len(view.problems) == 1 and "200" in view.problems[0], view.problems
    watch = HoldWatch(str(tmp_path), GPU0)
    assert len(watch.check(0.0, 0.0)[1]) == 1


def test_a_hold_is_placed_where_its_name_is_taken_by_a_directory(tmp_path: Path) -> None:
    (tmp_path / holds.hold_name(GPU0, "slurm-42")).mkdir()  # a neighbour's, named as the next Slurm hold
    placed = holds.place(str(tmp_path), _hold())
    assert placed.holder == "slurm-42"
    assert holds.read_holds(str(tmp_path), GPU0, 200.0).holds == (_hold(),)
    watch = HoldWatch(str(tmp_path), GPU0)
    assert watch.check(0.0, 200.0)[0][0].holder == "slurm-42" and watch.held
    assert holds.release(str(tmp_path), GPU0, "slurm-42")
    assert not holds.read_holds(str(tmp_path), GPU0, 200.0).held


def test_a_plain_user_places_a_hold_whose_name_a_neighbour_took(tmp_path: Path) -> None:
    # In a directory anyone may write (1777), a neighbour's file at the hold's name cannot be replaced by another
    # user: the hold is placed all the same, and honoured as its holder's.
    from tests.neighbours import FILLER, NEIGHBOUR, as_user, hold_dir_for_all, local_user, shared_dir

    neighbour, placer = local_user(NEIGHBOUR), local_user(FILLER)
    with shared_dir() as parent:
        hold_dir = str(hold_dir_for_all(parent))

        def squat(_channel: object) -> None:
            with open(os.path.join(hold_dir, holds.hold_name(GPU0, "slurm-42")), "w") as file:
                file.write("mine")

        def place(_channel: object) -> str:
            return holds.place(hold_dir, _hold()).holder

        as_user(neighbour, squat)
        assert as_user(placer, place) == "slurm-42"
        view = holds.read_holds(hold_dir, GPU0, 200.0)
        assert view.holds == (_hold(),) and len(view.problems) == 1  # the neighbour's file: one line
        assert as_user(placer, lambda _c: holds.release(hold_dir, GPU0, "slurm-42"))
        assert not holds.read_holds(hold_dir, GPU0, 200.0).held
