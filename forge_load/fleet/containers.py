"""The containers of `forge-load fleet up|down|status|logs` (the command: forge_load/commands/fleet.py): one
forge_load container per GPU, started, brought up to date, listed and removed through the Docker engine (what each
container should be: plan.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from typing import Any

from forge_load.exits import EXIT_OK
from forge_load.fleet import engine
from forge_load.fleet.engine import FleetError, find_container, require_image, short
from forge_load.fleet.plan import (
    DEFAULT_HOLD_DIR,
    FILLER_GID,
    FILLER_UID,
    LABEL_FLEET,
    LABEL_GPU_INDEX,
    LABEL_GPU_UUID,
    STOP_TIMEOUT_S,
    Options,
    check_settings,
    container_name,
    desired,
    discover_gpus,
    parse_env,
    plan,
    run_kwargs,
    select_gpus,
)
from forge_load.log import say


def ours(client: Any, prefix: str) -> list[Any]:
    found = client.containers.list(all=True, filters={"label": f"{LABEL_FLEET}={prefix}"})
    return sorted(found, key=lambda c: int((c.labels or {}).get(LABEL_GPU_INDEX, "0") or 0))


def prepare_hold_dir(path: str) -> str | None:
    """Make a missing hold directory one the image's filler can write its acknowledgement in (1775, group 10001: the
    sticky bit keeps each writer from removing or renaming what another made, docs/holds.md);
    an existing one is its owner's decision: one warning where the filler cannot write it (`hold --wait` would
    then return before the drain). Returns that warning, or None."""
    try:
        if not os.path.isdir(path):
            os.makedirs(path, mode=0o755, exist_ok=True)
            os.chmod(path, 0o1775)
            os.chown(path, -1, FILLER_GID)
        st = os.stat(path)
    except OSError as error:
        return f"warning: --hold-dir {path}: {error.strerror or error}; holds need it (docs/holds.md)"
    writable = (st.st_uid == FILLER_UID and st.st_mode & 0o200 or st.st_gid == FILLER_GID and st.st_mode & 0o020
                or st.st_mode & 0o002)
    if writable:
        return None
    return (f"warning: --hold-dir {path} is not writable by the fillers (uid {FILLER_UID}): they honour holds but "
            f"cannot acknowledge a drain, so `forge-load hold --wait` returns at once; make it with "
            f"`install -d -m 1775 -g {FILLER_GID} {path}` (docs/holds.md)")


def cmd_up(args: argparse.Namespace, out: Any) -> int:
    opts = Options(image=args.image, prefix=args.prefix, simulate=args.simulate, target=args.target,
                   env=parse_env(args.env), restart=args.restart, log_max_size=args.log_max_size,
                   log_max_file=args.log_max_file, pid_host=args.pid_host, pause_dir=args.pause_dir,
                   hold_dir=None if args.hold_dir == "none" else args.hold_dir)
    if opts.pause_dir is not None and not opts.pause_dir.startswith("/"):
        raise FleetError(f"--pause-dir {opts.pause_dir!r}: expected an absolute path on the host, such as "
                         "/run/forge-load")
    if opts.hold_dir is not None and not opts.hold_dir.startswith("/"):
        raise FleetError(f"--hold-dir {opts.hold_dir!r}: expected an absolute path on the host, such as "
                         f"{DEFAULT_HOLD_DIR}, or none")
    for warning in check_settings(opts):
        say(f"{args.tool}: {warning}")
    client = engine.connect()
    image = require_image(client, args.image)
    if opts.hold_dir is not None and (hold_warning := prepare_hold_dir(opts.hold_dir)) is not None:
        say(f"{args.tool}: {hold_warning}")
    gpus = select_gpus(discover_gpus(args.simulate, args.count), args.gpus)
    for gpu in gpus:
        if gpu.mig_enabled:
            say(f"warning: GPU {gpu.index} ({gpu.uuid}) is in MIG mode: NVML reports no utilization there")
    # Decide everything before changing anything: a name collision stops the whole `up`.
    steps: list[tuple[Any, dict[str, Any], Any, str]] = []  # plan() recreates, starts or keeps only one found
    for gpu in gpus:
        spec = desired(gpu, opts, image.id)
        found = find_container(client, spec["name"])
        steps.append((gpu, spec, found, plan(found, spec)))
    for gpu, spec, existing, action in steps:
        if action == "recreate":
            existing.stop(timeout=STOP_TIMEOUT_S)
            existing.remove(force=True)
        if action in ("create", "recreate"):
            container = client.containers.run(**run_kwargs(spec))
        else:
            container = existing
            if action == "start":
                container.start()
        done = {"create": "created", "recreate": "recreated", "start": "started", "keep": "unchanged"}[action]
        print(f"gpu {gpu.index:<3} {spec['name']:<24} {done:<10} {container.short_id}", file=out)
    return EXIT_OK


def cmd_down(args: argparse.Namespace, out: Any) -> int:
    client = engine.connect()
    containers = ours(client, args.prefix)
    if args.gpus.strip().lower() != "all":
        wanted = {p.strip().lower() for p in args.gpus.split(",")}
        containers = [c for c in containers if {c.labels.get(LABEL_GPU_INDEX, ""),
                                                c.labels.get(LABEL_GPU_UUID, "").lower()} & wanted]
    if not containers:
        print("no forge_load containers to remove", file=out)
    for container in containers:
        started = time.monotonic()
        container.stop(timeout=STOP_TIMEOUT_S)
        took_s = time.monotonic() - started
        container.reload()
        code = container.attrs.get("State", {}).get("ExitCode")
        container.remove(force=True)
        print(f"gpu {container.labels.get(LABEL_GPU_INDEX, '?'):<3} {container.name:<24} removed    "
              f"(exit code {code}, stopped in {took_s:.1f} s)", file=out)
    return EXIT_OK


def last_status_line(container: Any) -> str:
    """The last status (or start/yield/resume/error/stop) line the filler logged, from `docker logs`."""
    try:
        raw: str = container.logs(tail=200, stdout=True, stderr=True).decode(errors="replace")
    except Exception as error:  # noqa: BLE001 - the engine may refuse logs for a container going away
        return f"(no logs: {short(error)})"
    lines = [line for line in raw.splitlines() if line.strip()]
    for wanted in ("status", None):
        for line in reversed(lines):
            if wanted is None or _event(line) == wanted:
                return line.strip()
    return "(no log lines yet)"


def _event(line: str) -> str | None:
    if line.lstrip().startswith("{"):
        try:
            return str(json.loads(line).get("event"))
        except (ValueError, AttributeError):
            return None
    m = re.search(r"(?:^|\s)event=(\S+)", line)
    return m.group(1) if m else None


def cmd_status(args: argparse.Namespace, out: Any) -> int:
    client = engine.connect()
    containers = ours(client, args.prefix)
    known = {c.labels.get(LABEL_GPU_INDEX) for c in containers}
    rows = []
    for c in containers:
        state = c.attrs.get("State", {})
        health = (state.get("Health") or {}).get("Status", "-")
        status = c.status if c.status != "exited" else f"exited({state.get('ExitCode')})"
        rows.append((c.labels.get(LABEL_GPU_INDEX, "?"), c.name, status, health, last_status_line(c)))
    if not args.simulate:
        try:  # GPUs with no container yet, where NVML answers; status works without it too
            for gpu in discover_gpus(False, 0):
                if str(gpu.index) not in known:
                    rows.append((str(gpu.index), container_name(args.prefix, gpu.index), "absent", "-", ""))
        except FleetError:
            pass
    if not rows:
        print(f"no forge_load containers (start them with: {args.prog} up)", file=out)
        return EXIT_OK
    rows.sort(key=lambda r: int(r[0]) if r[0].isdigit() else 1 << 30)
    print(f"{'GPU':<4} {'CONTAINER':<24} {'STATE':<12} {'HEALTH':<10} LAST STATUS", file=out)
    for gpu, name, status, health, line in rows:
        print(f"{gpu:<4} {name:<24} {status:<12} {health:<10} {line}", file=out)
    return EXIT_OK


def cmd_logs(args: argparse.Namespace, out: Any) -> int:
    client = engine.connect()
    name = args.gpu if not args.gpu.isdigit() else container_name(args.prefix, int(args.gpu))
    container = find_container(client, name)
    if container is None:
        raise FleetError(f"no container {name}: start it with `{args.prog} up --gpus {args.gpu}`")
    tail: Any = args.tail if args.tail >= 0 else "all"
    if not args.follow:
        out.write(container.logs(tail=tail).decode(errors="replace"))
        return EXIT_OK
    try:
        for chunk in container.logs(stream=True, follow=True, tail=tail):
            out.write(chunk.decode(errors="replace"))
            out.flush()
    except KeyboardInterrupt:
        pass
    return EXIT_OK
