"""Other users of the host, for the tests of a hold directory shared with neighbours (docs/holds.md: who can do
what). The suite runs as root (here and in CI): `local_user` makes a system user where it is missing (useradd) and
skips, saying why, where that cannot be done; `as_user` runs a function in a forked child of this process that has
become that user (setgroups, setgid, setuid), so that what it does to the directory is that user's as the kernel
sees it: its files are its own, and its reads and locks are what its permissions allow. The child is forked, not
started: the interpreter's own files need not be readable by that user, and the modules this process has imported
serve the child as they are (import what it uses before forking).

`shared_dir` is a directory under /tmp that every user can reach (pytest's own temporary directories are root's,
mode 0700), removed after the test."""

from __future__ import annotations

import contextlib
import encodings.ascii  # noqa: F401 - loaded before a fork: the child may not read the interpreter's files
import encodings.latin_1  # noqa: F401
import encodings.utf_8  # noqa: F401
import os
import pickle
import pwd
import shutil
import signal
import subprocess
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

NEIGHBOUR = "forge-neighbour"  # the hostile local user
FILLER = "forge-filler"  # a plain user that runs a filler


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int


def local_user(name: str) -> User:
    """The system user `name`, made where missing; the test is skipped where it cannot be (not root, no useradd)."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to make and become a second local user")
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        useradd = shutil.which("useradd")
        if useradd is None:
            pytest.skip("needs useradd, to make a second local user")
        made = subprocess.run([useradd, "--system", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin",
                               name], capture_output=True, text=True, check=False)
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            pytest.skip(f"useradd {name} failed: {made.stderr.strip()}")
    return User(name, entry.pw_uid, entry.pw_gid)


@contextlib.contextmanager
def shared_dir() -> Iterator[Path]:
    """A directory every user can reach, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="forge-shared-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def hold_dir_for_all(parent: Path, mode: int = 0o1777) -> Path:
    """`install -d -m 1777 DIR` under `parent` (the docs' "anyone may place holds")."""
    path = parent / "holds"
    path.mkdir()
    path.chmod(mode)
    return path


class AsUser:
    """A function running as another user in a forked child: `fn(channel, *args)`. The parent's `send` is the
    child's `channel.get()`, the child's `channel.put(value)` the parent's `recv()`; `result` waits for its return
    value (an exception in the child is re-raised here as an AssertionError with its traceback)."""

    def __init__(self, user: User, fn: Callable[..., Any], *args: Any) -> None:
        self._from_child, to_parent = os.pipe()
        from_parent, self._to_child = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: become the user, run, report, leave without running anything of the parent's
            code = 0
            channel = Channel(from_parent, to_parent)
            try:
                os.close(self._from_child)
                os.close(self._to_child)
                os.setgroups([])
                os.setgid(user.gid)
                os.setuid(user.uid)
                outcome: tuple[str, Any] = ("ok", fn(channel, *args))
            except BaseException:  # noqa: BLE001 - sent to the parent whole
                outcome, code = ("error", traceback.format_exc()), 1
            with contextlib.suppress(BaseException):
                channel.send(outcome)
            os._exit(code)
        os.close(to_parent)
        os.close(from_parent)
        self.pid = pid
        self._channel = Channel(self._from_child, self._to_child)
        self._done = False

    def send(self, value: Any) -> None:
        self._channel.send(("msg", value))

    def recv(self) -> Any:
        """The child's next `put`; its exception if it failed first."""
        kind, value = self._channel.recv()
        if kind == "error":
            raise AssertionError(f"as another user:\n{value}")
        if kind == "ok":
            raise AssertionError(f"the child returned ({value!r}) before it put anything more")
        return value

    def result(self) -> Any:
        try:
            while True:
                kind, value = self._channel.recv()
                if kind in ("ok", "error"):
                    break
        finally:
            self.close()
        if kind == "error":
            raise AssertionError(f"as another user:\n{value}")
        return value

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.close()

    def close(self) -> None:
        if not self._done:
            self._done = True
            os.waitpid(self.pid, 0)
            os.close(self._from_child)
            os.close(self._to_child)


class Channel:
    """Pickled values one way each on two pipes: between a forked child and its parent."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd, self.write_fd = read_fd, write_fd

    def send(self, value: Any) -> None:
        data = pickle.dumps(value)
        os.write(self.write_fd, len(data).to_bytes(8, "big") + data)

    def recv(self) -> Any:
        size = int.from_bytes(self._exactly(8), "big")
        return pickle.loads(self._exactly(size))

    def put(self, value: Any) -> None:
        """In the child: a value for the parent's `recv`."""
        self.send(("msg", value))

    def get(self) -> Any:
        """In the child: what the parent sent."""
        return self.recv()[1]

    def _exactly(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = os.read(self.read_fd, size - len(data))
            if not chunk:
                raise EOFError("the other side is gone")
            data += chunk
        return data


def as_user(user: User, fn: Callable[..., Any], *args: Any) -> Any:
    """Run `fn(channel, *args)` as `user` to its end; its return value."""
    return AsUser(user, fn, *args).result()
