"""A real single-node Slurm for the tests: Debian's munged, slurmctld and slurmd on a temporary configuration.

    def test_x(slurm_cluster: ClusterFactory) -> None:      # skipped, saying why, where Slurm cannot run
        cluster = slurm_cluster(prolog=..., epilog=..., settings={"FORGE_LOAD": ...})
        cluster.srun(["hostname"], gres="gpu:1")             # stopped in order at the test's end

or, outside pytest, `with SlurmCluster(...) as cluster: ...`.

No systemd or cgroups are needed (ProctrackType=proctrack/linuxproc, TaskPlugin=task/none). The node has
`Gres=gpu:2`: gres.conf names two character devices made with mknod (major 195, minors 0 and 1, as the NVIDIA
driver's /dev/nvidia0 and /dev/nvidia1) in the cluster's directory. munged listens on a socket of its own there
(AuthInfo=socket=...), and the daemons on free ports, so nothing of the host's Slurm or munge is touched.
`settings` are written as forge-load.conf beside slurm.conf, which the project's prolog reads. `gres` replaces
gres.conf's records (each what follows `NodeName=localhost Name=gpu `, `{dev}` standing for the cluster's device
directory, whose files named there are made as character devices): one GRES per record, as a MIG device's record
with `MultipleFiles=` (its GPU's device and its two capability devices) is.

`configless=True` makes a configless node: slurm.conf has `SlurmctldParameters=enable_configless` and slurmd
starts with `--conf-server localhost:PORT` and no slurm.conf, in a mount namespace of its own (`unshare -m`)
where the controller's configuration directory is hidden under an empty tmpfs (a node has no copy of it) and
/run is a tmpfs of its own: slurmd, before it has fetched AuthInfo, reaches munge at its default socket
(/run/munge/munge.socket.2, there a link to the cluster's), and it makes /run/slurm/conf, which must not
touch the host. It fetches slurm.conf and gres.conf into `conf_cache` (SlurmdSpoolDir/conf-cache). The
Prolog= and Epilog= given must then be paths the node has, outside the cluster's etc. `configless_missing()`
says why such a node cannot run here.

Stopping is ordered: wait until no job is left and the node is idle (its epilog done), then slurmd, then
slurmctld, then munged; whatever does not stop on SIGTERM is killed. No daemon is left behind, even when the
start fails half way. Needs root (slurmd runs jobs and mknod) and the Debian packages slurmctld, slurmd,
slurm-client and munge (scripts/install_test_tools.sh installs them): `missing()` says what is not there.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sinfo", "squeue", "scontrol")
SBIN = ("/usr/sbin", "/sbin")
MUNGE_KEY = Path("/etc/munge/munge.key")
NVIDIA_MAJOR = 195
NVIDIA_CAPS_MAJOR = 508  # /dev/nvidia-caps' is dynamic; Slurm reads it from the file


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def missing() -> str | None:
    """None when a cluster can be started here, else why not (one line, for a skip)."""
    if os.geteuid() != 0:
        return "needs root (slurmd runs the jobs, mknod makes the GPU device files)"
    absent = [name for name in DAEMONS + CLIENTS if _which(name) is None]
    if absent:
        return (f"Slurm or munge is not installed (missing {', '.join(absent)}; scripts/install_test_tools.sh "
                "installs Debian's slurmctld, slurmd, slurm-client and munge)")
    if not MUNGE_KEY.is_file():
        return f"no munge key at {MUNGE_KEY} (the munge package creates it)"
    return None


def configless_missing() -> str | None:
    """None when a configless node can be started here (a mount namespace with tmpfs mounts), else why not."""
    if shutil.which("unshare") is None:
        return "no unshare (util-linux) for the configless node's mount namespace"
    with tempfile.TemporaryDirectory() as scratch:
        proc = subprocess.run(["unshare", "-m", "--propagation", "private", "mount", "-t", "tmpfs", "none", scratch],
                              capture_output=True, text=True, timeout=10, check=False)
    if proc.returncode != 0:
        return f"cannot mount in a new mount namespace (unshare -m: {proc.stderr.strip()})"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SlurmError(Exception):
    """The cluster did not start or stop; the message says which daemon and ends with its log's tail."""


class SlurmCluster:
    """One node named localhost with two GPUs (gres indices 0 and 1), a partition `debug`."""

    def __init__(self, *, prolog: Path | None = None, epilog: Path | None = None,
                 settings: Mapping[str, str] | None = None, configless: bool = False,
                 gres: Sequence[str] | None = None, start_timeout_s: float = 60.0) -> None:
        self.prolog = prolog
        self.epilog = epilog
        self.settings = dict(settings or {})
        self.configless = configless
        self.start_timeout_s = start_timeout_s
        # munged wants every directory above its socket searchable by all: not the 0700 pytest tmp_path.
        self.root = Path(tempfile.mkdtemp(prefix="forge-slurm-"))
        self.root.chmod(0o755)
        self.conf = self.root / "etc" / "slurm.conf"
        self.conf_cache = self.root / "spool" / "conf-cache"  # a configless slurmd's copy of the configuration
        self.ctld_port = _free_port()
        self.gres = list(gres) if gres is not None else ["File={dev}/nvidia[0-1]"]
        self.devices = [self.root / "dev" / f"nvidia{i}" for i in range(2)]
        self.logs = self.root / "log"
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        try:
            self._write_config()
            self._start_munged()
            self._spawn("slurmctld", [_which("slurmctld") or "slurmctld", "-D", "-f", str(self.conf)])
            slurmd = _which("slurmd") or "slurmd"
            if self.configless:
                self._wait_ctld(self.start_timeout_s)  # a slurmd that cannot fetch its configuration exits
                self._spawn("slurmd", self._configless_slurmd(slurmd))
            else:
                self._spawn("slurmd", [slurmd, "-D", "-N", "localhost", "-f", str(self.conf)])
            self.wait_idle(self.start_timeout_s)
        except BaseException:
            self.stop(wait_jobs_s=0.0)
            raise

    def stop(self, wait_jobs_s: float = 60.0) -> None:
        """Jobs gone and the node idle (its epilog done), then slurmd, slurmctld, munged; then the files."""
        try:
            if wait_jobs_s > 0 and "slurmctld" in self._procs and "slurmd" in self._procs:
                try:
                    # Drained or down (a script failed) is settled too: nothing runs there any more.
                    self.wait_idle(wait_jobs_s, states=("idle", "drained", "down", "drained*", "down*"))
                except SlurmError:
                    pass  # stopped anyway, below: a test that left a job running fails on its own
            for name in ("slurmd", "slurmctld", "munged"):
                self._terminate(name)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    # -- for the tests -----------------------------------------------------------------------------------------

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def srun(self, args: Sequence[str], *, gres: str = "gpu:1", env: Mapping[str, str] | None = None,
             **kwargs: Any) -> subprocess.Popen[str]:
        """A job of one task with `--gres=gres`, as a Popen (text mode; output piped unless given)."""
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        cmd = [_which("srun") or "srun", f"--gres={gres}", "--ntasks=1", "--job-name=forge-test", *args]
        return subprocess.Popen(cmd, env=self.env(env), text=True, **kwargs)

    def node_state(self) -> str:
        out = self._client(["sinfo", "--noheader", "--nodes=localhost", "--format=%T"])
        return out.strip().splitlines()[0] if out.strip() else ""

    def node_reason(self) -> str:
        return self._client(["sinfo", "--noheader", "--nodes=localhost", "--format=%E"]).strip()

    def jobs(self) -> list[str]:
        return [line for line in self._client(["squeue", "--noheader", "--format=%i %T"]).splitlines()
                if line.strip()]

    def wait_idle(self, timeout_s: float, states: tuple[str, ...] = ("idle",)) -> None:
        """Until no job is queued or running and the node is in one of `states`; SlurmError after timeout_s."""
        deadline = time.monotonic() + timeout_s
        state, jobs = "", ["?"]
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                jobs = self.jobs()
                state = self.node_state()
            except SlurmError:
                state = "(slurmctld not answering yet)"
            if not jobs and state in states:
                return
            time.sleep(0.1)
        raise SlurmError(f"the node is not idle after {timeout_s} s: state {state!r}, jobs {jobs}"
                         + self._tails())

    def daemon_log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    @property
    def gpu_count(self) -> int:
        """The node's GRES of gpu: one per record, a record's File= range one per device in it."""
        count = 0
        for record in self.gres:
            if record.startswith("File=") and "[" in record:
                low, high = record.split("[", 1)[1].split("]", 1)[0].split("-")
                count += int(high) - int(low) + 1
            else:
                count += 1
        return count

    # -- internals ---------------------------------------------------------------------------------------------

    def _write_config(self) -> None:
        for sub in ("etc", "dev", "log", "state", "spool", "run"):
            (self.root / sub).mkdir(mode=0o755)
        key_dir = self.root / "munge-key"
        key_dir.mkdir(mode=0o700)
        shutil.copyfile(MUNGE_KEY, key_dir / "key")
        (key_dir / "key").chmod(0o600)
        for minor, device in enumerate(self.devices):
            os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, minor))
        dev = str(self.root / "dev")
        for record in self.gres:
            for word in record.replace("=", ",").replace(" ", ",").split(","):
                path = Path(word.format(dev=dev))
                if word.startswith("{dev}/") and "[" not in word and not path.exists():
                    path.parent.mkdir(parents=True, exist_ok=True)
                    digits = "".join(c for c in path.name if c.isdigit()) or "0"
                    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_CAPS_MAJOR, int(digits)))
        run = self.root / "run"
        lines = [
            "ClusterName=forgetest",
            "SlurmctldHost=localhost",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={run / 'munge.socket'}",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmdPort={_free_port()}",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}",
            f"SlurmctldPidFile={run / 'slurmctld.pid'}",
            f"SlurmdPidFile={run / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.logs / 'slurmctld.log'}",
            f"SlurmdLogFile={self.logs / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "GresTypes=gpu",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "PrologFlags=Alloc",
        ]
        if self.configless:
            lines.append("SlurmctldParameters=enable_configless")
        if self.prolog is not None:
            lines.append(f"Prolog={self.prolog}")
        if self.epilog is not None:
            lines.append(f"Epilog={self.epilog}")
        lines += [
            f"NodeName=localhost CPUs=2 Gres=gpu:{self.gpu_count} State=UNKNOWN",
            "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        (self.root / "etc" / "gres.conf").write_text(
            "".join(f"NodeName=localhost Name=gpu {record.format(dev=dev)}\n" for record in self.gres))
        if self.settings:
            (self.root / "etc" / "forge-load.conf").write_text(
                "".join(f"{key}={value}\n" for key, value in self.settings.items()))

    def _configless_slurmd(self, slurmd: str) -> list[str]:
        """slurmd in a mount namespace of its own: /run a tmpfs with munge's default socket a link to the
        cluster's, the controller's etc an empty tmpfs (exec'd: the process is slurmd itself)."""
        q = shlex.quote
        socket_path = self.root / "run" / "munge.socket"
        inner = (f"mount -t tmpfs -o mode=0755 none /run && mkdir /run/munge"
                 f" && ln -s {q(str(socket_path))} /run/munge/munge.socket.2"
                 f" && mount -t tmpfs -o mode=0755 none {q(str(self.root / 'etc'))}"
                 f" && exec {q(slurmd)} -D -N localhost --conf-server localhost:{self.ctld_port}")
        return ["unshare", "-m", "--propagation", "private", "sh", "-c", inner]

    def _wait_ctld(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive()
            try:
                self.node_state()
                return
            except SlurmError as error:
                if time.monotonic() > deadline:
                    raise SlurmError(f"slurmctld not answering after {timeout_s} s: {error}" + self._tails()) \
                        from error
            time.sleep(0.1)

    def _start_munged(self) -> None:
        run = self.root / "run"
        key_dir = self.root / "munge-key"
        self._spawn("munged", [_which("munged") or "munged", "--foreground", f"--socket={run / 'munge.socket'}",
                               f"--key-file={key_dir / 'key'}", f"--pid-file={run / 'munged.pid'}",
                               f"--seed-file={key_dir / 'seed'}", f"--log-file={self.logs / 'munged.log'}"])
        deadline = time.monotonic() + 10.0
        while not (run / "munge.socket").exists():
            self._check_alive()
            if time.monotonic() > deadline:
                raise SlurmError("munged made no socket in 10 s" + self._tails())
            time.sleep(0.05)

    def _spawn(self, name: str, cmd: list[str]) -> None:
        out = open(self.logs / f"{name}.out", "wb")  # noqa: SIM115 - closed with the process
        try:
            self._procs[name] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                                 start_new_session=True)
        finally:
            out.close()

    def _check_alive(self) -> None:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                raise SlurmError(f"{name} exited {proc.returncode}" + self._tails())

    def _terminate(self, name: str) -> None:
        proc = self._procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _client(self, args: list[str]) -> str:
        cmd = [_which(args[0]) or args[0], *args[1:]]
        try:
            proc = subprocess.run(cmd, env=self.env(), capture_output=True, text=True, timeout=15, check=False)
        except subprocess.TimeoutExpired as error:
            raise SlurmError(f"{args[0]} did not answer in 15 s") from error
        if proc.returncode != 0:
            raise SlurmError(f"{' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc.stdout

    def _tails(self) -> str:
        parts = []
        for name in DAEMONS:
            for suffix in ("log", "out"):
                path = self.logs / f"{name}.{suffix}"
                if path.exists():
                    text = path.read_text(errors="replace").strip().splitlines()[-5:]
                    if text:
                        parts.append(f"\n--- {path.name}:\n" + "\n".join(text))
        return "".join(parts)


class ClusterFactory:
    """Starts clusters for one test (keyword arguments as SlurmCluster's) and stops them all after it."""

    def __init__(self) -> None:
        self.made: list[SlurmCluster] = []

    def __call__(self, **kwargs: Any) -> SlurmCluster:
        cluster = SlurmCluster(**kwargs)
        cluster.start()  # stops what it started itself when it fails
        self.made.append(cluster)
        return cluster

    def stop_all(self) -> None:
        while self.made:
            self.made.pop().stop()


@pytest.fixture
def slurm_cluster() -> Iterator[ClusterFactory]:
    """A factory of running clusters, each stopped in order at the end of the test; skips where Slurm cannot
    run here (not root, or the Debian packages missing)."""
    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    factory = ClusterFactory()
    try:
        yield factory
    finally:
        factory.stop_all()
