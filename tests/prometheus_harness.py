"""A real Prometheus server (Debian's `prometheus`) on localhost, scraping a simulated multi-GPU filler.

Used by tests/test_prometheus.py, and by scripts/prometheus_check.sh to show the same by hand:

    python -m tests.prometheus_harness      # from the repository root
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from tests.host_paths import settings_free

ROOT = Path(__file__).resolve().parent.parent
SCRAPE_INTERVAL_S = 1
T = TypeVar("T")

# Three simulated GPUs: 0 fills, 1 yields to a foreign job from 1 s on, 2 is lost at 3 s.
SCENARIO_FLAGS = ("--simulate", "--sim-speed", "1", "--sim-gpus", "3", "--gpus", "all", "--sim-foreign", "1-600",
                  "--sim-foreign-gpus", "1", "--sim-fail-gpu", "2@3", "--duration", "300")
EXPECTED_STATES = {"0": "filling", "1": "yielding", "2": "failed"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def http_json(url: str, timeout_s: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


def wait_for(what: str, check: Callable[[], T | None], timeout_s: float, every_s: float = 0.25) -> T:
    deadline_s = time.monotonic() + timeout_s
    while True:
        try:
            got = check()
        except (OSError, urllib.error.URLError, ValueError):
            got = None
        if got is not None:
            return got
        if time.monotonic() > deadline_s:
            raise TimeoutError(f"gave up after {timeout_s:g} s waiting for {what}")
        time.sleep(every_s)


class Filler:
    """`python -m forge_load` on the simulator, serving metrics on a port it picks (FORGE_METRICS_PORT=0)."""

    def __init__(self, *flags: str) -> None:
        env = settings_free("TARGET")
        env.update(PYTHONPATH=str(ROOT), FORGE_HEARTBEAT_FILE=os.devnull + ".none/heartbeat")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "forge_load", *flags, "--log-format", "json", "--metrics-port", "0",
             "--metrics-addr", "127.0.0.1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.lines: list[dict[str, Any]] = []
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"forge_load exited before serving metrics: {self.proc.stderr.read()}")  # type: ignore[union-attr]
            self.lines.append(json.loads(line))
            if self.lines[-1]["event"] == "metrics":
                self.port = int(self.lines[-1]["port"])
                break

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=10)
        self.lines += [json.loads(line) for line in out.splitlines()]
        return int(self.proc.returncode)

    def __enter__(self) -> Filler:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


class Prometheus:
    """A Prometheus server on 127.0.0.1, its config and data in a temporary folder, scraping `targets` and
    evaluating `rule_files`."""

    def __init__(self, binary: str, targets: list[str], job: str = "forge_load",
                 rule_files: tuple[Path, ...] = ()) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="forge-prometheus-")
        config = Path(self.tmp.name) / "prometheus.yml"
        # JSON is YAML: no YAML library needed to write the config.
        config.write_text(json.dumps({
            "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "evaluation_interval": f"{SCRAPE_INTERVAL_S}s"},
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}],
            "rule_files": [str(path) for path in rule_files],
        }))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(Path(self.tmp.name) / "prometheus.log", "w+")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={Path(self.tmp.name) / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_for("Prometheus to be ready", self._ready, timeout_s=30)
        except BaseException:
            self.close()
            raise

    def _ready(self) -> bool | None:
        if self.proc.poll() is not None:
            self.log.seek(0)
            raise RuntimeError(f"prometheus exited with {self.proc.returncode}: {self.log.read()[-2000:]}")
        with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as response:
            return True if response.status == 200 else None

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query through the HTTP API: [{'metric': {...labels}, 'value': [t, 'v']}, ...]."""
        answer = http_json(f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}")
        if answer.get("status") != "success":
            raise ValueError(f"query {expr!r} failed: {answer}")
        return list(answer["data"]["result"])

    def targets(self) -> list[dict[str, Any]]:
        return list(http_json(f"{self.url}/api/v1/targets")["data"]["activeTargets"])

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule, each with its group's name under "group", its health and last error."""
        groups = http_json(f"{self.url}/api/v1/rules")["data"]["groups"]
        return [{**rule, "group": group["name"]} for group in groups for rule in group["rules"]]

    def alerts(self) -> list[dict[str, Any]]:
        """Pending and firing alerts: [{'labels': {...}, 'state': 'pending' | 'firing', ...}, ...]."""
        return list(http_json(f"{self.url}/api/v1/alerts")["data"]["alerts"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()
        self.tmp.cleanup()

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def health(port: int) -> tuple[int, str]:
    """The filler's /health: (status, body); 503 is an answer here, not an error."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read().decode()


def states_by_gpu(prometheus: Prometheus) -> dict[str, str]:
    return {r["metric"]["gpu"]: r["metric"]["state"] for r in prometheus.query("forge_load_state == 1")}


def main() -> int:
    """Run the scenario and print what Prometheus answers, for a person to read."""
    binary = prometheus_binary()
    if binary is None:
        print("prometheus is not installed: scripts/install_test_tools.sh installs it", file=sys.stderr)
        return 1
    print("forge_load:", " ".join(SCENARIO_FLAGS))
    with Filler(*SCENARIO_FLAGS) as filler, Prometheus(binary, [f"127.0.0.1:{filler.port}"]) as prometheus:
        print(f"filler metrics on 127.0.0.1:{filler.port}, Prometheus {binary} on {prometheus.url}")
        wait_for("the expected states", lambda: states_by_gpu(prometheus) == EXPECTED_STATES or None, timeout_s=30)
        time.sleep(2 * SCRAPE_INTERVAL_S)
        for expr in ("forge_load_state == 1", "forge_load_yields_total", "forge_load_up",
                     "forge_load_own_utilization_ratio", "rate(forge_load_own_busy_seconds_total[5s])",
                     'up{job="forge_load"}'):
            print(f"\n> {expr}")
            for r in sorted(prometheus.query(expr), key=lambda r: r["metric"].get("gpu", "")):
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(r["metric"].items()) if k not in ("instance",))
                print(f"  {{{labels}}} {r['value'][1]}")
        status, body = health(filler.port)
        print(f"\n> GET /health\n  {status}\n  " + body.rstrip().replace("\n", "\n  "))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
