"""Out of file descriptors: too low a limit on open files is one line naming it, and a heartbeat on a host out
of descriptors warns once and raises nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from forge_load.service import health
from tests.host_paths import settings_free
from tests.hostile_support import EVENT_RE, ROOT, assert_one_clean_line

# --- the host's limit on open files --------------------------------------------------------------------------------

def test_too_low_an_open_files_limit_is_one_line_naming_it_not_a_gpu_failure() -> None:
    import resource

    from forge_load.service.app import MIN_OPEN_FILES

    def low_limit() -> None:
        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (12, hard))

    env = settings_free()
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run([sys.executable, "-m", "forge_load", "--simulate", "--duration", "1"], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=60, preexec_fn=low_limit)
    assert result.returncode == 2, (result.returncode, result.stderr, result.stdout[-500:])
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert_one_clean_line(lines[0], "ulimit -n", "12", str(MIN_OPEN_FILES))
    assert "CUDA" not in lines[0] and not EVENT_RE.search(result.stdout)


def test_out_of_descriptors_the_heartbeat_warns_once_and_raises_nothing(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's heartbeat, on a host out of descriptors."""
    import errno

    def no_descriptor(*args: object, **kwargs: object) -> int:
        raise OSError(errno.EMFILE, "Too many open files")

    refused: list[str] = []
    beat = health.Heartbeat(tmp_path / "heartbeat", every_s=0.0, on_refused=refused.append)
    monkeypatch.setattr(os, "open", no_descriptor)
    for _ in range(3):
        beat()
    monkeypatch.undo()
    assert len(refused) == 1 and "Too many open files" in refused[0]
    beat()
    assert health.check(tmp_path / "heartbeat", 30.0)[0]  # written again once descriptors are there
