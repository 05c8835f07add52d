#!/usr/bin/env bash
# forge_load's test command (the README's, and what CI runs): installs what the tests need, then runs them.
#
#   scripts/test.sh [pytest args...]
#
# Python packages go into a virtual environment ($FORGE_VENV, default .venv). Where this runs as root with
# apt-get (CI, a fresh machine), it also installs the system tools some tests use (a C compiler, a Docker engine,
# Prometheus, Slurm and munge, linters) and starts a private Docker engine for the container tests, stopped again at
# the end; FORGE_SKIP_SYSTEM_TOOLS=1 installs nothing with apt and starts no engine. Without them, those tests are
# skipped and say why.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
VENV=${FORGE_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}

say() { printf '[test] %s\n' "$*" >&2; }

if [[ ! -x "$VENV/bin/python" ]]; then
    say "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
say "installing Python requirements"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt -e .

# The virtual GPU's libraries (vgpu/) are compiled by the tests themselves; they need a C compiler.
if ! command -v cc >/dev/null 2>&1 && ! command -v gcc >/dev/null 2>&1; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1 && [[ "${FORGE_SKIP_SYSTEM_TOOLS:-0}" != 1 ]]; then
        say "installing gcc for the virtual GPU's libraries"
        if ! { apt-get update -qq >&2 &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev >&2; }; then
            say "WARNING: gcc could not be installed; the virtual-GPU tests will skip"
        fi
    else
        say "WARNING: no C compiler (cc or gcc); the virtual-GPU tests will skip"
    fi
fi

engine_started=0
if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1 && [[ "${FORGE_SKIP_SYSTEM_TOOLS:-0}" != 1 ]]; then
    for tools in scripts/install_test_tools.sh scripts/install_container_tools.sh; do
        "$tools" "$VENV" || say "WARNING: $tools did not finish; the tests that need those tools will skip"
    done
    if engine_env=$(scripts/docker_engine.sh start); then
        eval "$engine_env"
        engine_started=1
    else
        say "WARNING: no Docker engine could be started here; the container tests will skip"
    fi
fi
stop_engine() { if [[ $engine_started -eq 1 ]]; then scripts/docker_engine.sh stop || true; fi; }
trap stop_engine EXIT

export PATH="$VENV/bin:$PATH"
say "lint (ruff), types (mypy; strict on the pure modules) and the import layers (lint-imports): pyproject.toml"
"$VENV/bin/ruff" check .
"$VENV/bin/mypy"
"$VENV/bin/lint-imports" --no-logo
"$VENV/bin/python" -m pytest "$@"
