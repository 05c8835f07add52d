"""The suite's own copy of everything a filler shares with the other fillers of its host, so that it passes beside
running ones (a developer's GPU host, a CI runner with the systemd unit): a filler started with the default settings
holds the default heartbeat and GPU locks, and a test's filler that met them would run without a heartbeat, or not
at all.

tests/conftest.py calls isolate() before any test is collected: each variable of SHARED then names a directory of
the session's own, for every test and every process a test starts (it inherits the environment). A test that gives a
filler an environment without forge_load's settings takes it from settings_free(), which keeps these.

A new path that fillers share on a host: its variable and a directory name in SHARED, nothing else.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# variable: the directory under the session's own that it names.
SHARED: dict[str, str] = {
    "TMPDIR": "tmp",  # the heartbeats and the GPU locks: $TMPDIR/forge_load-<uid>/ (forge_load/service/health.py)
    # Where a filler with no directory of its own in a hold directory writes its status (root's default:
    # /run/forge-load, forge_load/steering/filler_dirs.py); a config loaded from an empty environment reads it too.
    "RUNTIME_DIRECTORY": "run",
    "FORGE_RUNTIME_DIR": "run",
}
# Variables that would point the suite at a place shared with a filler outside it: unset for the session.
UNSET = (
    "FORGE_HEARTBEAT_FILE",  # one heartbeat for every filler of the suite
)


def isolate() -> Path:
    """Point SHARED into a new directory of the session's own and unset UNSET, in os.environ; the directory."""
    base = Path(tempfile.mkdtemp(prefix="forge-load-suite-"))
    for variable, name in SHARED.items():
        (base / name).mkdir(mode=0o700, exist_ok=True)  # two variables may name one
        os.environ[variable] = str(base / name)
    for variable in UNSET:
        os.environ.pop(variable, None)
    return base


def remove(base: Path) -> None:
    shutil.rmtree(base, ignore_errors=True)


def settings_free(*drop: str) -> dict[str, str]:
    """os.environ without forge_load's settings (every FORGE_ variable) and without `drop`, but with the suite's own
    host paths of SHARED: what a filler a test starts runs with."""
    return {k: v for k, v in os.environ.items()
            if (k in SHARED or not k.upper().startswith("FORGE_")) and k not in drop}
