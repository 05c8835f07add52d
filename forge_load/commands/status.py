"""`forge-load status [--json] [--watch SECONDS] [--hold-dir DIR] [--runtime-dir DIR]`: every filler of this host,
one row per GPU and user, from the status files they write in their own directories (steering/filler_status.py): in
the hold directory, and where a filler has none there (no hold directory, as right after the quick start), in its
runtime directory: /run/forge-load (root's, and the systemd unit's) and the caller's own (FORGE_RUNTIME_DIR, or
filler_dirs.default_runtime_dir). Any user may run it: no Docker, no root, no GPU library, nothing but those files
and /proc.

Exit codes (forge_load/exits.py): 0 shown (no filler at all too); 2 bad input (one line naming the flag, the value
and what is accepted), or a hold directory given (flag or variable) that is missing or not a directory: a typo must
not read as "no filler".
"""

from __future__ import annotations

import json
import os
import pwd
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from forge_load.commands.host_gpus import PROC_GPUS, proc_uuids
from forge_load.commands.shared import BadInput, dir_of, hold_dir_of, seconds, shown
from forge_load.config.cmdline import ArgParser, UsageError
from forge_load.exits import EXIT_BAD_INPUT, EXIT_OK
from forge_load.log import escape_controls, say
from forge_load.steering import filler_status
from forge_load.steering.filler_dirs import HOST_RUNTIME_DIR, default_runtime_dir
from forge_load.steering.filler_status import Seen
from forge_load.steering.holds import DEFAULT_HOLD_DIR

MIN_WATCH_S, MAX_WATCH_S = 0.1, 3600.0
CLEAR = "\x1b[H\x1b[2J"  # what watch(1) does between two rounds, on a terminal only
MAX_CELL = 40  # a cell of the table at most this wide (a UUID's 40): no row widens every row


def parse_watch(raw: str) -> float:
    return seconds("--watch", raw, MIN_WATCH_S, MAX_WATCH_S)


@dataclass(frozen=True)
class Row:
    """A filler's status as shown: `index` is the host's index of its GPU where the driver's /proc files know the
    UUID (a filler in a container given one GPU calls it 0), else the filler's own."""

    seen: Seen
    index: int


def read(hold_dir: str, flag: str, proc_root: str = PROC_GPUS, runtime_dirs: tuple[str, ...] = ()
         ) -> tuple[list[Row], list[str]]:
    """The fillers' statuses, by the host's GPU index; BadInput (exit 2) when a hold directory that was given is
    missing or not a directory."""
    if flag != "--hold-dir (default)" and not os.path.isdir(hold_dir):
        what = "not a directory" if os.path.lexists(hold_dir) else "no such directory"
        raise BadInput(f"{flag}={shown(hold_dir)}: {what}; expected the fillers' hold directory (fillers without "
                       "one report in their runtime directory, which status reads too: --runtime-dir)")
    seen, problems = filler_status.read_all([hold_dir, *runtime_dirs])
    host = {uuid.upper(): index for index, uuid in enumerate(proc_uuids(proc_root))} if seen else {}
    rows = [Row(s, host.get(s.status.gpu_uuid.upper(), s.status.gpu_index)) for s in seen]
    rows.sort(key=lambda row: (row.index, row.seen.status.gpu_uuid, row.seen.uid))
    return rows, problems


def user_name(uid: int) -> str:
    if uid < 0:
        return "-"
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return str(uid)


def _cell(text: str) -> str:
    return text if len(text) <= MAX_CELL else text[:MAX_CELL - 3] + "..."


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def why(seen: Seen) -> str:
    """The reason or the holder."""
    status = seen.status
    if seen.state == "gone":
        return f"process {status.pid} has ended without a clean stop (killed?)"
    if seen.state == "stale":
        return f"no status for {seen.age_s:.0f} s: stopped, hung or killed"
    if status.held_by:
        return "held by " + ",".join(status.held_by)
    if status.state in ("filling", "boosted"):
        return ""
    return status.reason or ""


def as_json(row: Row, now_unix_s: float) -> dict[str, object]:
    seen = row.seen
    status = seen.status
    return {"gpu": row.index, "filler_gpu": status.gpu_index, "uuid": status.gpu_uuid, "pid": status.pid,
            "uid": seen.uid, "user": user_name(seen.uid), "state": seen.state, "filler_state": status.state,
            "target": status.target_ratio, "metric": status.metric, "metric_value": status.metric_ratio,
            "metric_own": status.metric_own_ratio, "util": status.util_ratio,
            "own": status.own_ratio, "power_w": status.power_w, "held_by": list(status.held_by),
            "reason": status.reason, "age_s": round(seen.age_s, 3), "alive": seen.alive,
            "simulated": status.simulated, "time_unix_s": round(now_unix_s, 3)}


def table(rows: list[Row]) -> list[str]:
    head = ("GPU", "UUID", "PID", "USER", "STATE", "TARGET", "METRIC", "UTIL", "OWN", "POWER", "AGE")
    cells: list[tuple[str, ...]] = [head]
    for row in rows:
        seen, s = row.seen, row.seen.status
        power = "-" if s.power_w is None else f"{s.power_w:.0f}W"
        metric = "-" if s.metric is None or s.metric_ratio is None else f"{s.metric}={s.metric_ratio:.2f}"
        cells.append(tuple(_cell(c) for c in (
            str(row.index) + ("*" if s.simulated else ""), s.gpu_uuid, str(s.pid), user_name(seen.uid), seen.state,
            _ratio(s.target_ratio), metric, _ratio(s.util_ratio), _ratio(s.own_ratio), power, f"{seen.age_s:.1f}s")))
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    reasons = ["REASON / HOLDER"] + [escape_controls(why(row.seen)) for row in rows]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cell, widths)) + "  " + reason
             for cell, reason in zip(cells, reasons)]
    if any(row.seen.status.simulated for row in rows):
        lines.append("* simulated GPU (forge-load --simulate)")
    return [line.rstrip() for line in lines]


def show(hold_dir: str, flag: str, as_lines: bool, out: Callable[[str], None], clear: bool,
         proc_root: str = PROC_GPUS, runtime_dirs: tuple[str, ...] = ()) -> None:
    rows, problems = read(hold_dir, flag, proc_root, runtime_dirs)
    now_unix_s = time.time()
    if as_lines:
        for row in rows:
            out(json.dumps(as_json(row, now_unix_s)))
    else:
        when = time.strftime("%Y-%m-%d %H:%M:%S%z", time.localtime(now_unix_s))
        where = ", ".join(dict.fromkeys(runtime_dirs))
        text = [f"forge-load status  {when}  hold directory {hold_dir}" + (f"  runtime {where}" if where else ""),
                *table(rows)]
        if not rows:
            text.append(f"(no filler writes its status in {hold_dir}" + (f" or {where})" if where else ")"))
        out((CLEAR if clear else "") + "\n".join(escape_controls(line) for line in text))
    for problem in problems:
        say(f"forge-load status: {problem}")


def build_parser(prog: str = "forge-load status") -> ArgParser:
    parser = ArgParser(prog=prog, description="Every forge-load filler of this host, one row per GPU, from the "
                     "hold directory and the runtime directories (docs/operating.md: forge-load status).")
    parser.add_argument("--hold-dir", default=None, help=f"default FORGE_HOLD_DIR or {DEFAULT_HOLD_DIR}")
    parser.add_argument("--runtime-dir", default=None,
                        help=f"where fillers without a hold directory report; default FORGE_RUNTIME_DIR, or "
                             f"{HOST_RUNTIME_DIR} and this user's own")
    parser.add_argument("--json", action="store_true", help="one JSON object per GPU and line")
    parser.add_argument("--watch", default=None, metavar="SECONDS",
                        help=f"show again every SECONDS ({MIN_WATCH_S:g} to {MAX_WATCH_S:g}) until Ctrl-C")
    return parser


def main(argv: Sequence[str], env: dict[str, str] | os._Environ[str] | None = None,
         rounds: int | None = None, proc_root: str = PROC_GPUS) -> int:
    """`argv` without the command's name; `rounds` bounds --watch, `proc_root` stands in for the driver's /proc
    files (tests)."""

    def out(text: str) -> None:
        print(text, flush=True)

    try:
        args = build_parser().parse_args(list(argv))
        environ = os.environ if env is None else env
        hold_dir = hold_dir_of(args.hold_dir, environ)
        flag = "FORGE_HOLD_DIR" if args.hold_dir is None and "FORGE_HOLD_DIR" in environ else "--hold-dir"
        if args.hold_dir is None and "FORGE_HOLD_DIR" not in environ:
            flag = "--hold-dir (default)"
        runtime = dir_of("--runtime-dir", args.runtime_dir, "FORGE_RUNTIME_DIR", environ)
        runtime_dirs = (runtime,) if runtime is not None else (HOST_RUNTIME_DIR, default_runtime_dir())
        watch_s = parse_watch(args.watch) if args.watch is not None else None
        clear = watch_s is not None and not args.json and sys.stdout.isatty()
        show(hold_dir, flag, args.json, out, clear, proc_root, runtime_dirs)
        done = 1
        while watch_s is not None and (rounds is None or done < rounds):
            time.sleep(watch_s)
            show(hold_dir, flag, args.json, out, clear, proc_root, runtime_dirs)
            done += 1
        return EXIT_OK
    except (BadInput, UsageError) as error:
        say(f"forge-load status: {error}")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # the end of --watch
        return EXIT_OK
    except OSError as error:  # stdout closed, and the like
        say(f"forge-load status: {error.strerror or error}")
        return EXIT_BAD_INPUT
