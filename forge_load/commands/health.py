"""`forge-load health` and `python -m forge_load.health`: whether the filler these settings name is alive, for
Docker's HEALTHCHECK, Kubernetes probes and operators. Its /health where the metrics server is on, else its heartbeat
file, judged by forge_load/service/health.py (where the heartbeat is written).

It reads its settings through forge_load.config, as the filler does: the same variables, the same checks, the same
refusals (a bad value makes it exit 1 with that one line). Exit codes (forge_load/exits.py): 0 healthy, 1 unhealthy;
never 2, which Docker reserves.
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import sys
from collections.abc import Sequence

from forge_load.config.cmdline import COMMANDS
from forge_load.config.load import build_arg_parser, load_config
from forge_load.config.settings import Config
from forge_load.config.values import ConfigError, url_host
from forge_load.exits import EXIT_HEALTHY, EXIT_UNHEALTHY
from forge_load.log import escape_controls, say
from forge_load.service import health as heartbeat


def health_address(config: Config) -> tuple[str, int] | None:
    """Where the filler's /health answers, when its metrics server is on at a known port: its listen address,
    or loopback when it listens on every address (0.0.0.0 or ::)."""
    if not config.metrics_port:  # off, or 0 (any free port): the port is not known here
        return None
    ip = ipaddress.ip_address(config.metrics_addr)
    if ip.is_unspecified:
        return ("127.0.0.1" if ip.version == 4 else "::1"), config.metrics_port
    return config.metrics_addr, config.metrics_port


def check_server(host: str, port: int, timeout_s: float = 4.0) -> tuple[bool, str]:
    where = f"http://{url_host(host)}:{port}/health"
    connection = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        connection.request("GET", "/health")
        response = connection.getresponse()
        body = response.read(64 * 1024).decode(errors="replace").strip()
    except (OSError, http.client.HTTPException) as error:
        return False, f"{where}: {error}"
    finally:
        connection.close()
    return response.status == 200, body or f"{where}: HTTP {response.status}"


HELP = """\
usage: python -m forge_load.health [FORGE-LOAD SETTINGS...]   (or: forge-load health ...)

Says whether the forge-load filler these settings name is alive: for Docker's HEALTHCHECK, Kubernetes probes
and operators. It takes the filler's own settings (the same FORGE_* variables and flags, checked the same way;
see forge-load --help), so give it those of the filler to judge.

What it checks:
  - with FORGE_METRICS_PORT set (not 0): that filler's /health, at FORGE_METRICS_ADDR (0.0.0.0 means
    127.0.0.1, :: means ::1), which judges every GPU's loop; it prints the answer (a verdict, a line per GPU);
  - otherwise: the heartbeat file that filler's loop touches about once a second (FORGE_HEARTBEAT_FILE, by
    default $TMPDIR/forge_load-<uid>/heartbeat-<the GPUs it fills>, /tmp without TMPDIR, or in a systemd
    unit's $RUNTIME_DIRECTORY), which must be a regular file of this user's and younger than
    FORGE_HEALTH_MAX_AGE seconds (default 30); it prints its age, or what is wrong. Where this user has no such
    file and /run/forge-load/ (the deploy unit's runtime directory) has one of that name, that one is judged.

Exit codes: 0 healthy; 1 unhealthy, or a setting the filler would refuse (said in one line). Never 2, which
Docker reserves.
"""


def build_parser(prog: str = "forge-load health") -> argparse.ArgumentParser:
    """For the completion and the man page: the filler's settings, which it takes to find that filler (main() reads
    them through load_config, and prints HELP for --help)."""
    parser = build_arg_parser()
    parser.prog, parser.description = prog, COMMANDS["health"][1]
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(HELP, end="")
        return EXIT_HEALTHY
    try:
        config = load_config(args)
    except ConfigError as error:
        say(f"forge_load.health: {error}")
        return EXIT_UNHEALTHY
    address = health_address(config)
    if address is not None:
        # With the metrics server on, /health knows every GPU's loop; the file only says one is alive.
        ok, message = check_server(*address)
    else:
        path, private = heartbeat.heartbeat_location(config)
        unit = heartbeat.unit_heartbeat(path, heartbeat.UNIT_RUNTIME_DIR) if private else None
        if unit is not None:  # the filler is the systemd unit, the caller an operator: its runtime directory
            ok, message = heartbeat.check_unit(unit, config.health_max_age_s)
        else:
            ok, message = heartbeat.check(path, config.health_max_age_s, private_dir=private)
            if not ok and private and (others := heartbeat.unit_heartbeats(heartbeat.UNIT_RUNTIME_DIR)):
                unit_dir = escape_controls(str(heartbeat.UNIT_RUNTIME_DIR))
                message += (f"; the systemd unit's filler keeps {', '.join(others)} in {unit_dir}: "
                            "give its GPU settings (such as --gpus all)")
    # The body from /health is a verdict line, then one line per GPU: Docker keeps it all.
    print("\n".join(escape_controls(line) for line in message.splitlines()) or "unhealthy")
    return EXIT_HEALTHY if ok else EXIT_UNHEALTHY
