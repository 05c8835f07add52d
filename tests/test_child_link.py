"""The messages between a MIG device's child process and its parent (service/child_link.py)."""

from __future__ import annotations

import io
import os
import pickle
import threading

from forge_load.service.child_link import StatusReader, encode_status, read_messages, report_status, send_holds
from forge_load.service.exclusive import supervisor_status
from forge_load.steering.holds import Hold

HOLD = Hold("MIG-51a00000-0000-4000-8000-0000000000aa", "k8s-ml_train_main", "", 1.0)


def test_reports_cross_in_pieces_and_the_newest_one_counts() -> None:
    read_fd, write_fd = os.pipe()
    reader = StatusReader(read_fd)
    try:
        assert not reader.read(10.0) and reader.latest is None
        held, filling = supervisor_status("held", holds=1), supervisor_status("filling")
        line = encode_status(held, 0.25)
        os.write(write_fd, line[:7])
        assert not reader.read(10.0)  # half a line is no report yet
        os.write(write_fd, line[7:] + b"not json\n" + b'{"status": {"state": 1}}\n' + encode_status(filling, None))
        assert reader.read(11.0)
        assert reader.latest == (filling, None)  # the lines that are no report were passed over
        os.write(write_fd, encode_status(held, 0.5))
        assert reader.read(12.0) and reader.latest == (held, 11.5)  # its loop beat at 12 - 0.5 on our clock
    finally:
        reader.close()
        os.close(write_fd)
    reader.close()  # twice: its descriptor's number is closed once only
    assert not reader.read(13.0)


def test_the_child_reports_at_each_change_and_a_last_time_when_done() -> None:
    read_fd, write_fd = os.pipe()
    reader = StatusReader(read_fd)
    changed, done = threading.Event(), threading.Event()
    states = iter(["filling", "held", "stopped"])
    thread = threading.Thread(target=report_status,
                              args=(write_fd, lambda: (supervisor_status(next(states)), 0.0), changed, done))
    changed.set()
    thread.start()
    try:
        done.set()
        changed.set()
        thread.join(timeout=5)
        assert not thread.is_alive()
        reader.read(0.0)
        assert reader.latest is not None and reader.latest[0].state in ("held", "stopped")
    finally:
        reader.close()
    try:
        os.fstat(write_fd)
        closed = False
    except OSError:
        closed = True
    assert closed  # the child's end is closed once it is done


def test_the_parents_holds_reach_the_child_until_its_stdin_ends() -> None:
    stream = io.BytesIO()
    send_holds(stream, (HOLD,))
    stream.write(pickle.dumps(("something", "else")))  # not ours: passed over
    send_holds(stream, ())
    stream.seek(0)
    got: list[tuple[Hold, ...]] = []
    read_messages(stream, got.append)
    assert got == [(HOLD,), ()]
