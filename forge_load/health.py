"""Liveness from outside the process: the run loop touches a heartbeat file, and
`python -m forge_load.health` exits 0 while it is fresh, 1 when the loop has stalled or is gone."""

from __future__ import annotations

import math
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

DEFAULT_PATH = "/tmp/forge_load.heartbeat"
DEFAULT_MAX_AGE_S = 30.0


def heartbeat_path() -> Path:
    return Path(os.environ.get("FORGE_HEARTBEAT_FILE") or DEFAULT_PATH)


class Heartbeat:
    """Touches the file at most once per `every_s` of wall time, however often it is called."""

    def __init__(self, path: Path, every_s: float = 1.0) -> None:
        self.path = path
        self.every_s = every_s
        self._last_s = float("-inf")

    def __call__(self) -> None:
        now_s = time.monotonic()
        if now_s - self._last_s < self.every_s:
            return
        self._last_s = now_s
        try:
            self.path.write_text(f"{time.time():.3f}\n")
        except OSError:
            pass  # a read-only or missing /tmp must not stop the filler; the health check will say so

    def clear(self) -> None:
        try:
            self.path.unlink()
        except OSError:
            pass


def check(path: Path, max_age_s: float) -> tuple[bool, str]:
    try:
        age_s = time.time() - path.stat().st_mtime
    except OSError:
        return False, f"no heartbeat at {path}"
    if age_s > max_age_s:
        return False, f"heartbeat {age_s:.0f} s old (limit {max_age_s:.0f} s)"
    return True, f"heartbeat {age_s:.1f} s old"


def main() -> int:
    raw = os.environ.get("FORGE_HEALTH_MAX_AGE", "")
    try:
        max_age_s = float(raw) if raw else DEFAULT_MAX_AGE_S
    except ValueError:
        max_age_s = math.nan
    if not (math.isfinite(max_age_s) and max_age_s > 0):
        print(f"FORGE_HEALTH_MAX_AGE={raw!r} is not valid: expected seconds > 0", file=sys.stderr)
        return 2
    port = os.environ.get("FORGE_METRICS_PORT", "").strip()
    if port.isdigit() and int(port) > 0:
        # With the metrics server on, /health knows every GPU's loop; the file only says one is alive.
        ok, message = check_url(f"http://127.0.0.1:{int(port)}/health")
    else:
        ok, message = check(heartbeat_path(), max_age_s)
    print(message)
    return 0 if ok else 1


def check_url(url: str, timeout_s: float = 4.0) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return True, response.read().decode(errors="replace").strip()
    except urllib.error.HTTPError as error:
        return False, error.read().decode(errors="replace").strip() or f"{url}: HTTP {error.code}"
    except OSError as error:
        return False, f"{url}: {error}"


if __name__ == "__main__":
    raise SystemExit(main())
