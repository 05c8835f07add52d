"""`forge-load plot LOG [-o FILE]`: a run drawn from its log (docs/operating.md, Plot a run); the log is read by
forge_load/plot/logs.py and drawn by forge_load/plot/draw.py, which imports matplotlib only to draw.

The picture never takes the log's place: an output that is the log (by name, link or inode) is refused, and the
picture is written to a new file beside the output and renamed onto it, so a symlink there is replaced, never
followed.

Exit codes (forge_load/exits.py): 0 drawn; 1 matplotlib is not installed (one line says how to install the extra);
2 bad input (the log cannot be read or holds no filler line, the output's suffix is neither .png nor .svg, the
output is the log, the output cannot be written, a GPU not in the log): one line naming what was given and what is
accepted; 5 drawn, but stdout (the line that says so) could not be written.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TextIO

from forge_load.commands.shared import BadInput, shown
from forge_load.config.cmdline import ArgParser, UsageError
from forge_load.exits import EXIT_BAD_INPUT, EXIT_NO_MATPLOTLIB, EXIT_OK
from forge_load.log import escape_controls, say
from forge_load.plot.logs import MAX_GPUS, MAX_PANELS, NotInLog, Run, panels, read_file, read_log

INSTALL_HINT = "pip install 'forge-load[plot]' (or: pip install matplotlib)"
_NAMES_SHOWN = 16  # GPUs named in one line before "and N more"


def build_parser(prog: str = "forge-load plot") -> ArgParser:
    parser = ArgParser(prog=prog, description="Draw a run from its log: target, NVML utilization, own and foreign "
                     "share, the held metric where it is not NVML's utilization, the yielding, paused and held "
                     "spans, board power where logged; a panel per GPU or MIG device.",
                     epilog="LOG is key=value or JSON, as the filler writes it, also with `docker logs -t`'s, "
                     "`docker compose logs`' or journald's prefixes. Exit codes: 0 drawn; 1 matplotlib missing; "
                     "2 bad input; 5 drawn, but stdout could not be written.")
    parser.add_argument("log", metavar="LOG", help="the log file, or - for stdin (docker logs NAME 2>&1 | ...)")
    parser.add_argument("-o", "--output", metavar="FILE", default=None,
                        help="the picture, PNG or SVG by its suffix; default LOG's name with .png (plot.png for -); "
                        "never the log itself")
    parser.add_argument("--gpu", metavar="GPU", default=None,
                        help="only these GPUs: an index (the log's gpu field), a GPU-... or MIG-... UUID (a GPU's "
                        "index or UUID picks each of its MIG devices), or a comma-separated list; default every GPU, "
                        f"a panel each, at most {MAX_PANELS}")
    parser.add_argument("--title", default="", help="a title above the panels")
    return parser


def output_path(log: str, output: str | None) -> Path:
    from forge_load.plot.draw import SUFFIXES  # draw.py imports matplotlib only inside render()

    path = Path(output) if output is not None else (Path("plot.png") if log == "-" else Path(log).with_suffix(".png"))
    if path.suffix.lower() not in SUFFIXES:
        raise BadInput(f"-o={shown(str(path))}: expected a file name ending in .png or .svg")
    return path


def _not_the_log(log: str, out: Path, log_stat: os.stat_result | None, default: bool) -> None:
    """Refuse an output that is the log: the same name, or the same file by another name (a link, a symlink)."""
    try:
        out_stat = out.stat()
    except OSError:
        out_stat = None
    same = log != "-" and os.path.abspath(log) == os.path.abspath(out)
    if log_stat is not None and out_stat is not None:
        same = same or (log_stat.st_dev, log_stat.st_ino) == (out_stat.st_dev, out_stat.st_ino)
    if same:
        why = " (LOG's name with .png, the default)" if default else ""
        more = ", named with -o" if default else ""
        raise BadInput(f"-o={shown(str(out))}{why} is the log itself (LOG={shown(log)}): expected another file for "
                       f"the picture{more}")


@contextlib.contextmanager
def _opened(log: str, stdin: TextIO | None) -> Iterator[tuple[object, os.stat_result | None]]:
    """The log's stream (bytes; a text stream as given) and what it is on disk, if it is a file."""
    if log == "-":
        if stdin is None:
            raise _stdin_closed()
        try:
            stat: os.stat_result | None = os.fstat(stdin.fileno())
        except (OSError, ValueError, AttributeError):  # a stream without a descriptor (a test's)
            stat = None
        yield getattr(stdin, "buffer", stdin), stat
        return
    try:
        stream = open(log, "rb")  # noqa: SIM115 (closed below; the errors are the log's, said as such)
    except OSError as error:
        raise _unreadable(log, error) from None
    with stream:
        yield stream, os.fstat(stream.fileno())


def _stdin_closed() -> BadInput:
    return BadInput("LOG='-': stdin is closed: expected a log on stdin (docker logs NAME 2>&1 | forge-load plot -) "
                    "or a file")


def _unreadable(log: str, error: OSError) -> BadInput:
    if log == "-" and error.errno == errno.EBADF:  # closed at start: the dispatcher gave it /dev/null's, read as closed
        return _stdin_closed()
    return BadInput(f"LOG={shown(log)}: cannot be read ({error.strerror or error}): expected a log file, or - for "
                    "stdin")


def _read(log: str, stream: object) -> Run:
    try:
        if isinstance(stream, io.TextIOBase):  # a text stream given as such (a test's); stdin is read as bytes
            return read_log(stream)
        return read_file(stream)  # type: ignore[arg-type]
    except OSError as error:
        raise _unreadable(log, error) from None


def _write_new(out: Path, write: object) -> None:
    """Write the picture to a new file beside `out` and rename it onto `out`: whatever `out` was (a symlink, a
    hard link to another file) is replaced, never written through; nothing is left behind on failure."""
    fd, temporary = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".part", dir=out.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # as a file the user created (mkstemp's are 0600)
        with os.fdopen(fd, "wb") as file:
            write(file)  # type: ignore[operator]
        os.replace(temporary, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _names(keys: list[str]) -> str:
    more = len(keys) - _NAMES_SHOWN
    return ", ".join(escape_controls(k)[:80] for k in keys[:_NAMES_SHOWN]) + (f" and {more} more" if more > 0 else "")


def main(argv: Sequence[str] | None = None, stdin: TextIO | None = None) -> int:
    from forge_load.plot.draw import MissingExtra, draw

    out: Path | None = None
    try:
        args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        out = output_path(args.log, args.output)
        with _opened(args.log, stdin if stdin is not None else sys.stdin) as (stream, log_stat):
            _not_the_log(args.log, out, log_stat, default=args.output is None)
            run = _read(args.log, stream)
        try:
            chosen, left_out = panels(run, args.gpu)
        except NotInLog as error:
            raise BadInput(f"--gpu={shown(error.entry)}: expected one of the log's GPUs, or a list of them: "
                           f"{_names(error.names) or 'none'}") from None
        if not chosen:
            raise BadInput(f"LOG={shown(args.log)}: {run.lines} lines, none of them a filler's line with numbers: "
                           "expected key=value or JSON lines as forge-load writes them (t=... event=...)")
        _write_new(out, lambda file: draw(chosen, file, out.suffix, title=args.title))
    except (UsageError, BadInput) as error:
        hint = " (see --help)" if isinstance(error, UsageError) else ""  # argparse's words: where to read more
        say(f"forge-load plot: {error}{hint}")
        return EXIT_BAD_INPUT
    except MissingExtra:
        say(f"forge-load plot: matplotlib is not installed: {INSTALL_HINT}")
        return EXIT_NO_MATPLOTLIB
    except OSError as error:
        say(f"forge-load plot: -o={shown(str(out))}: cannot be written ({error.strerror or error})")
        return EXIT_BAD_INPUT
    if left_out:
        say(f"forge-load plot: GPU {_names(left_out)} not drawn: at most {MAX_PANELS} panels in one picture; "
            f"--gpu {','.join(left_out[:_NAMES_SHOWN])} draws {'them' if len(left_out) <= _NAMES_SHOWN else 'those'}")
    notes = [f"{run.skipped} lines not the filler's left out" if run.skipped else "",
             f"{run.impossible} lines with an impossible number (not finite, or out of range) skipped"
             if run.impossible else "",
             f"{run.beyond} lines of GPUs beyond the first {MAX_GPUS} left out" if run.beyond else ""]
    line = (f"forge-load plot: wrote {escape_controls(str(out))} (GPU {_names([s.key for s in chosen])}: "
            f"{run.lines} lines{''.join(f'; {note}' for note in notes if note)})")
    print(line, flush=True)  # a stdout that cannot be written: the dispatcher says so (cli.output_lost), exit 5
    return EXIT_OK
