"""forge_load.steering.acks: the fillers' word read in one look (each acknowledgement once, however many GPUs are
asked), format 1's files read only for a GPU no filler of this release acknowledges, and a context lock held
whatever the acknowledgements say."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from forge_load.service.exclusive_child import take_context_lock
from forge_load.steering import acks, hold_files
from forge_load.steering.acks import FillersLook
from forge_load.steering.holds import Ack

GPU0 = "GPU-51a00000-0000-4000-8000-000000000000"
GPU1 = "GPU-51a00000-0000-4000-8000-000000000001"
MIG = "MIG-51a00000-0000-4000-8000-0000000000aa"


def test_one_look_reads_each_acknowledgement_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = time.time()
    acks.write_ack(str(tmp_path), Ack(GPU0, 1, "held", ("h",), True, now))
    acks.write_ack(str(tmp_path), Ack(MIG, 1, "held", ("h",), False, now, of_gpu=GPU0))
    acks.write_ack(str(tmp_path), Ack(GPU1, 1, "filling", (), False, now))
    loads: list[int] = []
    real = json.loads
    monkeypatch.setattr(json, "loads", lambda data, *a, **k: loads.append(1) or real(data, *a, **k))
    with FillersLook(str(tmp_path)) as look:
        for _ in range(3):
            assert sorted(a.gpu_uuid for a in look.word(GPU0).acks) == [GPU0, MIG]  # the GPU's and its MIG device's
            assert [a.gpu_uuid for a in look.word(GPU1).acks] == [GPU1]
    assert len(loads) <= 3


def test_format_1_is_read_only_where_no_filler_of_this_release_acknowledges(tmp_path: Path) -> None:
    planted = Ack(GPU0, 9, "held", ("h",), True, time.time())
    (tmp_path / hold_files.legacy_ack_name(GPU0)).write_bytes(hold_files.ack_to_json(planted, 1))
    with FillersLook(str(tmp_path)) as look:
        word = look.word(GPU0)
        assert word.legacy and word.acks == (planted,)  # a filler of an earlier release: as it was
    ours = Ack(GPU0, 1, "held", ("h",), False, time.time())
    acks.write_ack(str(tmp_path), ours)
    with FillersLook(str(tmp_path)) as look:
        word = look.word(GPU0)
        assert not word.legacy and word.acks == (ours,)  # this release's filler: its own word only


def test_a_context_lock_is_held_whatever_the_acknowledgements_say(tmp_path: Path) -> None:
    acks.write_ack(str(tmp_path), Ack(GPU0, 1, "held", ("h",), True, time.time() - 60))  # a supervisor gone silent
    lock, _ = take_context_lock(str(tmp_path), GPU0, threading.Event())
    assert lock is not None
    try:
        assert acks.context_held(str(tmp_path), GPU0)
    finally:
        lock.close()
    assert not acks.context_held(str(tmp_path), GPU0)
    assert sorted(os.listdir(tmp_path / f"filler.{os.geteuid()}")) == [f"{GPU0}.ack.json", f"{GPU0}.context"]
