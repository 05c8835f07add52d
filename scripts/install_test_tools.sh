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

# apt_install WHAT PACKAGE...: Debian's packages, where this is root with apt-get. Their post-install scripts would
# start system services (a Prometheus on :9090, slurmd) where an init system runs; the tests start their own, so
# a policy keeps the packages' services from starting (only if no policy is in place already).
apt_install() {
    local what=$1 policy=/usr/sbin/policy-rc.d added_policy=0 ok=0
    shift
    if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
        say "WARNING: $what is missing and this is not root with apt-get; its tests will skip"
        return 1
    fi
    say "installing $what (Debian packages: $*)"
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && added_policy=1
    fi
    if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "$@" >/dev/null; then
        ok=1
    else
        say "WARNING: apt-get could not install $what; its tests will skip"
    fi
    if [[ $added_policy -eq 1 ]]; then rm -f "$policy"; fi
    [[ $ok -eq 1 ]]
}

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    say "prometheus already installed: $(prometheus --version 2>&1 | head -n 1)"
else
    apt_install prometheus prometheus || status=1
fi

have_slurm() {
    local tool
    for tool in slurmctld slurmd srun munged shellcheck; do
        command -v "$tool" >/dev/null 2>&1 || [[ -x /usr/sbin/$tool ]] || return 1
    done
}
if have_slurm; then
    say "slurm already installed: $(/usr/sbin/slurmd -V 2>&1 | head -n 1)"
else
    apt_install "slurm, munge and shellcheck" slurmctld slurmd slurm-client munge shellcheck || status=1
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
