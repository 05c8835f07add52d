"""main(): the configuration, the signals, the heartbeat, the metrics server and the kubelet, the exit codes.

Exit codes: 0 stopped normally (a signal, or FORGE_DURATION); 1 internal error (a bug: the line says so);
2 bad configuration (a setting, or the host's limit on open files below MIN_OPEN_FILES: `ulimit -n`); 3 no
usable GPU or NVML (with a hint); 4 the GPU failed while running; 5 the log could not be written (stdout closed
or full): the fillers stopped as for a signal, and stderr says so in one line.

With FORGE_GPUS (several GPUs), each GPU runs its own filler in its own thread and a failing GPU stops only
its own: the others keep filling and /health reports it. The process exits when every filler has ended:
3 if no GPU could be opened at all, 4 if any GPU failed (1 if that was a bug), 2 if the only ones that did not run
are GPUs another filler of this user on this host fills already (one filler per GPU: service/health.py), else 0.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import TYPE_CHECKING, TextIO, cast

from forge_load.config.load import load_settings
from forge_load.config.settings import Config
from forge_load.config.values import ConfigError, url_host
from forge_load.control.filler import Controls
from forge_load.control.probe import NoGpuError
from forge_load.control.status import GpuSlots
from forge_load.exits import EXIT_CONFIG, EXIT_INTERNAL, EXIT_LOG_LOST, EXIT_NO_GPU, EXIT_OK
from forge_load.log import EventLog, LogStream, escape_controls, internal_error, say, to_devnull
from forge_load.service import health
from forge_load.service.gpu_threads import run_gpus
from forge_load.service.runtime import StopEvent, open_files_limit, request_stop, stop_reason
from forge_load.service.title import ProcessTitle
from forge_load.service.title import describe as describe_title
from forge_load.service.unix_signals import StopSignals
from forge_load.steering.hold_watch import HoldBoard
from forge_load.steering.pause import PauseSwitch

if TYPE_CHECKING:
    from forge_load.service.http_server import MetricsServer

# The open files the filler needs at least: a GPU's CUDA start took 16 on the virtual GPU (numba's sources, the
# libraries); the rest is room for the driver's device files, the pause file, the heartbeat and the metrics server.
MIN_OPEN_FILES = 64


def install_signals(stop: StopEvent, wake: threading.Event,
                    signals: StopSignals | None = None, switch: PauseSwitch | None = None) -> StopSignals:
    """SIGTERM, SIGINT and SIGHUP stop the fillers (see forge_load.cli), SIGUSR1 and SIGUSR2 pause and resume them;
    `signals` when already installed."""
    signals = signals or StopSignals.install()
    signals.watch(lambda name: request_stop(stop, wake, f"signal {name}"),
                  None if switch is None else switch.set)
    return signals


def main(argv: list[str] | None = None, stream: TextIO | None = None, signals: StopSignals | None = None,
         title: ProcessTitle | None = None) -> int:
    """The process: `signals` are the stop and pause signals forge_load.cli caught first; without them (main()
    called on its own) they are installed here and put back on return. `title` names the process after its
    GPUs and their states (the forge-load command's; left alone when None)."""
    stop, wake = StopEvent(), threading.Event()
    switch = PauseSwitch()
    installed = install_signals(stop, wake, signals, switch)
    try:
        return _main(argv, stream or sys.stdout, stop, wake, switch, title)
    finally:
        if signals is None:
            installed.restore()


def _main(argv: list[str] | None, out: TextIO, stop: StopEvent, wake: threading.Event,
          switch: PauseSwitch | None = None, title: ProcessTitle | None = None) -> int:
    if title is not None:
        title.set(describe_title([]))
    try:
        config, warnings = load_settings(argv)
    except ConfigError as error:
        say(f"forge-load: {error}")
        return EXIT_CONFIG
    for warning in warnings:
        say(f"forge-load: {warning}")
    limit = open_files_limit()
    if limit is not None and limit < MIN_OPEN_FILES:
        say(f"forge-load: this process may open {limit} files (the host's or container's limit, RLIMIT_NOFILE: "
            f"`ulimit -n`), fewer than the {MIN_OPEN_FILES} it needs: raise it (`docker run --ulimit "
            "nofile=1024`, LimitNOFILE= in a systemd unit)")
        return EXIT_CONFIG
    # Every line goes through one LogStream: a write that fails stops the fillers instead of raising in them.
    log_stream = LogStream(out, lambda error: request_stop(stop, wake, "stdout could not be written"))
    log_out = cast(TextIO, log_stream)
    error_log = EventLog(config.log_format, log_out, clock=time.monotonic, start_s=time.monotonic())
    path, private = health.heartbeat_location(config)
    beat = health.Heartbeat(path, private_dir=private, on_refused=lambda why: say(
        f"forge-load: warning: heartbeat not written: {why}; `python -m forge_load.health` reports unhealthy"))
    holder = beat.claim()
    if holder is not None and not config.simulate and (missing := no_gpu()) is not None:
        # No GPU here at all: that, not the other filler, is why this one cannot run (exit 3, as without it). Asked
        # only now: NVML's start is dear, and without a conflict the GPU's own opening says the same.
        return _no_gpu(error_log, config, missing, log_stream, out)
    if holder is not None:  # another filler of this user holds this heartbeat (docs: forge_load/service/health.py)
        same = (f"the heartbeat {escape_controls(str(path))} of the same GPUs ({health.heartbeat_name(config)})"
                if private else f"FORGE_HEARTBEAT_FILE={escape_controls(str(path))}")
        if not config.simulate:
            say(f"forge-load: another forge-load (pid {holder}) already runs with {same}: two fillers on one GPU "
                "only yield to each other, and the health check cannot tell them apart; stop that one, or give this "
                "one other GPUs (FORGE_GPU, FORGE_GPUS) or its own FORGE_HEARTBEAT_FILE")
            return EXIT_CONFIG
        say(f"forge-load: warning: another forge-load (pid {holder}) already runs with {same}: this one writes no "
            "heartbeat, and `python -m forge_load.health` with these settings judges that one")
        beat.writes = False
    gpu_slots = GpuSlots(config.health_max_age_s, simulated=config.simulate)
    try:
        board = start_kubelet(config, error_log, stop)
    except ConfigError as error:
        say(f"forge-load: {error}")
        return EXIT_CONFIG
    controls = Controls(switch, None if title is None else lambda: title.set(describe_title(gpu_slots.slots)), board,
                        heartbeat=beat)
    if config.pause_file is not None and not os.path.isdir(os.path.dirname(config.pause_file)):
        say(f"forge-load: warning: FORGE_PAUSE_FILE={config.pause_file}: its directory does not exist (yet), so "
            "the file cannot appear: is the directory mounted?")
    server: MetricsServer | None = None
    if config.metrics_port is not None:
        # Imported only here: the HTTP stack (http.server, email, ssl...) adds tens of milliseconds to every start,
        # and most fillers serve no metrics (docs/benchmarks.md, "What the filler weighs").
        from forge_load.service import http_server

        try:
            server = http_server.serve(gpu_slots, config.metrics_addr, config.metrics_port)
        except ConfigError as error:
            say(f"forge-load: {error}")
            return EXIT_CONFIG
        error_log.emit("metrics", listen=f"{url_host(server.addr)}:{server.port}", port=server.port,
                       paths="/metrics,/health")
    try:
        if stop.is_set():  # a signal (or a dead stdout) during start-up: no GPU is opened at all
            error_log.emit("stop", state="starting", reason=stop_reason(stop))
            code = EXIT_OK
        else:
            code = run_gpus(config, log_out, stop, wake, gpu_slots, controls)  # one GPU: one slot
            if controls.on_transition is not None:
                controls.on_transition()  # stopped or failed, for the last moments
    except NoGpuError as error:  # FORGE_GPUS=all and NVML shows none
        code = _no_gpu(error_log, config, str(error), log_stream, out)
    except Exception as error:  # noqa: BLE001 - a bug: one line, not a traceback in docker logs
        error_log.emit("error", reason=internal_error(error),
                       exit_code=EXIT_INTERNAL)
        code = EXIT_INTERNAL
    finally:
        beat.clear()
        if server is not None:
            server.close()
    return _log_checked(code, log_stream, out)


def _no_gpu(log: EventLog, config: Config, why: str, log_stream: LogStream, out: TextIO) -> int:
    """No GPU for any filler: one `error` line in the log, as a GPU that cannot be opened says it (and nothing on
    stderr, which `docker logs` and journald show beside it: it would be said twice); exit 3."""
    requested = config.gpu if config.gpus is None else config.gpus if config.gpus == "all" else ",".join(config.gpus)
    log.emit("error", reason=f"no usable GPU: {why}", gpu=None, uuid=None, gpu_requested=requested,
             exit_code=EXIT_NO_GPU)
    return _log_checked(EXIT_NO_GPU, log_stream, out)


def no_gpu() -> str | None:
    """Why this host has no GPU for a filler (no NVML, or NVML shows none); None when it has one."""
    from forge_load.gpu import nvml

    try:
        return None if nvml.device_uuids() else "NVML shows no GPU on this host"
    except NoGpuError as error:
        return str(error)


def start_kubelet(config: Config, log: EventLog, stop: threading.Event) -> HoldBoard | None:
    """With FORGE_KUBELET_SOCKET: the thread that holds what the kubelet assigns (service/kubelet.py), and the
    board it keeps; this filler's own pod (POD_NAMESPACE, POD_NAME from the downward API) is never held for."""
    if config.kubelet_socket is None:
        return None
    try:
        from forge_load.podresources import api_pb2_grpc  # noqa: F401 - grpcio, checked before any GPU is opened
        from forge_load.service import kubelet
    except ImportError as error:
        raise ConfigError(f"FORGE_KUBELET_SOCKET={config.kubelet_socket} needs the grpcio and protobuf packages "
                          f"({error}): pip install 'forge-load[kubernetes]', or unset it") from None
    own_pod = None
    if os.environ.get("POD_NAME"):
        own_pod = (os.environ.get("POD_NAMESPACE", ""), os.environ["POD_NAME"])
    board = HoldBoard()
    client = kubelet.KubeletHolds(config.kubelet_socket, board, lambda line: log.emit("kubelet", reason=line),
                                  kubelet.nvml_resolver() if not config.simulate else kubelet.simulated_resolver,
                                  own_pod=own_pod,
                                  resolve_dra=kubelet.nvml_dra_resolver() if not config.simulate
                                  else kubelet.simulated_dra_resolver)
    log.emit("kubelet", socket=config.kubelet_socket, own_pod="/".join(own_pod) if own_pod else None,
             poll_s=client.poll_s)
    client.start(stop)
    return board


def _log_checked(code: int, log_stream: LogStream, out: TextIO) -> int:
    """`code`, or EXIT_LOG_LOST (said in one line on stderr) when the log could not be written."""
    if log_stream.failure is None:
        return code
    to_devnull(out)
    why = log_stream.failure.strerror or str(log_stream.failure)
    say(f"forge-load: stdout could not be written ({why}): the fillers were stopped, their kernels finished")
    return EXIT_LOG_LOST if code == EXIT_OK else code
