#!/usr/bin/env bash
# Shows, by hand, what tests/test_prometheus.py checks: a real Prometheus on localhost scrapes a simulated
# three-GPU forge_load (GPU 0 filling, GPU 1 yielding to a foreign job, GPU 2 lost), and PromQL answers.
#
#   scripts/prometheus_check.sh [PYTHON]     (default: .venv/bin/python, else python3)
#
# Needs Prometheus (scripts/install_test_tools.sh) and prometheus_client. Takes about ten seconds.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PYTHON=${1:-}
if [[ -z $PYTHON ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
exec "$PYTHON" -m tests.prometheus_harness
