#!/usr/bin/env bash
# Installs the tools the cluster tests use, and does nothing for those already there:
#   - Prometheus and promtool: Debian's `prometheus` package (tests/test_prometheus.py, tests/test_deploy.py);
#   - a single-node Slurm: Debian's `slurmctld`, `slurmd`, `slurm-client` and `munge`, with `shellcheck` for the
#     prolog and epilog (tests/test_slurm.py starts its own daemons on a temporary configuration);
#   - yamllint and kubernetes-validate: pip, into the given virtual environment (tests/test_deploy.py).
#
#   scripts/install_test_tools.sh [VENV]      (default: $FORGE_VENV, else .venv)
#
# apt-get needs root; without it, Prometheus and Slurm are left out and their tests skip, saying why. Exits
# non-zero when something could not be installed.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${1:-${FORGE_VENV:-$ROOT/.venv}}
YAMLLINT_VERSION=1.38.0
KUBERNETES_VALIDATE_VERSION=1.37.0
status=0

say() { printf '[install_test_tools] %s\n' "$*" >&2; }

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    say "prometheus already installed: $(prometheus --version 2>&1 | head -n 1)"
elif [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    say "WARNING: prometheus is missing and this is not root with apt-get; its tests will skip"
    status=1
else
    say "installing prometheus (Debian package)"
    # The package's post-install would start a system Prometheus on :9090 where an init system runs; the
    # tests start their own on a free port, so keep the package's service from starting (only if no
    # policy is in place already).
    policy=/usr/sbin/policy-rc.d
    added_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && added_policy=1
    fi
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            prometheus >/dev/null; }; then
        say "WARNING: apt-get could not install prometheus; its tests will skip"
        status=1
    fi
    if [[ $added_policy -eq 1 ]]; then rm -f "$policy"; fi
fi

have_slurm() {
    local tool
    for tool in slurmctld slurmd srun munged shellcheck; do
        command -v "$tool" >/dev/null 2>&1 || [[ -x /usr/sbin/$tool ]] || return 1
    done
}
if have_slurm; then
    say "slurm already installed: $(/usr/sbin/slurmd -V 2>&1 | head -n 1)"
elif [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    say "WARNING: slurm, munge or shellcheck is missing and this is not root with apt-get; their tests will skip"
    status=1
else
    say "installing slurmctld, slurmd, slurm-client, munge and shellcheck (Debian packages)"
    # As for Prometheus: the packages' services must not start (the tests run their own daemons).
    policy=/usr/sbin/policy-rc.d
    added_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && added_policy=1
    fi
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            slurmctld slurmd slurm-client munge shellcheck >/dev/null; }; then
        say "WARNING: apt-get could not install slurm, munge or shellcheck; their tests will skip"
        status=1
    fi
    if [[ $added_policy -eq 1 ]]; then rm -f "$policy"; fi
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    say "WARNING: no virtual environment at $VENV; yamllint and kubernetes-validate not installed"
    exit 1
fi
say "installing yamllint $YAMLLINT_VERSION and kubernetes-validate $KUBERNETES_VALIDATE_VERSION into $VENV"
if ! "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
        "yamllint==$YAMLLINT_VERSION" "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"; then
    say "WARNING: pip could not install yamllint / kubernetes-validate; their tests will skip"
    status=1
fi
exit $status
