"""The Slurm prolog and epilog (deploy/slurm/): holds placed before a job starts, released after it ends.

Two layers:
- the scripts on their own, run as slurmd runs them (no arguments, Slurm's variables, no PATH), with the real
  `forge-load hold/release` commands: the index mapping by device minor, fail-open paths and their bounds, the
  syslog lines (caught on a socket of the test's own);
- a real Slurm (Debian's munged, slurmctld and slurmd: tests/slurm_harness.py) with the project's prolog and
  epilog, a filler on a 2-GPU virtual GPU, and `srun --gres=gpu:1` jobs that run a real foreign CUDA job
  (scripts/foreign_job.py) on it; judged by the virtual GPU's record of every kernel.

The prolog's cost and the lead times are printed (run with -s to see them):
    .venv/bin/python -m pytest tests/test_slurm.py -q -s -k real_slurm
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.slurm_harness import ClusterFactory, SlurmCluster, configless_missing
from vgpu import Kernel, VirtualGpu
from vgpu.pytest_plugin import VgpuFactory

ROOT = Path(__file__).resolve().parent.parent
PROLOG = ROOT / "deploy" / "slurm" / "prolog.sh"
EPILOG = ROOT / "deploy" / "slurm" / "epilog.sh"
FOREIGN_JOB = ROOT / "scripts" / "foreign_job.py"
WAIT_S = 2.0  # the scripts' default FORGE_SLURM_WAIT_S
BOUND_S = WAIT_S + 1.0  # the whole prolog runs under `timeout` for this long
SLACK_S = 1.0  # starting sh, awk, logger and Python on a loaded 2-core machine
UUIDS = ("GPU-11111111-2222-3333-4444-555555555555", "GPU-66666666-7777-8888-9999-aaaaaaaaaaaa")


def forge_load_command() -> list[str]:
    """The installed console script beside this interpreter, else the module."""
    script = Path(sys.executable).parent / "forge-load"
    return [str(script)] if script.exists() else [sys.executable, "-m", "forge_load"]


class Syslog:
    """A syslog socket of the test's own (logger -u): the messages the scripts send, without their header."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.lines: list[str] = []
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            text = data.decode(errors="replace")
            # "<29>Nov 25 17:15:45 forge-load-slurm: message"
            self.lines.append(text.split("forge-load-slurm: ", 1)[-1] if "forge-load-slurm: " in text else text)

    def wait_for(self, part: str, timeout_s: float = 10.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if part in line:
                    return line
            time.sleep(0.02)
        raise AssertionError(f"no syslog line with {part!r}: {self.lines}")

    def close(self) -> None:
        self._stop = True
        self.sock.close()
        self._thread.join(timeout=2)


@pytest.fixture
def syslog(tmp_path: Path) -> Iterator[Syslog]:
    log = Syslog(tmp_path / "syslog")
    yield log
    log.close()


def write_settings(directory: Path, **settings: str) -> Path:
    """forge-load.conf beside a (nonexistent) slurm.conf; returns the SLURM_CONF path to give the scripts."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "forge-load.conf").write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
    return directory / "slurm.conf"


def run_script(script: Path, slurm_conf: Path, job_id: str, gpus: str | None, context: str,
               timeout_s: float = 30.0, cwd: Path | None = None) -> tuple[int, float]:
    """Run a script as slurmd does (a bare environment, no arguments); its exit code and wall time. Indices as
    Slurm writes them for File= devices go in CUDA_VISIBLE_DEVICES too (tests/test_slurm_gpus.py pairs others)."""
    env = {"SLURM_CONF": str(slurm_conf), "SLURM_JOB_ID": job_id, "SLURM_JOB_USER": "root",
           "SLURM_SCRIPT_CONTEXT": context}
    if gpus is not None:
        env["SLURM_JOB_GPUS"] = gpus
        if gpus and all(part.isdigit() for part in gpus.split(",")):
            env["CUDA_VISIBLE_DEVICES"] = gpus
    start = time.monotonic()
    proc = subprocess.run([str(script)], env=env, capture_output=True, timeout=timeout_s, check=False, cwd=cwd)
    return proc.returncode, time.monotonic() - start


def fake_driver(root: Path, minors_to_uuids: dict[int, str]) -> Path:
    """/proc/driver/nvidia/gpus as the driver lays it out: one directory per PCI address, listed in an order
    unrelated to the minors."""
    for n, (minor, uuid) in enumerate(sorted(minors_to_uuids.items(), reverse=True)):
        d = root / f"0000:{0x18 + n:02x}:00.0"
        d.mkdir(parents=True)
        (d / "information").write_text(
            f"Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 100\nGPU UUID: \t {uuid}\n"
            f"Video BIOS: \t 96.00.74.00.0d\nBus Type: \t PCIe\nBus Location: \t 0000:{0x18 + n:02x}:00.0\n"
            f"Device Minor: \t {minor}\nGPU Excluded:\t No\n")
    return root


def hold_files(hold_dir: Path) -> list[dict[str, Any]]:
    if not hold_dir.exists():
        return []
    return [json.loads(p.read_text()) for p in sorted(hold_dir.glob("hold.*.json"))]


# --- the scripts on their own ----------------------------------------------------------------------------------


def test_the_prolog_holds_the_gpu_with_the_jobs_device_minor_by_uuid_and_the_epilog_releases(
        tmp_path: Path, syslog: Syslog) -> None:
    hold_dir = tmp_path / "holds"
    driver = fake_driver(tmp_path / "driver", {0: UUIDS[1], 1: UUIDS[0]})
    conf = write_settings(tmp_path / "etc", FORGE_LOAD=forge_load_command()[0], FORGE_HOLD_DIR=str(hold_dir),
                          FORGE_SLURM_NVIDIA_PROC=str(driver), FORGE_SLURM_SYSLOG_SOCKET=str(syslog.path))
    if len(forge_load_command()) > 1:
        pytest.skip("needs the forge-load console script (pip install -e .)")
    rc, _ = run_script(PROLOG, conf, "42", "1", "prolog_slurmd")
    assert rc == 0
    holds = hold_files(hold_dir)
    assert [(h["gpu"], h["holder"], h["reason"]) for h in holds] == [(UUIDS[0], "slurm-42", "Slurm job 42")]
    assert "held GPU " + UUIDS[0] + " as slurm-42" in syslog.wait_for("job 42: held")
    rc, _ = run_script(PROLOG, conf, "43", "0", "prolog_slurmd")
    assert rc == 0 and {h["gpu"] for h in hold_files(hold_dir)} == set(UUIDS)
    rc, _ = run_script(EPILOG, conf, "42", "1", "epilog_slurmd")
    assert rc == 0
    assert [(h["gpu"], h["holder"]) for h in hold_files(hold_dir)] == [(UUIDS[1], "slurm-43")]
    assert "released slurm-42" in syslog.wait_for("job 42: released")
    # A range, as Slurm may write several GPUs: each by its minor.
    assert run_script(PROLOG, conf, "44", "0-1", "prolog_slurmd")[0] == 0
    assert sorted(h["gpu"] for h in hold_files(hold_dir) if h["holder"] == "slurm-44") == sorted(UUIDS)


def test_the_epilog_is_told_by_slurms_context_not_only_by_its_name(tmp_path: Path) -> None:
    hold_dir = tmp_path / "holds"
    driver = fake_driver(tmp_path / "driver", {0: UUIDS[0]})
    conf = write_settings(tmp_path / "etc", FORGE_LOAD=forge_load_command()[0], FORGE_HOLD_DIR=str(hold_dir),
                          FORGE_SLURM_NVIDIA_PROC=str(driver))
    if len(forge_load_command()) > 1:
        pytest.skip("needs the forge-load console script (pip install -e .)")
    assert run_script(EPILOG, conf, "7", "0", "prolog_slurmd")[0] == 0  # the prolog, whatever its file's name
    assert [h["holder"] for h in hold_files(hold_dir)] == ["slurm-7"]
    assert run_script(PROLOG, conf, "7", "0", "epilog_slurmd")[0] == 0
    assert hold_files(hold_dir) == []


def test_a_job_without_gpus_starts_no_forge_load(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    fake = tmp_path / "forge-load"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    fake.chmod(0o755)
    conf = write_settings(tmp_path / "etc", FORGE_LOAD=str(fake))
    assert run_script(PROLOG, conf, "5", None, "prolog_slurmd")[0] == 0
    assert run_script(PROLOG, conf, "5", "", "prolog_slurmd")[0] == 0
    assert run_script(EPILOG, conf, "5", None, "epilog_slurmd")[0] == 0
    assert not calls.exists()


def test_without_forge_load_the_prolog_exits_0_at_once_and_says_so(tmp_path: Path, syslog: Syslog) -> None:
    conf = write_settings(tmp_path / "etc", FORGE_LOAD=str(tmp_path / "not-installed" / "forge-load"),
                          FORGE_SLURM_SYSLOG_SOCKET=str(syslog.path), FORGE_HOLD_DIR=str(tmp_path / "holds"))
    rc, took_s = run_script(PROLOG, conf, "9", "0", "prolog_slurmd")
    assert rc == 0 and took_s < BOUND_S
    assert "no forge-load command" in syslog.wait_for("job 9:")
    assert run_script(EPILOG, conf, "9", "0", "epilog_slurmd")[0] == 0


def test_a_hung_forge_load_is_killed_at_the_bound_and_the_job_goes_on(tmp_path: Path, syslog: Syslog) -> None:
    pids = tmp_path / "pids"
    hung = tmp_path / "forge-load"
    hung.write_text(f"#!/bin/sh\necho $$ >> {pids}\nexec sleep 60\n")  # a forge-load stuck on a dead filesystem
    hung.chmod(0o755)
    conf = write_settings(tmp_path / "etc", FORGE_LOAD=str(hung), FORGE_SLURM_WAIT_S="1",
                          FORGE_SLURM_SYSLOG_SOCKET=str(syslog.path))
    rc, took_s = run_script(PROLOG, conf, "11", "0", "prolog_slurmd")
    assert rc == 0
    # Killed 0.3 s before the bound (FORGE_SLURM_WAIT_S + 1), which leaves the time for its syslog line.
    assert 2.0 - 0.3 - 0.1 <= took_s < 2.0 + 0.5, f"{took_s:.2f} s"
    assert "at the bound of 2 s" in syslog.wait_for("job 11: hold gave up after")
    pid = int(pids.read_text().split()[0])
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists(), "the hung forge-load was left running"
    rc, took_s = run_script(EPILOG, conf, "11", "0", "epilog_slurmd")
    assert rc == 0 and took_s < 2.0 + SLACK_S


def test_bad_settings_are_named_in_one_line_and_the_defaults_used(tmp_path: Path, syslog: Syslog) -> None:
    calls = tmp_path / "calls"
    fake = tmp_path / "forge-load"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    fake.chmod(0o755)
    conf = write_settings(tmp_path / "etc", FORGE_HOLD_TIME="3", FORGE_LOAD=str(fake), FORGE_SLURM_WAIT_S="two",
                          FORGE_SLURM_SYSLOG_SOCKET=str(syslog.path))  # a bad line before the socket's
    assert run_script(PROLOG, conf, "3", "0", "prolog_slurmd")[0] == 0
    assert "FORGE_SLURM_WAIT_S='two' is not seconds from 0 to 30; waiting 2" in syslog.wait_for("WAIT_S='two'")
    assert "ignored line(s) 'FORGE_HOLD_TIME=3' (keys: FORGE_LOAD," in syslog.wait_for("FORGE_HOLD_TIME")
    syslog.wait_for("job 3: held")  # the last line of the run
    assert sum("FORGE_HOLD_TIME" in line for line in syslog.lines) == 1, syslog.lines  # once per job
    assert sum("WAIT_S='two'" in line for line in syslog.lines) == 1, syslog.lines
    assert calls.read_text().split()[:2] == ["hold", "--gpu"] and "--wait 2 " in calls.read_text()



class FullSyslog:
    """A syslog socket that does not drain: bound, never read, its queue already full, so that a send to it
    blocks (as a syslog daemon that is stopped or swamped does)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.server.bind(str(path))
        self.client = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.client.setblocking(False)
        self.client.connect(str(path))
        try:
            while True:
                self.client.send(b"<30>forge-load-slurm: filling the queue")
        except BlockingIOError:
            pass

    def close(self) -> None:
        self.client.close()
        self.server.close()


@pytest.fixture
def full_syslog(tmp_path: Path) -> Iterator[FullSyslog]:
    log = FullSyslog(tmp_path / "full-syslog")
    yield log
    log.close()


def test_a_syslog_socket_that_does_not_drain_neither_delays_the_job_nor_stops_the_hold(
        tmp_path: Path, full_syslog: FullSyslog) -> None:
    """Warnings before the hold (two bad settings lines, three SLURM_JOB_GPUS items that are not indices) and
    the hold's own line all go to a socket that never drains: the hold is placed all the same, and the prolog
    exits 0 well within its bound."""
    if len(forge_load_command()) > 1:
        pytest.skip("needs the forge-load console script (pip install -e .)")
    hold_dir = tmp_path / "holds"
    driver = fake_driver(tmp_path / "driver", {0: UUIDS[0]})
    conf = write_settings(tmp_path / "etc", FORGE_HOLD_TIME="3", FORGE_LOAD=forge_load_command()[0],
                          FORGE_HOLD_DIR=str(hold_dir), FORGE_SLURM_NVIDIA_PROC=str(driver),
                          FORGE_SLURM_SYSLOG_SOCKET=str(full_syslog.path), FORGE_SLURM_WAIT_S="soon")
    rc, took_s = run_script(PROLOG, conf, "71", "0,x,y,z", "prolog_slurmd")
    assert rc == 0
    assert [(h["gpu"], h["holder"]) for h in hold_files(hold_dir)] == [(UUIDS[0], "slurm-71")]
    assert took_s < BOUND_S, f"{took_s:.2f} s"  # about 0.5 s: the lines cost at most a fraction of a second
    rc, took_s = run_script(EPILOG, conf, "71", "0", "epilog_slurmd")
    assert rc == 0 and hold_files(hold_dir) == [] and took_s < BOUND_S


def test_a_hung_forge_load_and_a_syslog_socket_that_does_not_drain_still_end_at_the_bound(
        tmp_path: Path, full_syslog: FullSyslog) -> None:
    hung = tmp_path / "forge-load"
    hung.write_text("#!/bin/sh\nexec sleep 60\n")
    hung.chmod(0o755)
    conf = write_settings(tmp_path / "etc", FORGE_LOAD=str(hung), FORGE_SLURM_WAIT_S="1",
                          FORGE_SLURM_SYSLOG_SOCKET=str(full_syslog.path))
    rc, took_s = run_script(PROLOG, conf, "72", "0", "prolog_slurmd")
    assert rc == 0 and took_s < 2.0 + 0.5, f"{took_s:.2f} s"  # the bound: FORGE_SLURM_WAIT_S + 1


def test_a_settings_file_that_never_answers_does_not_hang_the_prolog(tmp_path: Path) -> None:
    """forge-load.conf a FIFO with no writer (as a file on a hung network file system, its read never returns):
    the prolog gives up on it, goes on with the defaults, exits 0 within the default bound, and leaves no
    reader of it behind."""
    etc = tmp_path / "etc"
    etc.mkdir()
    fifo = etc / "forge-load.conf"
    os.mkfifo(fifo)
    for script, context in ((PROLOG, "prolog_slurmd"), (EPILOG, "epilog_slurmd")):
        rc, took_s = run_script(script, etc / "slurm.conf", "73", "0", context, timeout_s=15)
        assert rc == 0 and took_s < BOUND_S, f"{script.name}: {took_s:.2f} s"
        try:  # a writer's open fails at once where nobody has the FIFO open to read
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            raise AssertionError(f"{script.name} left a reader of forge-load.conf behind")
        except OSError as error:
            assert error.errno == errno.ENXIO, error


def test_slurm_job_gpus_is_never_a_file_name_pattern(tmp_path: Path, syslog: Syslog) -> None:
    """slurmd runs the prolog in its own working directory: SLURM_JOB_GPUS='*' must not become the names of
    the files there (a file named 0 would hold GPU 0)."""
    if len(forge_load_command()) > 1:
        pytest.skip("needs the forge-load console script (pip install -e .)")
    hold_dir = tmp_path / "holds"
    driver = fake_driver(tmp_path / "driver", {0: UUIDS[0], 1: UUIDS[1]})
    conf = write_settings(tmp_path / "etc", FORGE_LOAD=forge_load_command()[0], FORGE_HOLD_DIR=str(hold_dir),
                          FORGE_SLURM_NVIDIA_PROC=str(driver), FORGE_SLURM_SYSLOG_SOCKET=str(syslog.path))
    cwd = tmp_path / "slurmd-cwd"
    cwd.mkdir()
    (cwd / "0").write_text("")
    (cwd / "1").write_text("")
    assert run_script(PROLOG, conf, "74", "*", "prolog_slurmd", cwd=cwd)[0] == 0
    assert hold_files(hold_dir) == []
    line = syslog.wait_for("job 74: SLURM_JOB_GPUS=")
    assert "SLURM_JOB_GPUS='*'" in line and "'*' not an index (accepted: N or N-M" in line, line


def install_scripts(etc: Path, epilog_dir: Path | None = None) -> tuple[Path, Path]:
    """The scripts as an admin installs them on a node: a copy of prolog.sh as etc/forge-load-prolog.sh, and
    forge-load-epilog.sh a link to it (in `epilog_dir`, etc by default)."""
    etc.mkdir(parents=True, exist_ok=True)
    prolog = etc / "forge-load-prolog.sh"
    shutil.copyfile(PROLOG, prolog)
    prolog.chmod(0o755)
    epilog_dir = epilog_dir or etc
    epilog_dir.mkdir(parents=True, exist_ok=True)
    epilog = epilog_dir / "forge-load-epilog.sh"
    epilog.symlink_to(prolog)
    return prolog, epilog


def configless_cache(directory: Path) -> Path:
    """slurmd's cache on a configless node, as Slurm 22.05 fills it (only slurm.conf and gres.conf, fetched
    from slurmctld); returns the SLURM_CONF slurmd gives the scripts there."""
    directory.mkdir(parents=True)
    (directory / "slurm.conf").write_text("ClusterName=forgetest\n")
    (directory / "gres.conf").write_text("Name=gpu File=/dev/nvidia[0-1]\n")
    return directory / "slurm.conf"


def test_on_a_configless_node_the_settings_beside_the_script_are_read(tmp_path: Path, syslog: Syslog) -> None:
    if len(forge_load_command()) > 1:
        pytest.skip("needs the forge-load console script (pip install -e .)")
    hold_dir = tmp_path / "holds"
    hold_dir.mkdir()  # as the filler's unit makes it: no wait for a filler to find a new directory
    driver = fake_driver(tmp_path / "driver", {0: UUIDS[0]})
    cache = configless_cache(tmp_path / "spool" / "conf-cache")
    etc = tmp_path / "etc-slurm"
    # The epilog a link from elsewhere: its settings are those beside the file it links to, as the prolog's.
    prolog, epilog = install_scripts(etc, epilog_dir=tmp_path / "elsewhere")
    write_settings(etc, FORGE_LOAD=forge_load_command()[0], FORGE_HOLD_DIR=str(hold_dir),
                   FORGE_SLURM_NVIDIA_PROC=str(driver), FORGE_SLURM_SYSLOG_SOCKET=str(syslog.path))
    assert run_script(prolog, cache, "61", "0", "prolog_slurmd")[0] == 0
    assert [(h["gpu"], h["holder"]) for h in hold_files(hold_dir)] == [(UUIDS[0], "slurm-61")]
    assert f"settings {etc / 'forge-load.conf'}" in syslog.wait_for("job 61: held")
    assert run_script(epilog, cache, "61", "0", "epilog_slurmd")[0] == 0
    assert hold_files(hold_dir) == []
    assert f"settings {etc / 'forge-load.conf'}" in syslog.wait_for("job 61: released")


def test_forge_load_conf_beside_slurm_conf_comes_before_the_one_beside_the_script(
        tmp_path: Path, syslog: Syslog) -> None:
    if len(forge_load_command()) > 1:
        pytest.skip("needs the forge-load console script (pip install -e .)")
    driver = fake_driver(tmp_path / "driver", {0: UUIDS[0]})
    prolog, _ = install_scripts(tmp_path / "etc-slurm")
    (tmp_path / "beside-slurm-conf").mkdir()
    write_settings(tmp_path / "etc-slurm", FORGE_HOLD_DIR=str(tmp_path / "beside-the-script"))
    conf = write_settings(tmp_path / "etc", FORGE_LOAD=forge_load_command()[0],
                          FORGE_HOLD_DIR=str(tmp_path / "beside-slurm-conf"), FORGE_SLURM_NVIDIA_PROC=str(driver),
                          FORGE_SLURM_SYSLOG_SOCKET=str(syslog.path))
    assert run_script(prolog, conf, "62", "0", "prolog_slurmd")[0] == 0
    assert [h["holder"] for h in hold_files(tmp_path / "beside-slurm-conf")] == ["slurm-62"]
    assert not (tmp_path / "beside-the-script").exists()
    assert f"settings {tmp_path / 'etc' / 'forge-load.conf'}" in syslog.wait_for("job 62: held")


def test_the_scripts_are_shellcheck_clean() -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (scripts/install_test_tools.sh installs Debian's)")
    proc = subprocess.run([shellcheck, str(PROLOG), str(EPILOG)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout


# --- with a filler on the virtual GPU --------------------------------------------------------------------------


@dataclass
class Filler:
    gpu: VirtualGpu
    proc: subprocess.Popen[bytes]
    log: Path

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")]

    def ours(self, device: int) -> list[Kernel]:
        return [k for k in self.gpu.kernels() if k.pid == self.proc.pid and k.device == device]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_filler(gpu: VirtualGpu, hold_dir: Path, log: Path, *args: str) -> Filler:
    """The filler on every GPU of `gpu`, at 0.5. The hold directory is made first, as systemd's
    RuntimeDirectory= does: the filler acknowledges only into a directory that exists."""
    hold_dir.mkdir(mode=0o755, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "forge_load", "--log-format", "json", "--gpus", "all",
                                 "--target", "0.5", "--resume-after", "2", "--hold-dir", str(hold_dir), *args],
                                env=gpu.env(), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    return Filler(gpu, proc, log)


def wait_filling(filler: Filler, devices: range, timeout_s: float = 120.0) -> None:
    """Until the filler has run kernels on every device and acknowledged on each (it writes its
    acknowledgement file at once)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert filler.proc.poll() is None, filler.log.read_text()[-3000:]
        if all(filler.ours(d) for d in devices):
            return
        time.sleep(0.2)
    raise AssertionError("the filler did not fill every GPU: " + filler.log.read_text()[-3000:])


def busy_s(kernels: list[Kernel], a_s: float, b_s: float) -> float:
    return sum(max(0.0, min(k.end, b_s) - max(k.start, a_s)) for k in kernels)


def vgpu_forge_load(tmp_path: Path, gpu: VirtualGpu, events: Path | None = None) -> Path:
    """The forge-load command as the prolog calls it, on this virtual GPU (its NVML resolves the indices);
    with `events`, each call's start and end time is appended there (Unix seconds)."""
    wrapper = tmp_path / "forge-load-on-vgpu"
    env = gpu.env({})
    exports = "".join(f"export {k}='{v}'\n" for k, v in env.items())
    command = " ".join(f"'{c}'" for c in forge_load_command())
    if events is None:
        wrapper.write_text(f"#!/bin/sh\n{exports}exec {command} \"$@\"\n")
    else:
        wrapper.write_text(f"#!/bin/sh\n{exports}echo \"start $(date +%s.%N) $*\" >> '{events}'\n"
                           f"{command} \"$@\"\nrc=$?\necho \"end $(date +%s.%N) $rc $*\" >> '{events}'\n"
                           "exit $rc\n")
    wrapper.chmod(0o755)
    return wrapper


def test_the_prolog_exits_0_within_its_bound_with_no_filler_a_healthy_one_or_a_stopped_one(
        vgpu: VgpuFactory, tmp_path: Path, syslog: Syslog) -> None:
    gpu = vgpu(gpus=2)
    hold_dir = tmp_path / "holds"
    conf = write_settings(tmp_path / "etc", FORGE_LOAD=str(vgpu_forge_load(tmp_path, gpu)),
                          FORGE_HOLD_DIR=str(hold_dir), FORGE_SLURM_SYSLOG_SOCKET=str(syslog.path),
                          FORGE_SLURM_NVIDIA_PROC=str(tmp_path / "no-driver"))
    # No filler at all: no acknowledgement to wait for.
    rc, no_filler_s = run_script(PROLOG, conf, "21", "1", "prolog_slurmd")
    assert rc == 0 and no_filler_s < BOUND_S
    assert f"held GPU {gpu.uuids()[1]} as slurm-21" in syslog.wait_for("job 21:")  # what forge-load held
    assert run_script(EPILOG, conf, "21", "1", "epilog_slurmd")[0] == 0
    filler = start_filler(gpu, hold_dir, tmp_path / "filler.log")
    try:
        wait_filling(filler, range(2))
        # A healthy filler: the prolog returns once it has drained GPU 1, which then stays empty.
        healthy_s = []
        for job in ("31", "32", "33"):
            rc, took_s = run_script(PROLOG, conf, job, "1", "prolog_slurmd")
            returned_s = time.time()
            assert rc == 0 and took_s < BOUND_S
            healthy_s.append(took_s)
            assert "its filler drained" in syslog.wait_for(f"job {job}: held GPU {gpu.uuids()[1]}")
            time.sleep(0.5)
            released_s = time.time()
            assert run_script(EPILOG, conf, job, "1", "epilog_slurmd")[0] == 0
            late = [k for k in filler.ours(1) if k.end > returned_s and k.start < released_s]
            assert late == [], f"{len(late)} of our kernels on GPU 1 after the prolog returned"
            assert busy_s(filler.ours(0), returned_s, released_s) > 0  # GPU 0 goes on
            time.sleep(0.5)
        # A filler stopped (SIGSTOP) while filling: its acknowledgement is fresh but will never name the hold.
        filler.proc.send_signal(signal.SIGSTOP)
        rc, hung_s = run_script(PROLOG, conf, "22", "1", "prolog_slurmd")
        assert rc == 0
        # It waits (the acknowledgement is younger than 3 s) up to the wait, then exits 1, or 0 if the
        # acknowledgement has aged past 3 s by then.
        assert WAIT_S - 0.3 <= hung_s < BOUND_S + SLACK_S
        line = syslog.wait_for("job 22:")
        assert "no drain acknowledged within 2 s" in line or f"held GPU {gpu.uuids()[1]}" in line, line
        assert run_script(EPILOG, conf, "22", "1", "epilog_slurmd")[0] == 0
    finally:
        filler.stop()
    print(f"\nprolog wall time, start to exit: no filler {no_filler_s:.3f} s; healthy filler "
          + ", ".join(f"{t:.3f}" for t in healthy_s) + f" s; stopped filler {hung_s:.3f} s (bound {BOUND_S} s)")


# --- a real Slurm ----------------------------------------------------------------------------------------------


@dataclass
class Job:
    job_id: str
    step_gpus: str
    pid: int
    context_begin_s: float
    context_s: float
    done_s: float


def run_job(cluster: SlurmCluster, gpu: VirtualGpu) -> Job:
    """`srun --gres=gpu:1` of a real foreign CUDA job (numba) on the virtual GPU; what it printed."""
    script = ('echo "{\\"event\\":\\"slurm\\",\\"job_id\\":\\"$SLURM_JOB_ID\\",'
              '\\"step_gpus\\":\\"$SLURM_STEP_GPUS\\"}"; exec "$0" "$@"')
    proc = cluster.srun(["sh", "-c", script, sys.executable, str(FOREIGN_JOB), "--backend", "numba", "--gpu", "0",
                         "--seconds", "1", "--size", "256"], env=gpu.env(), cwd=str(ROOT))
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, f"srun exited {proc.returncode}: {err[-3000:]}\n{out[-2000:]}"
    lines = {e["event"]: e for e in map(json.loads, (ln for ln in out.splitlines() if ln.startswith("{")))}
    return Job(job_id=lines["slurm"]["job_id"], step_gpus=lines["slurm"]["step_gpus"], pid=lines["backend"]["pid"],
               context_begin_s=lines["context"]["wall_time_begin"], context_s=lines["context"]["wall_time"],
               done_s=lines["done"]["wall_time"])


def read_calls(events: Path) -> list[tuple[str, float, str]]:
    """(start|end, Unix time, the rest) per line the forge-load wrapper wrote."""
    out = []
    for line in events.read_text().splitlines():
        kind, when, rest = line.split(" ", 2)
        out.append((kind, float(when), rest))
    return out


def call_time(calls: list[tuple[str, float, str]], kind: str, command: str, holder: str) -> float:
    found = [t for k, t, rest in calls if k == kind and f"{command} " in rest and f"--holder {holder}" in rest]
    assert len(found) == 1, (kind, command, holder, calls)
    return found[0]


JOBS = 5


def test_real_slurm_jobs_start_on_drained_gpus_and_the_gpus_fill_again(
        slurm_cluster: ClusterFactory, vgpu: VgpuFactory, tmp_path: Path, syslog: Syslog) -> None:
    gpu = vgpu(gpus=2)
    hold_dir = tmp_path / "holds"
    events = tmp_path / "calls"
    settings = {"FORGE_LOAD": str(vgpu_forge_load(tmp_path, gpu, events)), "FORGE_HOLD_DIR": str(hold_dir),
                "FORGE_SLURM_SYSLOG_SOCKET": str(syslog.path),
                "FORGE_SLURM_NVIDIA_PROC": str(tmp_path / "no-driver")}
    filler = start_filler(gpu, hold_dir, tmp_path / "filler.log")
    jobs: list[Job] = []
    try:
        cluster = slurm_cluster(prolog=PROLOG, epilog=EPILOG, settings=settings)
        wait_filling(filler, range(2))
        for _ in range(JOBS):
            job = run_job(cluster, gpu)
            jobs.append(job)
            cluster.wait_idle(60)  # the epilog has run
            assert cluster.node_reason() in ("", "none"), cluster.node_reason()
            # The next job only once this GPU fills again: each lead time is then measured from filling.
            released_s = call_time(read_calls(events), "end", "release", f"slurm-{job.job_id}")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and \
                    not any(k.start > released_s for k in filler.ours(int(job.step_gpus))):
                time.sleep(0.2)
        slurm_cluster.stop_all()  # in order: the node idle, slurmd, slurmctld, munged
    finally:
        filler.stop()

    calls = read_calls(events)
    leads_s, prolog_s, start_after_s = [], [], []
    for job in jobs:
        holder = f"slurm-{job.job_id}"
        device = int(job.step_gpus)
        job_kernels = [k for k in gpu.kernels() if k.pid == job.pid]
        assert job_kernels and {k.device for k in job_kernels} == {device}, "the job ran on its Slurm GPU"
        held_s = call_time(calls, "end", "hold", holder)  # the prolog returns just after this
        released_s = call_time(calls, "start", "release", holder)  # the epilog starts just before this
        ours = filler.ours(device)
        inside = [k for k in ours if k.end > held_s and k.start < released_s]
        assert inside == [], (f"job {job.job_id}: {len(inside)} of our kernels on GPU {device} while it was held "
                              f"({held_s:.3f} to {released_s:.3f}): first {inside[0]}; calls {calls}; syslog "
                              f"{syslog.lines}; filler {filler.log.read_text()[-3000:]}")
        before = [k for k in ours if k.start < job.context_begin_s]
        assert before, "we filled that GPU before the job"
        last_end_s = max(k.end for k in before)
        assert last_end_s < job.context_begin_s  # our last kernel ended before the job's context was created
        leads_s.append(job.context_begin_s - last_end_s)
        other = filler.ours(1 - device)
        assert busy_s(other, held_s, released_s) >= 0.2 * (released_s - held_s), \
            f"job {job.job_id}: the other GPU did not keep filling"
        assert any(k.start > call_time(calls, "end", "release", holder) for k in ours), \
            f"job {job.job_id}: GPU {device} did not fill again after the epilog"
        took = syslog.wait_for(f"job {job.job_id}: held GPU {gpu.uuids()[device]} as {holder} in ")
        prolog_s.append(float(took.split(" in ")[1].split(" s")[0]))
        start_after_s.append(job.context_begin_s - held_s)
    print(f"\nSlurm jobs on the virtual GPU, {len(jobs)} jobs:"
          f"\n  prolog cost (its start to its hold done, healthy filler): "
          + ", ".join(f"{p:.3f}" for p in prolog_s) + " s"
          + "\n  lead time (job's context creation begins minus our last kernel's end on its GPU): "
          + ", ".join(f"{ms * 1000:.0f}" for ms in leads_s) + " ms"
          + "\n  hold done to the job's context creation: " + ", ".join(f"{s:.3f}" for s in start_after_s) + " s")


def test_real_slurm_configless_node_holds_in_the_hold_dir_named_beside_the_prolog(
        slurm_cluster: ClusterFactory, tmp_path: Path, syslog: Syslog) -> None:
    """A configless node (slurmd --conf-server): its SLURM_CONF names slurmd's cache, which holds only
    slurm.conf and gres.conf; the prolog reads forge-load.conf beside itself and the hold lands where it says."""
    reason = configless_missing()
    if reason is not None:
        pytest.skip(reason)
    if len(forge_load_command()) > 1:
        pytest.skip("needs the forge-load console script (pip install -e .)")
    hold_dir = tmp_path / "holds"
    hold_dir.mkdir()
    driver = fake_driver(tmp_path / "driver", {0: UUIDS[0], 1: UUIDS[1]})
    etc = tmp_path / "node-etc-slurm"  # the node's own /etc/slurm: the scripts and forge-load.conf
    prolog, epilog = install_scripts(etc)
    node_settings = {"FORGE_LOAD": forge_load_command()[0], "FORGE_SLURM_NVIDIA_PROC": str(driver),
                     "FORGE_SLURM_SYSLOG_SOCKET": str(syslog.path)}
    write_settings(etc, FORGE_HOLD_DIR=str(hold_dir), **node_settings)
    # The controller's forge-load.conf, beside its slurm.conf, names another directory: slurmd never fetches it.
    controllers = tmp_path / "controllers-holds"
    cluster = slurm_cluster(prolog=prolog, epilog=epilog, configless=True,
                            settings={"FORGE_HOLD_DIR": str(controllers), **node_settings})
    proc = cluster.srun(["sh", "-c", 'echo "SLURM_CONF=$SLURM_CONF"; echo "STEP_GPUS=$SLURM_STEP_GPUS"; '
                         f"cat {hold_dir}/hold.*.json"])
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, f"srun exited {proc.returncode}: {err}\n{out}"
    cached = sorted(p.name for p in cluster.conf_cache.iterdir())
    cluster.wait_idle(30)  # the epilog has run
    assert cluster.node_reason() in ("", "none"), cluster.node_reason()
    assert f"SLURM_CONF={cluster.conf_cache / 'slurm.conf'}" in out.splitlines()
    assert cached == ["gres.conf", "slurm.conf"]
    step_gpus = out.split("STEP_GPUS=")[1].split()[0]
    held = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [h["gpu"] for h in held] == [UUIDS[int(step_gpus)]], out
    job_id = held[0]["holder"].removeprefix("slurm-")
    assert f"settings {etc / 'forge-load.conf'}" in syslog.wait_for(f"job {job_id}: held GPU")
    assert f"settings {etc / 'forge-load.conf'}" in syslog.wait_for(f"job {job_id}: released")
    assert hold_files(hold_dir) == []
    assert not controllers.exists()
