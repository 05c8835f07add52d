"""forge_load.steering.hold_files: the names of holds (a name of its own where the usual one is taken), reads that
follow no link and trust only their owners, and a file parsed once while unchanged, however many names reach it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from forge_load.steering import hold_files
from forge_load.steering.hold_files import Hold, HoldError

GPU0 = "GPU-51a00000-0000-4000-8000-000000000000"


def test_a_hold_under_a_name_of_its_own_is_its_holders() -> None:
    tag = hold_files.new_tag()
    assert hold_files.parse_hold_name(hold_files.hold_name(GPU0.upper(), "slurm-42", tag)) == (GPU0, "slurm-42")
    assert hold_files.parse_hold_name(f"hold.{GPU0}.slurm-42+{tag}.json") == (GPU0, "slurm-42")
    for bad in (f"hold.{GPU0}.slurm-42+.json", f"hold.{GPU0}.slurm-42+XYZ.json", f"hold.{GPU0}.+{tag}.json"):
        assert hold_files.parse_hold_name(bad) is None


def test_a_read_trusts_only_the_owners_it_is_given(tmp_path: Path) -> None:
    (tmp_path / "mine").write_bytes(b"{}")
    assert hold_files.read_regular(str(tmp_path / "mine"), 10, owners=(os.geteuid(),))[0] == b"{}"
    with pytest.raises(HoldError, match="not its directory's user's"):
        hold_files.read_regular(str(tmp_path / "mine"), 10, owners=(os.geteuid() + 1,))
    (tmp_path / "link").symlink_to(tmp_path / "mine")
    with pytest.raises(HoldError, match="symbolic link"):
        hold_files.read_regular(str(tmp_path / "link"), 10)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(HoldError, match="not a regular file"):
        hold_files.read_regular(str(tmp_path / "fifo"), 10)  # never blocks


def test_a_file_is_parsed_once_however_many_names_reach_it(tmp_path: Path) -> None:
    hold = Hold(GPU0, "h", "", 1.0)
    (tmp_path / "a").write_bytes(hold_files.hold_to_json(hold))
    for k in range(50):
        os.link(tmp_path / "a", tmp_path / f"b{k}")
    parses: list[bytes] = []

    def parse(data: bytes, gpu: str, holder: str) -> Hold:
        parses.append(data)
        return hold_files.hold_from_json(data, gpu, holder)

    for name in ["a", *(f"b{k}" for k in range(50))] * 2:
        data, info = hold_files.read_regular(str(tmp_path / name), 4096)
        assert hold_files.parsed(info, data, parse, GPU0, "h") == hold
    assert len(parses) == 1
    (tmp_path / "a").write_bytes(hold_files.hold_to_json(Hold(GPU0, "h", "changed", 1.0)))
    data, info = hold_files.read_regular(str(tmp_path / "b3"), 4096)
    assert hold_files.parsed(info, data, parse, GPU0, "h").reason == "changed" and len(parses) == 2
