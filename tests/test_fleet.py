"""forge_load/fleet (`forge-load fleet`): the plan it makes (no engine needed), then `--simulate up/status/logs/down`
for real against the Docker engine that DOCKER_HOST names (tests marked `docker`; skipped without one); and
scripts/forge_fleet.py, its first address, still running it from a checkout where forge_load is not installed."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from docker_support import ROOT, docker_client, forge_image, remove_containers, unique_name

from forge_load.commands.fleet import build_parser
from forge_load.fleet import containers, plan
from forge_load.fleet.engine import FleetError
from forge_load.fleet.plan import Gpu, Options

__all__ = ["docker_client", "forge_image"]  # fixtures, imported for pytest

SHIM = ROOT / "scripts" / "forge_fleet.py"
GPUS = [Gpu(0, "GPU-aaaa", "A"), Gpu(1, "GPU-bbbb", "B")]


def _opts(**changes: Any) -> Any:
    base = dict(image="forge-load:latest", prefix="forge_load_gpu_", simulate=False, target=None, env=(),
                restart="unless-stopped", log_max_size="3m", log_max_file=3, pid_host=True)
    base.update(changes)
    return Options(**base)


HOLD_DIR = tempfile.mkdtemp(prefix="forge-fleet-holds-")  # `up` mounts and makes it: the test host's /run is not ours


def run_fleet(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    if args[:1] == ("up",) and "--hold-dir" not in args:
        args = (*args, "--hold-dir", HOLD_DIR)
    """`forge-load fleet ...` as a process (`python -m forge_load`: the console script's code, from this checkout)."""
    return subprocess.run([sys.executable, "-m", "forge_load", "fleet", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, check=False, cwd=ROOT)


# --- the plan, without an engine ----------------------------------------------------------------------------

def test_select_gpus_all_list_and_uuid() -> None:
    assert plan.select_gpus(GPUS, "all") == GPUS
    assert plan.select_gpus(GPUS, "1,0") == [GPUS[1], GPUS[0]]
    assert plan.select_gpus(GPUS, "gpu-BBBB") == [GPUS[1]]
    assert plan.select_gpus(GPUS, "0,0") == [GPUS[0]]


@pytest.mark.parametrize("wanted", ["2", "GPU-cccc", "0,,1", "-1"])
def test_select_gpus_names_what_is_there(wanted: str) -> None:
    with pytest.raises(FleetError) as error:
        plan.select_gpus(GPUS, wanted)
    if wanted != "0,,1":
        assert "does not exist" in str(error.value) and "0 (GPU-aaaa), 1 (GPU-bbbb)" in str(error.value)


def test_spec_requests_exactly_its_gpu_with_rotation_restart_and_labels() -> None:
    spec = plan.desired(GPUS[1], _opts(target="0.3", env=plan.parse_env(["FORGE_LOG_FORMAT=json"])), "sha256:1")
    assert spec["name"] == "forge_load_gpu_1"
    assert spec["environment"] == {"FORGE_TARGET": "0.3", "FORGE_LOG_FORMAT": "json"}
    assert "FORGE_GPU" not in spec["environment"]  # inside the container its one GPU is index 0
    kwargs = plan.run_kwargs(spec)
    [request] = kwargs["device_requests"]
    assert request["DeviceIDs"] == ["GPU-bbbb"] and request["Capabilities"] == [["gpu"]]
    assert kwargs["log_config"]["Config"] == {"max-size": "3m", "max-file": "3"}
    assert kwargs["restart_policy"] == {"Name": "unless-stopped"}
    assert kwargs["pid_mode"] == "host"
    assert kwargs["labels"][plan.LABEL_GPU_UUID] == "GPU-bbbb"
    assert kwargs["labels"][plan.LABEL_FLEET] == "forge_load_gpu_"
    assert kwargs["labels"]["io.forge_load.role"] == "gpu-filler"  # as the image's own label says


def test_a_pause_dir_is_mounted_read_only_and_names_the_pause_file() -> None:
    plain = plan.desired(GPUS[0], _opts(), "sha256:1")
    assert "volumes" not in plain and "FORGE_PAUSE_FILE" not in plain["environment"]  # unchanged without one
    spec = plan.desired(GPUS[0], _opts(pause_dir="/run/forge-load/"), "sha256:1")
    assert spec["volumes"] == {"/run/forge-load/": {"bind": "/run/forge-load/", "mode": "ro"}}
    assert spec["environment"]["FORGE_PAUSE_FILE"] == "/run/forge-load/pause"
    assert plan.run_kwargs(spec)["volumes"] == spec["volumes"]
    assert spec["labels"][plan.LABEL_SPEC] != plain["labels"][plan.LABEL_SPEC]  # a change `up` recreates for


def test_the_hold_dir_is_mounted_read_write_beside_the_pause_dir() -> None:
    from forge_load.steering import holds

    assert plan.DEFAULT_HOLD_DIR == holds.DEFAULT_HOLD_DIR
    spec = plan.desired(GPUS[0], _opts(pause_dir="/run/forge-load", hold_dir=holds.DEFAULT_HOLD_DIR), "sha256:1")
    assert spec["volumes"] == {"/run/forge-load": {"bind": "/run/forge-load", "mode": "ro"},
                               holds.DEFAULT_HOLD_DIR: {"bind": holds.DEFAULT_HOLD_DIR, "mode": "rw"}}
    assert spec["environment"]["FORGE_HOLD_DIR"] == holds.DEFAULT_HOLD_DIR
    assert plan.run_kwargs(spec)["volumes"] == spec["volumes"]


def test_up_mounts_the_default_hold_dir_unless_told_none() -> None:
    parser = build_parser()
    assert parser.parse_args(["up"]).hold_dir == plan.DEFAULT_HOLD_DIR
    assert parser.parse_args(["up", "--hold-dir", "none"]).hold_dir == "none"


def test_up_makes_a_missing_hold_dir_one_the_fillers_can_acknowledge_in(tmp_path: Any) -> None:
    # The image's filler is uid/gid 10001: in a 0755 directory of root's (what dockerd makes of a missing bind
    # source) it could not write its acknowledgement, and `hold --wait` would return before the drain.
    assert f"USER {plan.FILLER_UID}:{plan.FILLER_GID}" in (ROOT / "Dockerfile").read_text()
    hold_dir = tmp_path / "run" / "holds"
    assert containers.prepare_hold_dir(str(hold_dir)) is None
    mode = hold_dir.stat().st_mode & 0o7777
    if os.geteuid() == 0:
        assert (hold_dir.stat().st_gid, mode) == (plan.FILLER_GID, 0o1775)  # sticky: none removes another's
    assert os.access(hold_dir, os.W_OK)


def test_up_warns_once_about_a_hold_dir_the_fillers_cannot_write_and_leaves_it_alone(tmp_path: Any) -> None:
    hold_dir = tmp_path / "holds"
    hold_dir.mkdir(mode=0o755)
    hold_dir.chmod(0o755)
    warning = containers.prepare_hold_dir(str(hold_dir))
    assert warning is not None and str(hold_dir) in warning and "install -d -m 1775 -g 10001" in warning
    assert "\n" not in warning
    assert hold_dir.stat().st_mode & 0o7777 == 0o755  # the owner's decision, not ours
    for writable in (0o775, 0o1777):
        hold_dir.chmod(writable)
        if writable == 0o775 and os.geteuid() == 0:
            os.chown(hold_dir, -1, plan.FILLER_GID)
        if writable == 0o775 and os.geteuid() != 0:
            continue
        assert containers.prepare_hold_dir(str(hold_dir)) is None


def test_simulated_spec_has_no_device_request() -> None:
    gpu = plan.discover_gpus(True, 3)[2]
    kwargs = plan.run_kwargs(plan.desired(gpu, _opts(simulate=True), "sha256:1"))
    assert "device_requests" not in kwargs
    assert kwargs["environment"]["FORGE_SIMULATE"] == "1"


def test_spec_hash_is_stable_and_tracks_what_matters() -> None:
    def h(gpu: Any, opts: Any, image: str = "sha256:1") -> str:
        return str(plan.desired(gpu, opts, image)["labels"][plan.LABEL_SPEC])

    assert h(GPUS[0], _opts()) == h(GPUS[0], _opts())
    assert h(GPUS[0], _opts()) != h(GPUS[0], _opts(target="0.4"))
    assert h(GPUS[0], _opts()) != h(GPUS[0], _opts(), image="sha256:2")  # a rebuilt image is rolled out
    assert h(GPUS[0], _opts()) != h(GPUS[0], _opts(pid_host=False))
    assert h(GPUS[0], _opts()) != h(GPUS[1], _opts())


def test_plan_create_keep_start_recreate_and_collision() -> None:
    spec = plan.desired(GPUS[0], _opts(), "sha256:1")
    def mine(status: str, labels: dict[str, str] = spec["labels"]) -> SimpleNamespace:
        return SimpleNamespace(labels=dict(labels), status=status)

    assert plan.plan(None, spec) == "create"
    assert plan.plan(mine("running"), spec) == "keep"
    assert plan.plan(mine("exited"), spec) == "start"
    assert plan.plan(mine("running", {**spec["labels"], plan.LABEL_SPEC: "old"}), spec) == "recreate"
    with pytest.raises(FleetError, match="not started by forge-load fleet"):
        plan.plan(SimpleNamespace(labels={"com.example": "x"}, status="running"), spec)


@pytest.mark.parametrize("item", ["NOEQUALS", "1BAD=x", "=x"])
def test_bad_env_item(item: str) -> None:
    with pytest.raises(FleetError, match="KEY=VALUE"):
        plan.parse_env([item])


def test_engine_unreachable_is_one_clear_line(tmp_path: Any) -> None:
    sock = f"unix://{tmp_path}/no-engine.sock"
    proc = run_fleet("up", "--simulate", env={"DOCKER_HOST": sock}, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"forge-load fleet: cannot reach the Docker engine at {sock}"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_no_nvml_without_simulate_says_use_simulate() -> None:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("this host has NVML: GPUs are found, nothing to report")
    except Exception:  # noqa: BLE001 - no NVML here, whatever pynvml raises
        pass
    with pytest.raises(FleetError, match="--simulate"):
        plan.discover_gpus(False, 0)


def test_usage_errors_exit_2() -> None:
    assert run_fleet("up", "--count", "0", "--simulate").returncode == 2
    assert run_fleet("frobnicate").returncode == 2


# --- as commands, in their own processes -----------------------------------------------------------------------

# The interpreter's start (the cuda-bindings wheel's .pth file) may already have put an empty `cuda` namespace in
# sys.modules: what counts is what the command adds.
_PROBE = """
import sys
before = set(sys.modules)
try:
    exec(sys.argv[1])
except SystemExit as stop:
    code = stop.code
heavy = sorted(m for m in set(sys.modules) - before
               if m.split(".")[0] in ("numba", "numba_cuda", "cuda", "numpy", "llvmlite"))
print("HEAVY", ",".join(heavy))
sys.exit(code)
"""
_FORGE_LOAD = "sys.argv = ['forge-load', *sys.argv[2:]]; from forge_load import cli; sys.exit(cli.main())"
_NVML = ("from forge_load.fleet import plan\ntry:\n    plan.discover_gpus(False, 0)\nexcept plan.FleetError:\n"
         "    pass\nsys.exit(7)")


def test_forge_load_fleet_imports_nothing_of_cuda_or_numba(tmp_path: Any) -> None:
    env = {**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"}
    for code, args, exit_code in ((_FORGE_LOAD, ["fleet", "--help"], 0),
                                  (_FORGE_LOAD, ["fleet", "up", "--simulate", "--hold-dir", str(tmp_path)], 1),
                                  (_FORGE_LOAD, ["fleet", "status"], 1),
                                  (_NVML, [], 7)):  # the GPUs through NVML (on a host with or without them)
        proc = subprocess.run([sys.executable, "-c", _PROBE, code, *args], capture_output=True, text=True,
                              env=env, cwd=ROOT, timeout=60, check=False)
        assert proc.returncode == exit_code, proc.stderr
        assert proc.stdout.splitlines()[-1] == "HEAVY ", (args, proc.stdout)


def test_the_old_script_runs_the_package_from_a_checkout_without_an_install(tmp_path: Any) -> None:
    # -S: no site-packages, so neither an installed forge_load nor the docker SDK.
    def shim(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-S", str(SHIM), *args], capture_output=True, text=True,
                              cwd=tmp_path, timeout=60, check=False)

    usage = shim("--help")
    assert usage.returncode == 0 and usage.stdout.startswith("usage: forge_fleet.py "), usage.stdout + usage.stderr
    status = shim("status")
    assert status.returncode == 1, status.stderr
    [line] = status.stderr.splitlines()
    assert line.startswith("forge_fleet: the Python docker SDK is missing") and "pip install docker" in line, line
    assert shim("up", "--count", "0", "--simulate").returncode == 2


def test_last_status_line_text_and_json() -> None:
    text = b"t=0.00 event=start target=0.5\nt=1.00 event=status util=0.5\nt=1.5 event=yield\n"
    json_ = b'{"t": 0, "event": "start"}\n{"t": 1, "event": "status", "util": 0.5}\n'
    assert containers.last_status_line(SimpleNamespace(logs=lambda **_: text)) == "t=1.00 event=status util=0.5"
    assert '"util": 0.5' in containers.last_status_line(SimpleNamespace(logs=lambda **_: json_))
    assert containers.last_status_line(SimpleNamespace(logs=lambda **_: b"t=0 event=start\n")) == "t=0 event=start"


# --- for real, on the engine --------------------------------------------------------------------------------

@pytest.fixture
def prefix(docker_client: Any, forge_image: Any) -> Iterator[str]:
    name_prefix = unique_name("fleet") + "_gpu_"
    yield name_prefix
    remove_containers(docker_client, name_prefix=name_prefix)


def _ids(client: Any, prefix: str) -> dict[str, str]:
    return {c.name: c.id for c in client.containers.list(all=True) if c.name.startswith(prefix)}


@pytest.mark.docker
def test_simulated_fleet_up_status_logs_down(docker_client: Any, prefix: str) -> None:
    common = ["--simulate", "--count", "2", "--prefix", prefix]
    up = run_fleet("up", *common, "--target", "0.4", "-e", "FORGE_LOG_INTERVAL=1")
    assert up.returncode == 0, up.stderr
    assert up.stdout.count("created") == 2, up.stdout
    first = _ids(docker_client, prefix)
    assert sorted(first) == [f"{prefix}0", f"{prefix}1"]
    container = docker_client.containers.get(f"{prefix}1")
    assert container.attrs["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped"
    assert container.attrs["HostConfig"]["LogConfig"]["Config"] == {"max-size": "3m", "max-file": "3"}
    assert container.attrs["HostConfig"]["PidMode"] == "host"
    assert not container.attrs["HostConfig"].get("DeviceRequests")  # simulated: no GPU asked for
    assert "FORGE_TARGET=0.4" in container.attrs["Config"]["Env"]
    # The host's hold directory, read-write (the filler acknowledges there): `watch` reaches it with no flag.
    assert f"{HOLD_DIR}:{HOLD_DIR}:rw" in container.attrs["HostConfig"]["Binds"]
    assert f"FORGE_HOLD_DIR={HOLD_DIR}" in container.attrs["Config"]["Env"]

    # A second `up` with the same settings changes nothing.
    again = run_fleet("up", *common, "--target", "0.4", "-e", "FORGE_LOG_INTERVAL=1")
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("unchanged") == 2, again.stdout
    assert _ids(docker_client, prefix) == first

    # status: one row per GPU, running, with the last status line each filler logged.
    deadline = time.monotonic() + 60
    while True:
        status = run_fleet("status", *common)
        assert status.returncode == 0, status.stderr
        rows = [line for line in status.stdout.splitlines()[1:] if line.strip()]
        if len(rows) == 2 and all("event=status" in row for row in rows) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert len(rows) == 2, status.stdout
    for index, row in enumerate(rows):
        assert row.split()[:3] == [str(index), f"{prefix}{index}", "running"], row
        assert "event=status" in row and "target=0.400" in row, row

    logs = run_fleet("logs", "0", *common, "--tail", "3")
    assert logs.returncode == 0 and "event=" in logs.stdout, logs.stdout + logs.stderr

    # A changed setting recreates the containers (new IDs); the rest is left as it was.
    changed = run_fleet("up", *common, "--gpus", "1", "--target", "0.3", "-e", "FORGE_LOG_INTERVAL=1")
    assert changed.returncode == 0, changed.stderr
    assert "recreated" in changed.stdout
    now = _ids(docker_client, prefix)
    assert now[f"{prefix}0"] == first[f"{prefix}0"] and now[f"{prefix}1"] != first[f"{prefix}1"]

    down = run_fleet("down", *common)
    assert down.returncode == 0, down.stderr
    assert down.stdout.count("removed") == 2 and down.stdout.count("exit code 0") == 2, down.stdout
    assert _ids(docker_client, prefix) == {}
    assert "no forge_load containers" in run_fleet("status", *common).stdout


@pytest.mark.docker
def test_up_refuses_a_container_that_is_not_ours(docker_client: Any, prefix: str) -> None:
    docker_client.containers.create("forge-load:latest", name=f"{prefix}1", command=["--simulate"])
    proc = run_fleet("up", "--simulate", "--count", "2", "--prefix", prefix)
    assert proc.returncode == 1
    assert f"a container named {prefix}1 exists and was not started by forge-load fleet" in proc.stderr, proc.stderr
    assert sorted(_ids(docker_client, prefix)) == [f"{prefix}1"], "nothing may be started when one name collides"


@pytest.mark.docker
def test_up_errors_image_missing_and_bad_gpu(docker_client: Any, prefix: str) -> None:
    proc = run_fleet("up", "--simulate", "--prefix", prefix, "--image", "forge-load:no-such-tag")
    assert proc.returncode == 1
    assert "image forge-load:no-such-tag is not on this engine" in proc.stderr, proc.stderr
    proc = run_fleet("up", "--simulate", "--count", "2", "--prefix", prefix, "--gpus", "0,5")
    assert proc.returncode == 1
    assert "GPU 5 does not exist" in proc.stderr, proc.stderr
    assert _ids(docker_client, prefix) == {}
    proc = run_fleet("logs", "7", "--prefix", prefix)
    assert proc.returncode == 1 and f"no container {prefix}7" in proc.stderr
