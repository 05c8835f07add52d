"""forge_load/fleet/engine.py's one-line errors when the engine cannot be reached: where it looked, and only what
is true of DOCKER_HOST (not "not set" and "not usable" at once)."""

from __future__ import annotations

from typing import Any

import pytest

docker = pytest.importorskip("docker")

from forge_load.fleet import engine  # noqa: E402
from forge_load.fleet.engine import FleetError  # noqa: E402


def refuse(*args: Any, **kwargs: Any) -> Any:
    raise docker.errors.DockerException("Error while fetching server API version: connection refused")


def test_no_docker_host_and_no_engine_names_the_default_socket_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    monkeypatch.setattr(docker, "from_env", refuse)
    with pytest.raises(FleetError) as caught:
        engine.connect()
    message = str(caught.value)
    assert message == ("cannot reach the Docker engine at unix:///var/run/docker.sock (the default: DOCKER_HOST is "
                       "not set): is the engine running, and may this user use its socket? (Error while fetching "
                       "server API version: connection refused)")
    assert "not usable" not in message


def test_a_docker_host_that_fails_is_named_as_not_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "tcp://nowhere:2375")
    monkeypatch.setattr(docker, "from_env", refuse)
    with pytest.raises(FleetError) as caught:
        engine.connect()
    assert str(caught.value) == ("cannot reach the Docker engine at tcp://nowhere:2375 (DOCKER_HOST): it is not usable "
                                 "(Error while fetching server API version: connection refused)")
    assert "not set" not in str(caught.value)
