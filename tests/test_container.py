"""The image, for real: built by scripts/docker_engine.sh on a local engine, run with the README's commands.

Lint (hadolint, yamllint, shellcheck) runs wherever the tools are installed. The tests marked `docker` need a
Docker engine (DOCKER_HOST) and the image (FORGE_IMAGE, default forge-load:latest); without them they are
skipped and say why (see tests/docker_support.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from docker_support import (
    IMAGE,
    ROOT,
    docker_cli,
    docker_client,
    forge_image,
    image_prune,
    remove_containers,
    unique_name,
)

__all__ = ["docker_client", "forge_image"]  # fixtures, imported for pytest

MAX_IMAGE_MB = 800  # measured 722 MB on bookworm + Python 3.11 (docs/deploying.md, The image); a jump means a fat layer
STOP_LIMIT_S = 5.0  # docker stop's grace period is 10 s; the filler promises to exit within 1 s


# --- lint -----------------------------------------------------------------------------------------------------

def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        venv_bin = Path(sys.executable).parent / name
        path = str(venv_bin) if venv_bin.exists() else None
    if path is None:
        pytest.skip(f"{name} is not installed (scripts/install_container_tools.sh installs it)")
    return path


def _shell_scripts() -> list[Path]:
    scripts = sorted((ROOT / "scripts").glob("*.sh"))
    ci_run = ROOT / ".ci" / "run"
    if ci_run.exists():
        scripts.append(ci_run)
    return scripts


def test_hadolint_dockerfile() -> None:
    proc = subprocess.run([_tool("hadolint"), str(ROOT / "Dockerfile")], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"hadolint:\n{proc.stdout}{proc.stderr}"


def test_yamllint_compose_and_config() -> None:
    files = [str(ROOT / "docker-compose.yml"), str(ROOT / ".yamllint")]
    proc = subprocess.run([_tool("yamllint"), "--strict", "-c", str(ROOT / ".yamllint"), *files],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"yamllint:\n{proc.stdout}{proc.stderr}"


def test_shellcheck_scripts() -> None:
    scripts = _shell_scripts()
    assert scripts, "no shell scripts found under scripts/"
    proc = subprocess.run([_tool("shellcheck"), "--severity=style", *map(str, scripts)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"shellcheck:\n{proc.stdout}{proc.stderr}"


def test_compose_file_is_valid() -> None:
    """docker-compose.yml parses and merges into two GPU services (with Compose v1 or v2, if installed)."""
    if shutil.which("docker-compose"):
        cmd = ["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config"]
    elif shutil.which("docker") and subprocess.run(["docker", "compose", "version"],
                                                   capture_output=True, check=False).returncode == 0:
        cmd = ["docker", "compose", "-f", str(ROOT / "docker-compose.yml"), "config"]
    else:
        pytest.skip("neither docker-compose nor the docker compose plugin is installed")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    for index in (0, 1):
        assert f"forge_load_gpu_{index}" in proc.stdout
        assert "pid: host" in proc.stdout


def test_dockerignore_keeps_context_small() -> None:
    """The build context holds the package and its metadata only: no .git, venvs, tests."""
    rules = (ROOT / ".dockerignore").read_text().split()
    assert rules[rules.index("*")] == "*"  # everything excluded first, then the few files allowed back
    for needed in ("!pyproject.toml", "!requirements.txt", "!scripts/image_prune.py", "!forge_load/",
                   "!bin/forge-load"):  # the forge-load command, which checks TZ before Python starts
        assert needed in rules


# --- the image, run for real --------------------------------------------------------------------------------

@pytest.fixture
def names(docker_client: Any) -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    remove_containers(docker_client, names=made)


def _run(names: list[str], *args: str, env: dict[str, str] | None = None, stem: str = "c") -> str:
    """`docker run -d --name NAME [-e K=V ...] [args] forge-load [cmd...]`; returns the name."""
    name = unique_name(stem)
    names.append(name)
    env_args = [f"-e{k}={v}" for k, v in (env or {}).items()]
    proc = docker_cli("run", "-d", "--name", name, *env_args, *args, IMAGE)
    assert proc.returncode == 0, proc.stderr
    return name


def _logs(name: str) -> tuple[str, str]:
    proc = docker_cli("logs", name)
    return proc.stdout, proc.stderr


def _wait_for(predicate: Any, timeout_s: float, what: str, step_s: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _state(client: Any, name: str) -> dict[str, Any]:
    return client.api.inspect_container(name)["State"]


def _wait_exit(client: Any, name: str, timeout_s: float = 60) -> int:
    _wait_for(lambda: not _state(client, name)["Running"], timeout_s, f"{name} to exit")
    return int(_state(client, name)["ExitCode"])


@pytest.mark.docker
def test_image_metadata(docker_client: Any, forge_image: Any) -> None:
    config = forge_image.attrs["Config"]
    env = dict(item.split("=", 1) for item in config["Env"])
    assert config["Entrypoint"] == ["forge-load"], "exec form, so docker stop's SIGTERM reaches the filler"
    assert config["User"] not in ("", "0", "root", "0:0"), "the filler must not run as root"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert env["NVIDIA_REQUIRE_CUDA"] == "cuda>=12.0"  # the toolkit refuses drivers older than CUDA 12.0
    assert "NVIDIA_VISIBLE_DEVICES" not in env, "the GPU is chosen at docker run (--gpus device=N), not in the image"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert config["Healthcheck"]["Test"][:2] == ["CMD", "python"]
    labels = config["Labels"] or {}
    for key in ("org.opencontainers.image.title", "org.opencontainers.image.version",
                "org.opencontainers.image.revision", "org.opencontainers.image.licenses"):
        assert labels.get(key), f"label {key} missing"
    assert labels.get("io.forge_load.role") == "gpu-filler"  # every container of the image says what it is
    size_mb = forge_image.attrs["Size"] / 1e6
    print(f"image {IMAGE}: {size_mb:.0f} MB")
    assert size_mb < MAX_IMAGE_MB, f"image is {size_mb:.0f} MB, over the {MAX_IMAGE_MB} MB budget"


@pytest.mark.docker
def test_image_bundles_no_driver_libraries(docker_client: Any, forge_image: Any) -> None:
    """libcuda and libnvidia-ml must come from the host's driver (NVIDIA Container Toolkit), never the image."""
    out = docker_client.containers.run(
        IMAGE, entrypoint=["sh", "-c"],
        command=["find / -xdev \\( -name 'libcuda.so*' -o -name 'libnvidia-ml.so*' \\) -print; id -u"],
        remove=True).decode()
    lines = out.split()
    assert lines[-1] != "0", "the image's user is root"
    assert lines[:-1] == [], f"driver libraries bundled in the image: {lines[:-1]}"


@pytest.mark.docker
def test_the_image_holds_the_runtime_and_the_shipped_kernel_images_only(docker_client: Any, forge_image: Any) -> None:
    """The kernel comes compiled: every shipped image is in the image, intact (images_for checks each file's
    SHA-256), and no compiler is installed: no numba, llvmlite or CUDA compiler wheel (docs/deploying.md)."""
    code = ("import importlib.util, json\n"
            "from forge_load.gpu import burn_image\n"
            "manifest = burn_image.load_manifest()\n"
            "names = sorted({i.name for arch in manifest.cubin_arches\n"
            "                for i in burn_image.images_for((arch // 10, arch % 10), manifest)})\n"
            "present = [m for m in ('numba', 'numba_cuda', 'llvmlite', 'numpy', 'nvidia')\n"
            "           if importlib.util.find_spec(m)]\n"
            "print(json.dumps({'images': names, 'compilers': present}))\n")
    out = json.loads(docker_client.containers.run(IMAGE, entrypoint=["python", "-c", code], remove=True).decode())
    from forge_load.gpu import burn_image

    assert out["images"] == sorted([burn_image.PTX_NAME, *map(burn_image.cubin_name, burn_image.CUBIN_ARCHES)])
    assert out["compilers"] == [], f"the image holds a compiler: {out['compilers']}"


@pytest.mark.docker
def test_image_leaves_out_what_the_filler_never_loads(docker_client: Any, forge_image: Any) -> None:
    """No file that scripts/image_prune.py leaves out is in the image; every file the filler was measured to load
    (RUNTIME_FILES) is; and the pruned wheels' RECORDs list only files that exist (pip and importlib.metadata
    see the image as it is)."""
    prune = image_prune()
    rules = [[rule.dist, rule.pattern] for rule in prune.LEAVE_OUT]
    keep = [path for paths in prune.RUNTIME_FILES.values() for path in paths]
    code = ("import fnmatch, json, os, re, sys, sysconfig\n"
            "from importlib import metadata\n"
            "site = sysconfig.get_paths()['purelib']\n"
            "files = [os.path.relpath(os.path.join(d, f), site) for d, _, fs in os.walk(site) for f in fs]\n"
            "rules, keep = json.loads(sys.argv[1]), json.loads(sys.argv[2])\n"
            "norm = lambda name: re.sub(r'[-_.]+', '-', name).lower()\n"
            "owner = {os.path.relpath(str(f.locate()), site): norm(d.metadata['Name'])\n"
            "         for d in metadata.distributions() for f in d.files or []}\n"
            "# a file that matches a rule's glob but belongs to another distribution is not the rule's\n"
            "left = {p: [f for f in files if fnmatch.fnmatchcase(f, p) and owner.get(f, norm(d)) == norm(d)]\n"
            "        for d, p in rules}\n"
            "missing = [p for p in keep if not os.path.isfile(os.path.join(site, p))]\n"
            "listed = [str(f) for d in sorted({d for d, _ in rules}) for f in metadata.distribution(d).files or []\n"
            "          if not f.locate().exists()]\n"
            "print(json.dumps({'left': {p: f for p, f in left.items() if f}, 'missing': missing, 'listed': listed}))\n")
    out = docker_client.containers.run(IMAGE, entrypoint=["python", "-c", code, json.dumps(rules), json.dumps(keep)],
                                       remove=True).decode()
    found = json.loads(out)
    assert found["left"] == {}, f"left out by image_prune.py, yet in the image: {found['left']}"
    assert found["missing"] == [], f"the filler loads these, yet they are not in the image: {found['missing']}"
    assert found["listed"] == [], f"RECORD lists files that are not there: {found['listed'][:10]}"


@pytest.mark.docker
def test_simulated_container_logs_and_docker_stop(docker_client: Any, forge_image: Any, names: list[str]) -> None:
    """The README's run command in simulated mode: `start` and status lines in `docker logs`; `docker stop`
    ends it with exit code 0 well inside the grace period, after a `stop` line."""
    name = _run(names, "--log-opt", "max-size=3m", "--log-opt", "max-file=3",
                env={"FORGE_SIMULATE": "1", "FORGE_TARGET": "0.5", "FORGE_LOG_INTERVAL": "1"})
    def two_status_lines() -> str | None:
        out = _logs(name)[0]
        return out if out.count("event=status") >= 2 else None

    out = _wait_for(two_status_lines, 60, "two status lines in docker logs")
    lines = out.splitlines()
    assert lines[0].startswith("t=0.00 event=start"), lines[0]
    assert "target=0.500" in lines[0] and "simulated=true" in lines[0]
    assert _state(docker_client, name)["Running"]

    started = time.monotonic()
    proc = docker_cli("stop", name)
    took_s = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr
    state = _state(docker_client, name)
    print(f"docker stop took {took_s:.2f} s, exit code {state['ExitCode']}")
    assert state["ExitCode"] == 0, f"exit code {state['ExitCode']}; logs:\n{_logs(name)}"
    assert not state["OOMKilled"]
    assert took_s < STOP_LIMIT_S, f"docker stop took {took_s:.1f} s (grace period 10 s; promise: 1 s)"
    last = _logs(name)[0].strip().splitlines()[-1]
    assert "event=stop" in last and "SIGTERM" in last, last


@pytest.mark.docker
def test_the_container_names_itself_and_docker_kill_usr1_pauses_it(docker_client: Any, forge_image: Any,
                                                                    names: list[str]) -> None:
    """The operators' commands (docs/operating.md): the filler is PID 1 named `forge-load: gpu 0 filling`
    (setproctitle in the image), carries the role label, pauses on `docker kill -s USR1` and resumes on `-s USR2`,
    healthy throughout; the schedule's time zone is found in the image (tzdata)."""
    name = _run(names, "--health-interval=1s", "--health-start-period=0s",
                env={"FORGE_SIMULATE": "1", "FORGE_LOG_INTERVAL": "0.5", "FORGE_ACTIVE_HOURS": "Mon-Sun",
                     "TZ": "Europe/Berlin"})
    _wait_for(lambda: "event=status" in _logs(name)[0], 60, "a status line")

    def proc_file(path: str) -> str:
        out = docker_cli("exec", name, "python", "-c", f"print(open({path!r}, 'rb').read().rstrip(b'\\0').decode())")
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert _wait_for(lambda: proc_file("/proc/1/cmdline") == "forge-load: gpu 0 filling", 10, "the title")
    assert proc_file("/proc/1/comm") == "forge-load"
    labels = docker_client.api.inspect_container(name)["Config"]["Labels"]
    assert labels["io.forge_load.role"] == "gpu-filler"  # from the image: a container started by hand has it
    assert docker_cli("kill", "-s", "USR1", name).returncode == 0
    _wait_for(lambda: "event=pause" in _logs(name)[0], 30, "a pause line")
    assert _wait_for(lambda: proc_file("/proc/1/cmdline") == "forge-load: gpu 0 paused", 10, "the paused title")
    _wait_for(lambda: (_state(docker_client, name).get("Health") or {}).get("Status") == "healthy", 30,
              "healthy while paused")
    assert docker_cli("kill", "-s", "USR2", name).returncode == 0
    _wait_for(lambda: "event=unpause" in _logs(name)[0], 30, "an unpause line")
    assert _state(docker_client, name)["Running"]
    out = _logs(name)[0]
    assert 'reason="SIGUSR1 (SIGUSR2 resumes)"' in out and "reason=SIGUSR2" in out
    settings = out.splitlines()[1]  # the start line's second half: every setting
    assert settings.startswith("t=0.00 event=settings") and "active_hours=Mon-Sun" in settings, settings
    assert "tz=Europe/Berlin" in settings, settings


@pytest.mark.docker
def test_healthcheck_follows_the_loop(docker_client: Any, forge_image: Any, names: list[str]) -> None:
    """Healthy while the loop runs; unhealthy once it stalls (the process frozen with SIGSTOP)."""
    name = _run(names, "--health-interval=1s", "--health-start-period=0s", "--health-retries=1",
                "--health-timeout=5s", env={"FORGE_SIMULATE": "1", "FORGE_HEALTH_MAX_AGE": "3"})
    def health() -> str | None:
        return (_state(docker_client, name).get("Health") or {}).get("Status")

    _wait_for(lambda: health() == "healthy", 60, "the container to be healthy")
    assert docker_cli("kill", "--signal=SIGSTOP", name).returncode == 0
    try:
        _wait_for(lambda: health() == "unhealthy", 60, "the stalled container to turn unhealthy")
        log = _state(docker_client, name)["Health"]["Log"][-1]["Output"]
        assert "heartbeat" in log, log
    finally:
        docker_cli("kill", "--signal=SIGCONT", name)
    _wait_for(lambda: health() == "healthy", 60, "the resumed container to be healthy again")


@pytest.mark.docker
@pytest.mark.parametrize("value", ["abc", "1.5"])
def test_bad_target_exits_2_with_one_line(docker_client: Any, forge_image: Any, names: list[str],
                                           value: str) -> None:
    name = _run(names, env={"FORGE_SIMULATE": "1", "FORGE_TARGET": value}, stem="bad")
    assert _wait_exit(docker_client, name) == 2
    stdout, stderr = _logs(name)
    assert stdout == "", f"nothing on stdout expected, got {stdout!r}"
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got:\n{stderr}"
    assert "FORGE_TARGET" in lines[0] and value in lines[0], lines[0]
    assert "Traceback" not in stderr


@pytest.mark.docker
def test_legacy_target_percent(docker_client: Any, forge_image: Any, names: list[str]) -> None:
    """The original image's `-e TARGET=50` still works: the filler holds 0.5."""
    name = _run(names, env={"FORGE_SIMULATE": "1", "TARGET": "50", "FORGE_LOG_FORMAT": "json",
                            "FORGE_DURATION": "2", "FORGE_SIM_SPEED": "0"}, stem="legacy")
    assert _wait_exit(docker_client, name) == 0
    stdout, _ = _logs(name)
    events = [json.loads(line) for line in stdout.splitlines() if line.strip()]
    assert events[0]["event"] == "start" and events[0]["target"] == 0.5, events[0]
    assert events[-1]["event"] == "stop"


@pytest.mark.docker
def test_no_gpu_exits_3_with_hint(docker_client: Any, forge_image: Any, names: list[str]) -> None:
    """Not simulated and no GPU given to the container: exit 3 and a hint, not a traceback."""
    name = _run(names, stem="nogpu")
    assert _wait_exit(docker_client, name) == 3
    stdout, stderr = _logs(name)
    assert "no usable GPU" in stdout and "--simulate" in stdout and stderr == "", (stdout, stderr)  # said once
    assert "Traceback" not in stdout + stderr
