"""The fleet command's input: settings checked before the engine is touched, unknown variables, a malformed
DOCKER_HOST, Ctrl-C: one line each.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.hostile_support import ROOT, assert_one_clean_line


@pytest.mark.parametrize(("args", "name"), [
    (["--target", "1.5"], "FORGE_TARGET"),
    (["-e", "FORGE_LOG_INTERVAL=1e-20"], "FORGE_LOG_INTERVAL"),
    (["-e", "FORGE_SIM_SEED=" + "9" * 5000], "FORGE_SIM_SEED"),
    (["-e", "FORGE_METRICS_ADDR=fe80::1%x\nevent=stop"], "FORGE_METRICS_ADDR"),
])
def test_fleet_validates_settings_before_touching_the_engine(args: list[str], name: str,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from forge_load.commands import fleet as command
    from forge_load.fleet import engine

    def no_engine() -> None:
        raise AssertionError("the engine was contacted before the settings were checked")

    monkeypatch.setattr(engine, "connect", no_engine)
    assert command.main(["up", "--simulate", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert_one_clean_line(err.splitlines()[0], name)


def test_fleet_warns_about_an_unknown_variable(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from forge_load.commands import fleet as command
    from forge_load.fleet import engine

    def no_engine() -> None:
        raise engine.FleetError("no engine here")

    monkeypatch.setattr(engine, "connect", no_engine)
    assert command.main(["up", "--simulate", "-e", "FORGE_TARGE=0.9"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "FORGE_TARGET" in err[0] and "no engine here" in err[1], err


@pytest.mark.parametrize("docker_host", ["tcp://[::1", "tcp://:::", "tcp://host:notaport", "foo://bar"])
def test_fleet_malformed_docker_host_is_one_line(docker_host: str) -> None:
    result = subprocess.run([sys.executable, "-m", "forge_load", "fleet", "status"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "DOCKER_HOST": docker_host})
    assert result.returncode == 1, result
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and docker_host in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_fleet_ctrl_c_is_one_line_and_exit_130(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from forge_load.commands import fleet as command
    from forge_load.fleet import engine

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "connect", interrupted)
    assert command.main(["status"]) == 130
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "interrupted" in err[0], err
