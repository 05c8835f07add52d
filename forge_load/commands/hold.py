"""`forge-load hold|release|holds`: place, remove and list holds (docs/holds.md). Nothing of CUDA or numba is
imported here, so a Slurm prolog stays fast; an index is resolved through NVML (pynvml) or, without it, the
driver's /proc/driver/nvidia/gpus/*/information (shared.py).

Exit codes (forge_load/exits.py): 0 done; 1 `hold --wait` passed before every named GPU's filler acknowledged (the
hold stays); 2 bad input (one line naming the flag, the value and what is accepted) or a hold directory that cannot
be used.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable, Sequence

from forge_load.clock import boot_time_s
from forge_load.commands.host_gpus import PROC_GPUS, host_uuids
from forge_load.commands.shared import BadInput, bad, hold_dir_of, seconds, shown
from forge_load.config.cmdline import ArgParser, UsageError
from forge_load.config.sim import SIM_UUID_PREFIX
from forge_load.exits import EXIT_BAD_INPUT, EXIT_NOT_ACKNOWLEDGED, EXIT_OK
from forge_load.log import escape_controls, say
from forge_load.steering import acks, holds
from forge_load.steering.acks import FillersLook, Word
from forge_load.steering.filler_status import process_start_ticks
from forge_load.steering.holds import Hold, HoldError

COMMANDS = ("hold", "release", "holds")
MAX_REASON_CHARS = holds.MAX_REASON_CHARS
# The last second a calendar shows (9999-12-31T23:59:59Z): `holds` can show every --until it accepts.
MAX_UNTIL_UNIX_S = 253402300799.0
MAX_WAIT_S = 3600.0
WAIT_POLL_S = 0.02
_UNITS_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


# --- the GPUs ------------------------------------------------------------------------------------------

def resolve_gpus(raw: str, uuids_of_host: Callable[[], list[str]] = host_uuids) -> tuple[list[str], str | None]:
    """`--gpu`: comma-separated indices or UUIDs, or `all`; UUIDs in the order given, each once, and a line
    (`--gpu='...': index 7 is not ...`) naming the indices that are no GPU of this host, or None. Fail open: those
    cost only themselves, the job's other GPUs are held; BadInput when nothing resolves, or a name is neither an
    index nor a UUID."""
    accepted = "all, or comma-separated GPU indices or UUIDs (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)"
    names = [n.strip() for n in raw.split(",")]
    if not raw.strip() or any(not n for n in names):
        raise bad("--gpu", raw, accepted)
    host: list[str] | None = None
    if names == ["all"] or any(n.isdigit() for n in names):
        host = uuids_of_host()
        if not host:
            raise BadInput(f"--gpu={shown(raw)}: neither NVML nor {PROC_GPUS} shows a GPU on this host, so an "
                           "index (or all) cannot be resolved: name the GPUs by UUID (a simulated GPU's: uuid= on its "
                           "filler's start line, or forge-load status)")
    if names == ["all"]:
        assert host is not None
        return host, None
    out: list[str] = []
    unknown: list[int] = []
    for name in names:
        if name.isascii() and name.isdigit():
            assert host is not None
            index = int(name)
            if index >= len(host):
                unknown.append(index)
                continue
            uuid = host[index]
        elif holds.valid_gpu_uuid(name):
            uuid = holds.canonical_gpu_uuid(name)  # GPU-5FD4... is the GPU NVML calls GPU-5fd4...
        else:
            raise bad("--gpu", raw, accepted)
        if uuid not in out:
            out.append(uuid)
    assert host is not None or not unknown
    which = (f"index {', '.join(map(str, unknown))} is not a GPU of this host (0 to {len(host) - 1})"
             if host is not None and unknown else "")
    if not out:
        raise BadInput(f"--gpu={shown(raw)}: {which}")
    return out, (f"--gpu={shown(raw)}: {which}" if which else None)


# --- values ------------------------------------------------------------------------------------------------

def parse_until(raw: str, now_unix_s: float) -> float:
    """`--until`: an ISO 8601 time (local without an offset), a Unix time in seconds, or a duration from now such
    as 90m, 12h or 2d."""
    accepted = ("a time to come: ISO 8601 (2026-11-26T08:00:00+01:00), Unix seconds, or a duration from now "
                "such as 90m, 12h, 2d")
    text = raw.strip()
    unit = text[-1:].lower()
    if unit in _UNITS_S and text[:-1].replace(".", "", 1).isascii() and text[:-1].replace(".", "", 1).isdigit():
        until_s = now_unix_s + float(text[:-1]) * _UNITS_S[unit]
    else:
        from forge_load.steering.pause import parse_until as parse_time

        try:
            parsed = parse_time(text)
        except (ValueError, OverflowError, OSError):
            raise bad("--until", raw, accepted) from None
        if parsed is None:
            raise bad("--until", raw, accepted)
        until_s = parsed
    if not math.isfinite(until_s) or until_s <= now_unix_s:
        raise BadInput(f"--until={shown(raw)}: that time has passed; expected {accepted}")
    if until_s > MAX_UNTIL_UNIX_S:
        raise BadInput(f"--until={shown(raw)}: after 9999-12-31T23:59:59Z; expected {accepted}, up to that "
                       "time (leave --until out for a hold until it is released)")
    return until_s


def parse_wait(raw: str) -> float:
    return seconds("--wait", raw, 0.0, MAX_WAIT_S)


def check_holder(raw: str) -> str:
    if not holds.valid_holder(raw):
        raise bad("--holder", raw, "1 to 64 of A-Z a-z 0-9 _ . -, not starting with . or - (such as slurm-42)")
    return raw


def check_reason(raw: str) -> str:
    try:
        raw.encode("utf-8")  # bytes of the command line that are not UTF-8 come as lone surrogates
        text = True
    except UnicodeEncodeError:
        text = False
    if len(raw) > MAX_REASON_CHARS or escape_controls(raw) != raw or not text:
        raise bad("--reason", raw, f"at most {MAX_REASON_CHARS} characters of UTF-8 text without control characters")
    return raw


# --- the commands ------------------------------------------------------------------------------------------

def build_parser(prog: str) -> ArgParser:
    """`prog` is `forge-load hold`, `forge-load release` or `forge-load holds`: its last word says which."""
    command = prog.rsplit(" ", 1)[-1]
    parser = ArgParser(prog=prog, add_help=True)
    parser.add_argument("--hold-dir", default=None, help=f"default FORGE_HOLD_DIR or {holds.DEFAULT_HOLD_DIR}")
    if command in ("hold", "release"):
        parser.add_argument("--gpu", required=command == "hold",
                            help="comma-separated NVML indices of this host or GPU UUIDs, or all")
        parser.add_argument("--holder", required=True, help="who holds: [A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
    if command == "hold":
        parser.add_argument("--reason", default="", help="shown in the filler's log")
        parser.add_argument("--until", default=None, help="expiry: ISO 8601, Unix seconds, or 90m / 12h / 2d")
        parser.add_argument("--wait", default=None,
                            help="seconds to wait for every named GPU's filler to have drained; exit 1 if not")
    if command == "holds":
        parser.add_argument("--json", action="store_true", help="one JSON object per line")
    return parser


def cmd_hold(args: argparse.Namespace, hold_dir: str, out: Callable[[str], None],
             uuids_of_host: Callable[[], list[str]]) -> int:
    holder = check_holder(args.holder)
    reason = check_reason(args.reason)
    now_s = time.time()
    until_s = parse_until(args.until, now_s) if args.until is not None else None
    wait_s = parse_wait(args.wait) if args.wait is not None else None
    gpus, unresolved = resolve_gpus(args.gpu, uuids_of_host)
    named = {holds.canonical_gpu_uuid(n.strip()) for n in args.gpu.split(",") if holds.valid_gpu_uuid(n.strip())}
    simulated = [uuid for uuid in gpus if uuid.upper().startswith(SIM_UUID_PREFIX.upper())]
    if simulated and getattr(args, "host_wide", False):
        # Every simulated filler of a seed has these UUIDs: held host-wide, other users' simulations would stop too.
        raise BadInput(f"--gpu={shown(args.gpu)}: {simulated[0]} is a simulated GPU's (forge-load --simulate; the "
                       f"same UUID for every simulated filler of that seed on this host): not held in the host-wide "
                       f"{hold_dir}; give --hold-dir, the simulated filler's own")
    try:
        made_dir = holds.ensure_dir(hold_dir)
        placed_s, placed_boot = time.time(), acks.boot_stamp()  # the boot clock judges; no wall-clock step moves it
        for uuid in gpus:
            holds.place(hold_dir, Hold(uuid, holder, reason, placed_s, until_s))
    except HoldError as error:
        raise BadInput(f"--hold-dir={shown(hold_dir)}: {error}") from None
    if unresolved is not None:
        say(f"forge-load hold: {unresolved}: not held; the others are")
    if wait_s is None:
        for uuid in gpus:
            out(f"{uuid} held by {holder}")
        with FillersLook(hold_dir) as look:
            _say_unknown(hold_dir, _unknown(gpus, look, made_dir, named, uuids_of_host))
        return EXIT_OK
    # Counted from the command's own start where it runs as one (its interpreter's start included): `--wait S`
    # answers within S and one look, the command's whole time.
    deadline_s = (args.started_s if args.started_s is not None else time.monotonic()) + wait_s
    # A directory made just now: a filler that runs has had no chance yet to acknowledge into it.
    unsure_until_s = time.monotonic() + holds.NEW_DIR_ACK_S if made_dir else -math.inf

    def settled(uuid: str, word: Word) -> bool:
        # A just-made directory: until every filler has had its refresh to find it, no acknowledgement there is not
        # "no filler", and one MIG device's is not its siblings' (how many MIG devices there are, only acks tell).
        if not [a for a in word.acks if a.gpu_uuid == uuid] and time.monotonic() < unsure_until_s:
            return False
        # Exclusive mode: a live context of ours (its child's lock) is never "no filler", whatever the
        # acknowledgement says or how stale it is (a supervisor stopped or hung). A look that could not see every
        # filler, or a filler whose word cannot be read, is no word that it drained.
        if word.context or word.unreadable or not word.complete:
            return False
        now_s, now_boot = time.time(), acks.boot_stamp()
        return all(acks.acknowledged(a, holder, placed_s, now_s, placed_boot, now_boot) for a in word.acks)

    waiting = list(gpus)
    unknown: list[str] = []
    listing = _Listing(hold_dir)
    while True:
        look_s = time.monotonic()
        with FillersLook(hold_dir, listing.now()) as look:  # one look a poll, each file read once
            waiting = [u for u in waiting if not settled(u, look.word(u))]
            left_s = deadline_s - time.monotonic()
            if not waiting or left_s <= 0:
                unknown = _unknown(gpus, look, made_dir, named, uuids_of_host)
                break
        # Never past the deadline; and a look that costs (a crowded directory) is not repeated at once.
        time.sleep(min(max(WAIT_POLL_S, time.monotonic() - look_s), left_s))
    for uuid in gpus:
        out(f"{uuid} held by {holder}" + (": its filler has not drained yet" if uuid in waiting else ""))
    if waiting:
        new_dir = (f"; this hold made {hold_dir}, and a filler finds a new hold directory within "
                   f"{holds.NEW_DIR_ACK_S:g} s" if made_dir and wait_s < holds.NEW_DIR_ACK_S else "")
        say(f"forge-load hold: {len(waiting)} GPU(s) not acknowledged by their filler within {wait_s:g} s "
            f"(the hold stays): {', '.join(waiting)}{new_dir}")
    _say_unknown(hold_dir, unknown)
    return EXIT_NOT_ACKNOWLEDGED if waiting else EXIT_OK


def _running_s() -> float:
    """How long this process has run (its start in /proc/self/stat, on the boot clock); 0 where that cannot be told."""
    ticks, now_s = process_start_ticks(os.getpid()), boot_time_s()
    if ticks is None or now_s is None:
        return 0.0
    running_s = now_s - ticks / os.sysconf("SC_CLK_TCK")
    return running_s if 0.0 <= running_s < 60.0 else 0.0


class _Listing:
    """The hold directory's listing for `hold --wait`'s looks: listed again when the directory changed (its mtime:
    a filler's directory made, a hold placed) or a second has passed, as a filler's watch does; the fillers'
    directories themselves are read at every look."""

    def __init__(self, hold_dir: str) -> None:
        self.hold_dir = hold_dir
        self._key: tuple[int, int, int] | None = None
        self._listed_s = -math.inf
        self._listing = holds.Listing()

    def now(self) -> holds.Listing:
        try:
            info = os.stat(self.hold_dir)
            key: tuple[int, int, int] | None = (info.st_dev, info.st_ino, info.st_mtime_ns)
        except OSError:
            key = None
        if key is None or key != self._key or time.monotonic() - self._listed_s >= 1.0:
            self._key, self._listed_s = key, time.monotonic()
            try:
                self._listing = holds.list_dir(self.hold_dir)
            except HoldError as error:
                self._listing = holds.Listing(truncated=str(error))  # no word of any filler: not acknowledged
        return self._listing


def _unknown(gpus: list[str], look: FillersLook, made_dir: bool, named: set[str],
             uuids_of_host: Callable[[], list[str]]) -> list[str]:
    """The GPUs named by UUID that no filler of the directory knows (no acknowledgement of theirs, live or not, in a
    directory fillers had the time to find) and that are no GPU of this host (NVML, or the driver's files)."""
    unknown = [] if made_dir else [uuid for uuid in gpus if uuid in named and not look.word(uuid).acks]
    if unknown:
        host = {holds.canonical_gpu_uuid(uuid) for uuid in uuids_of_host()}
        unknown = [uuid for uuid in unknown if uuid not in host]
    return unknown


def _say_unknown(hold_dir: str, unknown: list[str]) -> None:
    """One line naming the GPUs no filler knows: held all the same (exit 0), since a container may name the host's
    other GPUs, whose fillers may start later."""
    if unknown:
        say(f"forge-load hold: no filler in {hold_dir} acknowledges {', '.join(unknown)}: held all the same, for a "
            "filler that starts there later (a GPU that is nowhere holds nothing)")


def cmd_release(args: argparse.Namespace, hold_dir: str, out: Callable[[str], None],
                uuids_of_host: Callable[[], list[str]]) -> int:
    holder = check_holder(args.holder)
    if args.gpu is None or args.gpu.strip() == "all":  # every GPU it holds: the directory says which
        try:
            listing = holds.list_dir(hold_dir)
        except HoldError as error:
            raise BadInput(f"--hold-dir={shown(hold_dir)}: {error}") from None
        gpus = sorted(uuid for uuid, holders in listing.holds.items() if holder in holders)
    else:
        gpus, unresolved = resolve_gpus(args.gpu, uuids_of_host)
        if unresolved is not None:
            say(f"forge-load release: {unresolved}: not released; the others are")
    released: list[str] = []
    try:
        for uuid in gpus:
            if holds.release(hold_dir, uuid, holder):
                released.append(uuid)
                out(f"{uuid} released by {holder}")
        left = [u for u in gpus if holder in {h.holder for h in holds.read_holds(hold_dir, u, time.time()).holds}]
    except HoldError as error:
        raise BadInput(f"--hold-dir={shown(hold_dir)}: {error}") from None
    if left:  # another user's file under the hold's name, in a directory with the sticky bit: not ours to remove
        say(f"forge-load release: a hold of {holder} on {', '.join(left)} placed by another user remains in "
            f"{hold_dir}: only that user (or root) can remove it")
    if not released and not left:
        out(f"no hold of {holder} in {hold_dir}" + (f" on {', '.join(gpus)}" if args.gpu not in (None, "all")
                                                     else "") + ": nothing released")
    return EXIT_OK


def _when(t_s: float | None) -> str:
    """Local ISO 8601; a time no calendar of this machine shows (a file's 1e300) as the number it is."""
    if t_s is None:
        return "-"
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t_s))
    except (OverflowError, OSError, ValueError):
        return f"{t_s:g}"


def cmd_holds(args: argparse.Namespace, hold_dir: str, out: Callable[[str], None]) -> int:
    if not os.path.isdir(hold_dir):  # a typo must not read as "no holds"
        what = "not a directory" if os.path.lexists(hold_dir) else "no such directory"
        raise BadInput(f"--hold-dir={shown(hold_dir)}: {what}; expected the hold directory (made by the first hold)")
    try:
        listing = holds.list_dir(hold_dir)
    except HoldError as error:
        raise BadInput(f"--hold-dir={shown(hold_dir)}: {error}") from None
    found, problems = holds.all_holds(hold_dir, listing)
    now_s, now_boot = time.time(), acks.boot_stamp()
    worst_first = ("not honoured (yet, or aged out)", "draining", "drained")
    with FillersLook(hold_dir, listing) as look:  # one look for every hold: the directory is listed once
        problems += look.problems

        def filler(hold: Hold) -> str:
            if hold.until_unix_s is not None and hold.until_unix_s <= now_s:
                return "expired"
            word = look.word(hold.gpu_uuid)  # the GPU's own filler, and for a GPU in MIG mode each MIG device's
            live = [a for a in word.acks if acks.ack_live(a, now_s, now_boot)]
            if not live:
                if word.context:  # a supervisor gone silent
                    return "draining (our exclusive-mode child still holds the GPU)"
                return "no filler"
            said = [worst_first[0] if hold.holder not in a.held_by and not a.fail_safe else
                    "drained" if a.drained else "draining" for a in live]
            worst = min(said, key=worst_first.index)
            of_mig = any(a.of_gpu for a in live)
            return worst if not of_mig else f"{worst} ({said.count(worst)} of {len(live)} MIG devices' fillers)"

        rows = [(hold, filler(hold)) for hold in found]
    if args.json:
        for hold, said in rows:
            out(json.dumps({"gpu": hold.gpu_uuid, "holder": hold.holder, "reason": hold.reason,
                            "since_unix_s": hold.since_unix_s, "until_unix_s": hold.until_unix_s, "filler": said}))
    else:
        cells = [("GPU", "HOLDER", "SINCE", "UNTIL", "FILLER", "REASON")]
        cells += [(h.gpu_uuid, h.holder, _when(h.since_unix_s), _when(h.until_unix_s), said,
                   escape_controls(h.reason)) for h, said in rows]
        widths = [max(len(row[i]) for row in cells) for i in range(5)]
        for row in cells:
            out("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[5])
    for problem in problems:
        say(f"forge-load holds: {problem}")
    return EXIT_OK


def main(argv: Sequence[str], env: dict[str, str] | os._Environ[str] | None = None,
         uuids_of_host: Callable[[], list[str]] = host_uuids, started_s: float | None = None) -> int:
    """`argv` starts with the command's name; `started_s`, when the command started (time.monotonic()): `hold
    --wait` counts from it (None: from the hold placed)."""
    command, rest = argv[0], list(argv[1:])

    def out(line: str) -> None:
        print(escape_controls(line), flush=True)

    try:
        args = build_parser(f"forge-load {command}").parse_args(rest)
        environ = os.environ if env is None else env
        hold_dir = hold_dir_of(args.hold_dir, environ)
        args.host_wide = args.hold_dir is None and "FORGE_HOLD_DIR" not in environ  # the default directory
        args.started_s = started_s
        if command == "hold":
            return cmd_hold(args, hold_dir, out, uuids_of_host)
        if command == "release":
            return cmd_release(args, hold_dir, out, uuids_of_host)
        return cmd_holds(args, hold_dir, out)
    except (BadInput, UsageError) as error:
        say(f"forge-load {command}: {error}")
        return EXIT_BAD_INPUT
    except OSError as error:  # stdout closed, and the like
        say(f"forge-load {command}: {error.strerror or error}")
        return EXIT_BAD_INPUT


# The dispatcher's entry points (forge_load/cli.py): the arguments after the command's name.
def main_hold(argv: Sequence[str]) -> int:
    return main(["hold", *argv], started_s=time.monotonic() - _running_s())  # a process of its own


def main_release(argv: Sequence[str]) -> int:
    return main(["release", *argv])


def main_holds(argv: Sequence[str]) -> int:
    return main(["holds", *argv])
