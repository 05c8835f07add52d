"""forge_load.steering.filler_dirs: a filler's directory of its own in a directory others may write, made and trusted
by owner and mode, and the write locks of liveness and the context, which no reader can take (design §14). With a
second real user where a neighbour is needed (tests/neighbours.py)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

from forge_load.steering import filler_dirs
from forge_load.steering.filler_dirs import OwnDir, open_filler_dirs
from forge_load.steering.holds import list_dir
from tests.neighbours import FILLER, NEIGHBOUR, AsUser, as_user, hold_dir_for_all, local_user, shared_dir


def _own_dir_of(_channel: Any, base: str) -> str:
    own = OwnDir(base)
    own.write("x.status.json", b"{}")
    name = own.name
    own.forget()
    return name


def test_a_directory_whose_name_a_neighbour_took_is_made_under_one_of_its_own() -> None:
    neighbour, filler = local_user(NEIGHBOUR), local_user(FILLER)
    with shared_dir() as parent:
        base = hold_dir_for_all(parent)
        taken = filler_dirs.own_dir_name(filler.uid)
        as_user(neighbour, lambda _c: (base / taken).mkdir(mode=0o755))  # the neighbour's, named as the filler's
        name = as_user(filler, _own_dir_of, str(base))
        assert name != taken and filler_dirs.parse_own_dir_name(name) == (filler.uid, name.rsplit(".", 1)[1])
        assert as_user(filler, _own_dir_of, str(base)) == name  # found again, not a new one each time
        dirs, problems, whole = open_filler_dirs(str(base), list_dir(str(base)).filler_dirs)
        try:
            assert [(d.name, d.uid, d.entries) for d in dirs] == [(name, filler.uid, ["x.status.json"])] and whole
            assert len(problems) == 1 and taken in problems[0] and f"uid {neighbour.uid}'s" in problems[0]
        finally:
            filler_dirs.close_all(dirs)


def test_a_link_or_a_file_at_the_name_is_not_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    base = tmp_path / "holds"
    base.mkdir()
    (base / filler_dirs.own_dir_name(os.geteuid())).symlink_to(elsewhere)
    own = OwnDir(str(base))
    own.write("a.ack.json", b"{}")
    assert own.name != filler_dirs.own_dir_name(os.geteuid()) and list(elsewhere.iterdir()) == []
    own.close()


def test_a_directory_moved_away_is_made_again() -> None:
    # Without the sticky bit (0775), a member of the group may rename another's directory: found out at the next
    # write, which makes it again where readers look.
    neighbour = local_user(NEIGHBOUR)
    with shared_dir() as parent:
        base = hold_dir_for_all(parent, mode=0o777)
        own = OwnDir(str(base))
        own.write("a.status.json", b"1")
        as_user(neighbour, lambda _c: os.rename(base / own.name, base / "away"))
        own.write("a.status.json", b"2")
        assert (base / own.name / "a.status.json").read_bytes() == b"2"
        own.forget()


def _lock_it(channel: Any, path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a reader's read lock: possible once no write lock is held
    channel.put("locked")
    channel.get()


def test_only_a_write_lock_says_a_process_holds_it(tmp_path: Path) -> None:
    neighbour = local_user(NEIGHBOUR)
    with shared_dir() as parent:
        base = parent / "holds"
        base.mkdir()
        own = OwnDir(str(base))
        fd = filler_dirs.write_lock(own.fd(), "g.alive")
        assert oct((base / own.name / "g.alive").stat().st_mode & 0o777) == "0o644"
        assert filler_dirs.write_locked(own.fd(), "g.alive", None) is True
        os.close(fd)  # the filler dies
        reader = AsUser(neighbour, _lock_it, str(base / own.name / "g.alive"))
        try:
            assert reader.recv() == "locked"
            assert filler_dirs.write_locked(own.fd(), "g.alive", None) is False  # its locks say nothing
            fd = filler_dirs.write_lock(own.fd(), "g.alive")  # a new filler's, made afresh: the reader's are old
            assert filler_dirs.write_locked(own.fd(), "g.alive", None) is True
            os.close(fd)
            reader.send("done")
            reader.result()
        finally:
            reader.kill()
            own.close()
