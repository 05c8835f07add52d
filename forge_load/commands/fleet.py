"""`forge-load fleet`: one forge_load container per GPU on this host, through the Docker engine.

    forge-load fleet up [--gpus all|0,1|GPU-...] [--target 0.5] [-e KEY=VALUE ...]
    forge-load fleet status
    forge-load fleet logs 0 [-f] [--tail 50]
    forge-load fleet down [--gpus ...]
    forge-load fleet watch [--hold-dir DIR] [--created-hold 60]

`up` starts a container named forge_load_gpu_<index> for each GPU, with a device request for exactly that
GPU (by UUID), the settings as environment, log rotation, a restart policy, --pid=host (so the filler sees
every process on its GPU and yields at once), the host's hold directory mounted (--hold-dir), and labels.
Run it again and it changes nothing that is already right: a container whose settings, image and GPU
match is left alone (started again if it had stopped); one that differs is recreated. `--simulate` runs the
filler on simulated GPUs (`--count N` of them) with no device request, for hosts without GPUs. Before it
creates anything, `up` checks the settings each container would get (--target, -e) with the filler's own
configuration code, so a value the filler would refuse never reaches a container that Docker restarts for
ever; a FORGE_ variable the filler does not know gets a one-line warning (a typo, most likely).

`watch` holds the GPUs of every container that asks for them, from its `create` until it dies or is removed
(forge_load/fleet/watch.py, docs/docker-watch.md). What each container should be is forge_load/fleet/plan.py's;
up, down, status and logs against the engine are forge_load/fleet/containers.py's.

The Docker engine is the one DOCKER_HOST names (else the default socket); the docker SDK is imported only by a
command that needs the engine. Exit codes (forge_load/exits.py): 0 done; 1 an error, said in one line (engine
unreachable or DOCKER_HOST malformed, the docker SDK missing, image missing, no such GPU, a container of our name
that is not ours, ...); 2 bad usage, or a setting the filler would refuse (one line); 130 interrupted (Ctrl-C).
scripts/forge_fleet.py runs this too, under its old name.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from forge_load.commands import host_gpus, shared
from forge_load.exits import EXIT_FLEET_FAILED, EXIT_FLEET_USAGE, EXIT_INTERRUPTED
from forge_load.fleet import watch
from forge_load.fleet.containers import cmd_down, cmd_logs, cmd_status, cmd_up
from forge_load.fleet.engine import FleetError, SettingsError, refusal
from forge_load.fleet.plan import DEFAULT_HOLD_DIR, DEFAULT_IMAGE, DEFAULT_PREFIX
from forge_load.log import say

PROG = "forge-load fleet"
DESCRIPTION = "one forge_load container per GPU on this host, through the Docker engine"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    # Where the commands name the tool (a warning's prefix, a hint): as it was called.
    parser.set_defaults(prog=prog, tool=prog.removesuffix(".py"))
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--image", default=DEFAULT_IMAGE,
                        help=f"image to run (default {DEFAULT_IMAGE}; env FORGE_IMAGE)")
    common.add_argument("--prefix", default=DEFAULT_PREFIX, help=f"container name prefix (default {DEFAULT_PREFIX})")
    common.add_argument("--simulate", action="store_true", help="simulated GPUs, no device requests")
    common.add_argument("--count", type=int, default=2, help="how many simulated GPUs with --simulate (default 2)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{up,down,status,logs,watch}")

    up = sub.add_parser("up", parents=[common], help="start (or bring up to date) one container per GPU")
    up.add_argument("--gpus", default="all", help="all (default), or a list of indices/UUIDs such as 0,1")
    up.add_argument("--target", help="FORGE_TARGET for every container, e.g. 0.5 or 50%% (default: the image's, 0.5)")
    up.add_argument("-e", "--env", action="append", default=[], metavar="KEY=VALUE",
                    help="more environment for the filler (repeatable), e.g. -e FORGE_LOG_FORMAT=json")
    up.add_argument("--restart", default="unless-stopped", choices=["no", "on-failure", "always", "unless-stopped"],
                    help="restart policy (default unless-stopped)")
    up.add_argument("--log-max-size", default="3m", help="json-file log rotation: size per file (default 3m)")
    up.add_argument("--log-max-file", type=int, default=3, help="json-file log rotation: files kept (default 3)")
    up.add_argument("--no-pid-host", dest="pid_host", action="store_false",
                    help="do not share the host's PID namespace (the filler then sees foreign jobs only by "
                         "their memory and utilization, not in the process list)")
    up.add_argument("--pause-dir", metavar="DIR",
                    help="a host directory mounted read-only into every container: the fillers pause while "
                         "DIR/pause exists (FORGE_PAUSE_FILE), e.g. written by a scheduler's prolog")
    up.add_argument("--hold-dir", metavar="DIR", default=DEFAULT_HOLD_DIR,
                    help="the host's hold directory (`forge-load hold`, docs/holds.md), mounted read-write into "
                         f"every container; none: not mounted (default {DEFAULT_HOLD_DIR})")
    up.set_defaults(func=cmd_up)

    down = sub.add_parser("down", parents=[common], help="stop and remove the containers")
    down.add_argument("--gpus", default="all", help="all (default), or a list of indices/UUIDs")
    down.set_defaults(func=cmd_down)

    status = sub.add_parser("status", parents=[common], help="one row per GPU: state, health, last status line")
    status.set_defaults(func=cmd_status)

    logs = sub.add_parser("logs", parents=[common], help="a GPU's container logs")
    logs.add_argument("gpu", help="GPU index (or container name)")
    logs.add_argument("-f", "--follow", action="store_true", help="follow the logs")
    logs.add_argument("--tail", type=int, default=-1, help="only the last N lines")
    logs.set_defaults(func=cmd_logs)

    watching = sub.add_parser("watch", help="hold the GPUs of every container that asks for them, from its create "
                                         "until it dies (docs/docker-watch.md)")
    watching.add_argument("--hold-dir", default=None,
                       help=f"the hold directory (default FORGE_HOLD_DIR, else {DEFAULT_HOLD_DIR})")
    watching.add_argument("--created-hold", type=float, default=60.0, metavar="SECONDS",
                       help="how long a container created and not started is held for (default 60)")
    watching.set_defaults(func=cmd_watch)
    return parser


def cmd_watch(args: argparse.Namespace, out: Any) -> int:
    """`watch`: its settings checked and the host's GPUs found here, with the other commands'; the loop over the
    engine is forge_load/fleet/watch.py's."""
    try:
        hold_dir = shared.hold_dir_of(args.hold_dir, os.environ)
    except shared.BadInput as error:
        raise SettingsError(str(error)) from None
    if not 0 < args.created_hold <= 86400:
        raise SettingsError(f"--created-hold={args.created_hold!r}: expected seconds above 0, at most 86400")
    uuids = host_gpus.host_uuids()
    if not uuids:
        raise FleetError("neither NVML nor /proc/driver/nvidia/gpus shows a GPU on this host: nothing to hold")
    return watch.run(hold_dir, uuids, args.created_hold, out)


def main(argv: Sequence[str] | None = None, out: Any = None, prog: str = PROG) -> int:
    tool = prog.removesuffix(".py")
    try:
        args = build_parser(prog).parse_args(argv)
        if getattr(args, "count", 1) < 1:
            say(f"{tool}: --count must be at least 1")
            return EXIT_FLEET_USAGE
        return int(args.func(args, out or sys.stdout))
    except KeyboardInterrupt:
        say(f"{tool}: interrupted; containers already created or changed stay as they are")
        return EXIT_INTERRUPTED
    except SettingsError as error:
        say(f"{tool}: {error}")
        return EXIT_FLEET_USAGE
    except FleetError as error:
        say(f"{tool}: {error}")
        return EXIT_FLEET_FAILED
    except Exception as error:
        line = refusal(error)
        if line is None:
            raise
        say(f"{tool}: {line}")
        return EXIT_FLEET_FAILED
