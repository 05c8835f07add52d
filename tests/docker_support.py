"""Shared by the container and fleet tests: the Docker engine they use, or a clear skip.

The engine is the one DOCKER_HOST names (`scripts/docker_engine.sh start` prints it). Without one, the tests
marked `docker` are skipped and say why; with FORGE_REQUIRE_DOCKER=1 (set by `docker_engine.sh start` once it
has started an engine and built the image) a missing engine or image fails them instead, so a broken setup
can never pass as skipped.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
IMAGE = os.environ.get("FORGE_IMAGE", "forge-load:latest")
HINT = "start one with: out=$(scripts/docker_engine.sh start) && eval \"$out\""


def _unavailable(reason: str) -> None:
    if os.environ.get("FORGE_REQUIRE_DOCKER") == "1":
        pytest.fail(f"FORGE_REQUIRE_DOCKER=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def engine() -> Any:
    """A docker SDK client that has answered a ping (else skip, or fail under FORGE_REQUIRE_DOCKER=1)."""
    try:
        import docker
        from docker.errors import DockerException
    except ImportError:
        _unavailable("the Python docker SDK is not installed (pip install docker)")
    where = os.environ.get("DOCKER_HOST") or "the default socket (DOCKER_HOST is not set)"
    try:
        client = docker.from_env(timeout=60)
        client.ping()
    except DockerException as error:
        _unavailable(f"no Docker engine reachable at {where} ({str(error).splitlines()[0][:160]}); {HINT}")
    if shutil.which("docker") is None:
        _unavailable("the docker command-line client is not installed (the tests run the README's commands)")
    return client


def image(client: Any, name: str = IMAGE) -> Any:
    from docker.errors import ImageNotFound

    try:
        return client.images.get(name)
    except ImageNotFound:
        _unavailable(f"image {name} is not built on this engine; build it with: scripts/docker_engine.sh build "
                     "(or docker build -t forge-load .)")


def image_prune() -> ModuleType:
    """scripts/image_prune.py, which says what the image leaves out (LEAVE_OUT) and what the filler loads
    (RUNTIME_FILES)."""
    if "image_prune" not in sys.modules:
        spec = importlib.util.spec_from_file_location("image_prune", ROOT / "scripts" / "image_prune.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["image_prune"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["image_prune"]


def docker_cli(*args: str, timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess[str]:
    """The docker command line, as a person would type it."""
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=check)


def unique_name(stem: str) -> str:
    return f"forge_load_test_{stem}_{uuid.uuid4().hex[:8]}"


def remove_containers(client: Any, names: list[str] | None = None, name_prefix: str | None = None) -> None:
    """Best-effort cleanup of the containers a test made (by exact name, or every one with a name prefix)."""
    for container in client.containers.list(all=True):
        if (names and container.name in names) or (name_prefix and container.name.startswith(name_prefix)):
            try:
                container.remove(force=True)
            except Exception:  # noqa: BLE001 - cleanup: one that will not go must not hide the test's result
                pass


@pytest.fixture(scope="session")
def docker_client() -> Iterator[Any]:
    client = engine()
    yield client
    client.close()


@pytest.fixture(scope="session")
def forge_image(docker_client: Any) -> Any:
    return image(docker_client)
