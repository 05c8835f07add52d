"""The process as an operator meets it: exit codes, one-line errors, signals, and the threaded run loop."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from simrun import WallClock

from forge_load.config.load import load_config
from forge_load.control.filler import Controls
from forge_load.control.probe import DeviceInfo, GpuFailedError, GpuProcess, Probe
from forge_load.control.worker import Launcher
from forge_load.gpu.clocks import WallLoopClock
from forge_load.gpu.sim import SimGpu, SimLauncher, SimProbe
from forge_load.service.loop import run_loop
from forge_load.service.runtime import Runtime
from forge_load.steering.pause import PauseSwitch
from tests.host_paths import settings_free

ROOT = Path(__file__).resolve().parent.parent


def forge(*args: str, env: dict[str, str] | None = None, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    full_env = settings_free("TARGET")
    full_env.update(env or {})
    full_env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "forge_load", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout_s, cwd=ROOT)


@pytest.mark.parametrize("args, env, variable", [
    ((), {"FORGE_TARGET": "abc"}, "FORGE_TARGET"),
    ((), {"FORGE_TARGET": "1.5"}, "FORGE_TARGET"),
    ((), {"FORGE_TARGET": "nan"}, "FORGE_TARGET"),
    ((), {"FORGE_TARGET": ""}, "FORGE_TARGET"),
    ((), {"TARGET": "150"}, "TARGET"),
    ((), {"FORGE_BOOST_TARGET": "0.3"}, "FORGE_BOOST_TARGET"),
    ((), {"FORGE_LOG_FORMAT": "xml"}, "FORGE_LOG_FORMAT"),
    ((), {"FORGE_CONTROLLER": "pid"}, "FORGE_CONTROLLER"),
    ((), {"FORGE_RESUME_AFTER": "-1"}, "FORGE_RESUME_AFTER"),
    (("--sim-window", "0.05"), {}, "--sim-window"),
    (("--sim-foreign", "10-5"), {}, "--sim-foreign"),
    (("--no-such-flag",), {}, "--no-such-flag"),
])
def test_bad_setting_exits_2_with_one_line(args: tuple[str, ...], env: dict[str, str], variable: str) -> None:
    result = forge("--simulate", *args, env=env)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and variable in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def no_nvml() -> None:
    """Skips the test where this machine has a working NVML (a test of what a host without a GPU is told)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("this machine has a working NVML")
    except Exception:  # noqa: BLE001 - no NVML here, whatever pynvml raises
        pass


@pytest.mark.parametrize("gpus", [[], ["--gpu", "0"], ["--gpus", "all"], ["--gpus", "0,1"]])
def test_no_gpu_exits_3_with_a_hint_said_once_in_the_log(gpus: list[str]) -> None:
    # It was said twice (an error line, then the same on stderr) for one GPU, and never in the log for all of them.
    no_nvml()
    result = forge(*gpus, "--duration", "1")
    assert (result.returncode, result.stderr) == (3, "")
    lines = result.stdout.splitlines()
    assert len(lines) == (2 if "0,1" in gpus else 1), lines
    for line in lines:
        assert " event=error " in line and "no usable GPU" in line and "--simulate" in line and "exit_code=3" in line


def test_legacy_target_percent_is_understood() -> None:
    result = forge("--simulate", "--sim-speed", "0", "--duration", "2", "--log-format", "json", env={"TARGET": "50"})
    assert result.returncode == 0, result.stderr
    start = json.loads(result.stdout.splitlines()[0])
    assert start["event"] == "start" and start["target"] == 0.5


@pytest.mark.parametrize("signum", (signal.SIGTERM, signal.SIGINT))
def test_signal_stops_cleanly_within_a_second(signum: int) -> None:
    env = settings_free()
    env.update(PYTHONPATH=str(ROOT), FORGE_LOG_FORMAT="json", FORGE_LOG_INTERVAL="0.5")
    proc = subprocess.Popen([sys.executable, "-m", "forge_load", "--simulate"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    assert proc.stdout is not None
    lines = [proc.stdout.readline(), proc.stdout.readline()]  # start, then a status: it is running
    sent_s = time.monotonic()
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=10)
    took_s = time.monotonic() - sent_s
    assert proc.returncode == 0, err
    assert took_s < 1.0
    events = [json.loads(line) for line in lines + out.splitlines()]
    assert events[-1]["event"] == "stop"
    assert events[-1]["reason"] == f"signal {signal.Signals(signum).name}"
    assert err == ""


def test_text_and_json_lines_carry_the_same_fields() -> None:
    flags = ("--simulate", "--sim-speed", "0", "--duration", "3", "--log-interval", "1")
    text = forge(*flags).stdout.splitlines()
    as_json = [json.loads(line) for line in forge(*flags, "--log-format", "json").stdout.splitlines()]
    # start, status at 1 and 2 s, stop at 3 s; key=value splits the start line's settings onto a line of their own
    assert len(text) == len(as_json) + 1 == 5 and text[1].startswith("t=0.00 event=settings ")
    settings = text.pop(1)
    for text_line, record in zip(text, as_json):
        keys = [part.split("=", 1)[0] for part in text_line.split(" ") if "=" in part]
        assert record.pop("ts") and keys.pop(2) == "time"  # each its format's own time (docs/operating.md)
        record.pop("samples", None)  # JSON lines only
        assert keys[-1] == list(record)[-1] == "uuid"  # last on every line
        assert keys[:-1] == list(record)[:len(keys) - 1]  # a JSON start line goes on with the settings
        assert text_line.startswith(f"t={record['t']:.2f} event={record['event']} time=")
    start_keys = [part.split("=", 1)[0] for part in text[0].split(" ") + settings.split(" ") if "=" in part]
    assert set(start_keys) - {"time"} == set(as_json[0])


class Given:
    """A backend that hands out the probe and launcher it was given: the run loop on the simulated GPU in wall time."""

    claims_gpus = True

    def __init__(self, probe: Probe, launcher: Launcher) -> None:
        self.probe, self.launcher = probe, launcher

    def devices(self) -> list[DeviceInfo]:
        return [self.probe.info]

    def mig_devices(self, gpu_uuid: str) -> list[str]:
        return []

    def open_probe(self, selector: str) -> Probe:
        return self.probe

    def open_launcher(self, probe: Probe, shape: str = "lean", metric: str = "utilization") -> Launcher:
        return self.launcher

    def open_clock(self, probe: Probe) -> WallLoopClock:
        return WallLoopClock()

    def start_fields(self, info: DeviceInfo) -> dict[str, object]:
        return {}


def _threaded(config_flags: str,
              fail_after_s: float | None = None) -> tuple[list[dict[str, object]], BaseException | None]:
    config = load_config(f"--log-format json {config_flags}".split(), env={})
    gpu = SimGpu(config.sim, WallClock())
    probe = SimProbe(gpu)
    if fail_after_s is not None:
        lose_at_s = time.monotonic() + fail_after_s
        real_memory = probe.memory_used_mib

        def memory_used_mib() -> float | None:
            if time.monotonic() > lose_at_s:
                raise GpuFailedError("GPU 0 (GPU-test) was lost: simulated")
            return real_memory()

        probe.memory_used_mib = memory_used_mib  # type: ignore[method-assign]
    out = io.StringIO()
    stop, wake = threading.Event(), threading.Event()
    error: BaseException | None = None
    try:
        run_loop(config, Given(probe, SimLauncher(gpu)), out, stop, wake)
    except GpuFailedError as caught:
        error = caught
    return [json.loads(line) for line in out.getvalue().splitlines()], error


def test_threaded_loop_holds_the_target_in_wall_clock_time() -> None:
    events, error = _threaded("--duration 3 --log-interval 1 --target 0.4")
    assert error is None
    statuses = [e for e in events if e["event"] == "status"]
    assert len(statuses) >= 2
    assert abs(statuses[-1]["util"] - 0.4) <= 0.05, statuses
    assert events[-1]["event"] == "stop" and events[-1]["reason"] == "duration reached"


def test_threaded_loop_pauses_at_once_on_the_switch_and_resumes() -> None:
    """The switch (SIGUSR1/SIGUSR2's) wakes the loop: the pause does not wait for the next poll (once a second
    here), and no kernel of ours starts after its line beyond what was already queued (the Worker's queue limit)."""
    config = load_config("--log-format json --duration 3 --poll-interval 1".split(), env={})
    gpu = SimGpu(config.sim, WallClock())
    switch = PauseSwitch()
    flips: list[float] = []
    started: list[float] = []

    def flipper() -> None:
        give_up_s = time.monotonic() + 30.0  # a run that never starts must not keep pytest from exiting
        for paused, at_s in ((True, 1.0), (False, 2.0)):
            while not started or time.monotonic() < started[0] + at_s:
                if time.monotonic() > give_up_s:
                    return
                time.sleep(0.005)
            flips.append(time.monotonic())
            switch.set(paused, "SIGUSR1" if paused else "SIGUSR2")

    thread = threading.Thread(target=flipper, daemon=True)
    thread.start()
    out = io.StringIO()
    runtimes: list[Runtime] = []

    def on_start(rt: Runtime) -> None:
        runtimes.append(rt)
        started.append(rt.start_s)

    run_loop(config, Given(SimProbe(gpu), SimLauncher(gpu)), out, threading.Event(), threading.Event(),
             Controls(switch), on_start=on_start)
    thread.join()
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    pause, unpause = (next(e for e in events if e["event"] == name) for name in ("pause", "unpause"))
    assert pause["reason"] == "SIGUSR1 (SIGUSR2 resumes)" and unpause["reason"] == "SIGUSR2"
    pause_s, unpause_s = started[0] + pause["t"], started[0] + unpause["t"]
    assert -0.001 <= pause_s - flips[0] < 0.5 and -0.001 <= unpause_s - flips[1] < 0.5  # t is to the ms
    # What was queued at the pause may still start: at most the Worker's queue and one kernel.
    queued_s = runtimes[0].worker.queue_s + max(b - a for a, b in zip(gpu._starts, gpu._ends))
    # The lines' t is rounded to the ms: the unpause's first kernel may start up to half a ms before its t.
    assert [s for s in gpu._starts if pause_s + queued_s + 0.001 < s < unpause_s - 0.001] == []
    assert any(s > unpause_s for s in gpu._starts)


def test_threaded_loop_ends_with_the_gpu_failure() -> None:
    events, error = _threaded("--duration 10", fail_after_s=0.5)
    assert isinstance(error, GpuFailedError)
    assert "was lost" in str(error)


class SlowProbe(SimProbe):
    """Every query takes `query_s`; notes any query made after close() or still running when close() came."""

    def __init__(self, gpu: SimGpu, query_s: float = 0.1) -> None:
        super().__init__(gpu)
        self.query_s = query_s
        self.closed = False
        self.in_query = 0
        self.misuse: list[str] = []

    def _query(self, name: str) -> None:
        if self.closed:
            self.misuse.append(f"{name} after close")
        self.in_query += 1
        time.sleep(self.query_s)
        self.in_query -= 1

    def memory_used_mib(self) -> float | None:
        self._query("memory_used_mib")
        return super().memory_used_mib()

    def processes(self) -> list[GpuProcess] | None:
        self._query("processes")
        return super().processes()

    def close(self) -> None:
        if self.in_query:
            self.misuse.append("close during a query")
        self.closed = True


class FailingLauncher(SimLauncher):
    def __init__(self, gpu: SimGpu, fail_after_s: float) -> None:
        super().__init__(gpu)
        self.fail_at_s = time.monotonic() + fail_after_s

    def launch(self, multiplier: int, now_s: float, count: int = 1) -> None:
        if time.monotonic() > self.fail_at_s:
            raise GpuFailedError("GPU 0 (GPU-test) failed: launch failed")
        super().launch(multiplier, now_s, count)


def test_after_a_gpu_failure_nvml_is_closed_only_once_the_monitor_has_stopped() -> None:
    config = load_config("--log-format json --duration 10".split(), env={})
    gpu = SimGpu(config.sim, WallClock())
    probe = SlowProbe(gpu)
    with pytest.raises(GpuFailedError):
        run_loop(config, Given(probe, FailingLauncher(gpu, fail_after_s=0.5)), io.StringIO(), threading.Event(),
                 threading.Event())
    time.sleep(0.2)  # a Monitor thread left running would query again by now
    assert probe.closed
    assert probe.misuse == []


def test_a_crash_in_the_monitor_thread_ends_the_run_with_that_error() -> None:
    config = load_config("--log-format json --duration 5".split(), env={})
    gpu = SimGpu(config.sim, WallClock())
    probe = SimProbe(gpu)
    crash_at_s = time.monotonic() + 0.5

    def processes() -> list[GpuProcess] | None:
        if time.monotonic() > crash_at_s:
            raise KeyError("a bug in a poll")
        return SimProbe.processes(probe)

    probe.processes = processes  # type: ignore[method-assign]
    started_s = time.monotonic()
    with pytest.raises(KeyError):
        run_loop(config, Given(probe, SimLauncher(gpu)), io.StringIO(), threading.Event(), threading.Event())
    assert time.monotonic() - started_s < 2.0  # at once, not at the end of the run


# What the filler's start path must not import without the setting that needs it: the metrics server's HTTP stack
# (FORGE_METRICS_PORT), the kubelet's gRPC (FORGE_KUBELET_SOCKET), and what only other commands use. Each costs
# start-up time (docs/benchmarks.md, "What the filler weighs").
NOT_ON_THE_START_PATH = ("forge_load.service.http_server", "forge_load.service.metrics", "wsgiref", "http.server",
                         "http.client", "email", "ssl", "socketserver", "prometheus_client",
                         "forge_load.service.kubelet", "forge_load.podresources", "grpc",
                         "forge_load.plot", "matplotlib", "forge_load.fleet", "docker")
SHOW_MODULES = ("import json, sys; from forge_load.cli import main; code = main(sys.argv[1:]); "
                "print(json.dumps({'exit': code, 'modules': sorted(sys.modules)}))")


def filler_modules(env: dict[str, str], tmp_path: Path, args: tuple[str, ...] = ("--simulate", "--sim-speed", "0"),
                   wrap: Callable[[dict[str, str]], dict[str, str]] = dict) -> set[str]:
    """The modules a filler's process holds once it has run a second and stopped (simulated unless `args` say
    otherwise; `wrap` puts a virtual GPU's variables into the environment)."""
    full_env = settings_free("TARGET")
    full_env.update(PYTHONPATH=str(ROOT), FORGE_HEARTBEAT_FILE=str(tmp_path / "heartbeat"),
                    FORGE_HOLD_DIR=str(tmp_path), **env)
    done = subprocess.run([sys.executable, "-c", SHOW_MODULES, *args, "--duration", "1"], capture_output=True,
                          text=True, env=wrap(full_env), timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    shown = json.loads(done.stdout.splitlines()[-1])
    assert shown["exit"] == 0, done.stderr[-2000:]
    return set(shown["modules"])


def test_the_start_path_imports_no_server_client_or_other_command_it_is_not_asked_for(tmp_path: Path) -> None:
    modules = filler_modules({}, tmp_path)
    loaded = [name for name in NOT_ON_THE_START_PATH if name in modules]
    assert loaded == [], f"imported on the filler's start path without their settings: {loaded}"


def test_the_metrics_server_is_imported_when_it_is_asked_for(tmp_path: Path) -> None:
    """The other side of the test above: the check sees the server's modules when FORGE_METRICS_PORT is set."""
    modules = filler_modules({"FORGE_METRICS_PORT": "0", "FORGE_METRICS_ADDR": "127.0.0.1"}, tmp_path)
    assert {"forge_load.service.http_server", "http.server"} <= modules
