"""What the hostile tests (tests/test_hostile_*.py) share: the one-clean-line check, the filler as a subprocess
(`python -m forge_load`, or the console entry point through tests/hostile_entry.py) and the health command's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any

from tests.host_paths import settings_free

ROOT = Path(__file__).resolve().parent.parent
ENTRY = ROOT / "tests" / "hostile_entry.py"
EVENT_RE = re.compile(r"(^|\s)event=|\"event\"\s*:")


def assert_one_clean_line(message: str, *names: str) -> None:
    assert message and "\n" not in message, repr(message)
    bad = [c for c in message if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")]
    assert not bad, f"raw control characters {bad!r} in {message!r}"
    assert len(message) < 600, f"{len(message)} characters: the value must be shown shortened"
    for name in names:
        assert name in message, f"{name!r} not in {message!r}"


def forge(*args: str, env: dict[str, str] | None = None, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """`python -m forge_load ARGS` to its end, with no FORGE_ variable but `env`'s."""
    full_env = settings_free("TARGET")
    full_env.update(env or {}, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "forge_load", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout_s, cwd=ROOT)


def assert_config_exit(result: subprocess.CompletedProcess[str], name: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr[-2000:]
    assert_one_clean_line(lines[0], name)
    assert not EVENT_RE.search(result.stdout or ""), result.stdout


def run_health(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`python -m forge_load.health` with no FORGE_ variable but `env`'s."""
    full = settings_free()
    full.update(env, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "forge_load.health"], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=60)


def spawn_entry(*options: str, pid1: bool = False, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """tests/hostile_entry.py with `options`, JSON lines, no FORGE_ variable but `env`'s; as PID 1 of a PID
    namespace of its own where `pid1` (`unshare`), as in a container."""
    full = settings_free()
    full.update(env or {}, PYTHONPATH=str(ROOT), FORGE_LOG_FORMAT="json")
    command = [sys.executable, str(ENTRY), *options]
    if pid1:
        command = ["unshare", "--pid", "--fork", "--mount-proc", *command]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full, cwd=ROOT)


def finish_entry(proc: subprocess.Popen[str], first: list[str] | None = None
                 ) -> tuple[int, list[dict[str, Any]], str]:
    """Wait for a spawn_entry() process: (exit code, its JSON lines with `first`, those already read, stderr)."""
    out, err = proc.communicate(timeout=30)
    lines = [line for line in (first or []) + out.splitlines() if line.strip()]
    return proc.returncode, [json.loads(line) for line in lines], err


def started(proc: subprocess.Popen[str]) -> list[str]:
    """Read the process's stdout up to its start line (it runs on)."""
    assert proc.stdout is not None
    lines = [proc.stdout.readline()]
    assert '"start"' in lines[0], lines[0] + (proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
    return lines

