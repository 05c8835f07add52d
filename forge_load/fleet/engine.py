"""The Docker engine, through the Python docker SDK: connected to here, the SDK imported (here and in the other
modules) only inside the functions that use the engine, so `forge-load fleet --help` and a bad flag work on a host
without the SDK, and a command that needs it says so in one line. The errors every command reports in one line
(said by forge_load.log.say).
"""

from __future__ import annotations

import os
from typing import Any


class FleetError(Exception):
    """A failure to tell the user in one line; exit code 1."""


class SettingsError(Exception):
    """A setting the filler would refuse, or bad input, in one line; exit code 2."""


def connect() -> Any:
    """A docker SDK client that has answered a ping, or a FleetError saying where it looked."""
    try:
        import docker
        from docker.errors import DockerException
    except ImportError as error:
        raise FleetError(f"the Python docker SDK is missing ({error}): pip install docker") from error
    host = os.environ.get("DOCKER_HOST")
    where = f"{host} (DOCKER_HOST)" if host else "unix:///var/run/docker.sock (the default: DOCKER_HOST is not set)"
    try:
        client = docker.from_env(timeout=30)
    except (DockerException, ValueError) as error:  # ValueError: a DOCKER_HOST urllib cannot parse
        # The SDK asks the engine its API version here: with no DOCKER_HOST, the default socket is what failed.
        why = ("it is not usable" if host
               else "is the engine running, and may this user use its socket?")
        raise FleetError(f"cannot reach the Docker engine at {where}: {why} ({short(error)})") from error
    try:
        client.ping()
    except (DockerException, OSError) as error:
        raise FleetError(f"cannot reach the Docker engine at {where}: {short(error)}") from error
    return client


def require_image(client: Any, image: str) -> Any:
    from docker.errors import ImageNotFound

    try:
        return client.images.get(image)
    except ImageNotFound:
        raise FleetError(f"image {image} is not on this engine: build it first with "
                         f"`docker build -t {image.split(':')[0]} .` in the forge_load repository") from None


def find_container(client: Any, name: str) -> Any | None:
    from docker.errors import NotFound

    try:
        return client.containers.get(name)
    except NotFound:
        return None


def refusal(error: Exception) -> str | None:
    """The one line for an error the engine answered with (a docker SDK DockerException); None for any other."""
    try:
        from docker.errors import DockerException
    except ImportError:
        return None
    if not isinstance(error, DockerException):
        return None
    text = getattr(error, "explanation", None) or short(error)
    hint = ""
    if "device driver" in str(text) and "gpu" in str(text):
        hint = (" (no GPU support in this engine: install the NVIDIA Container Toolkit and run "
                "`nvidia-ctk runtime configure --runtime=docker`, or use --simulate)")
    return f"the Docker engine refused: {text}{hint}"


def short(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
