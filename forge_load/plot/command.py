"""`forge-load plot LOG [-o FILE]`: a run drawn from its log (docs/operating.md, Plot a run).

Exit codes: 0 drawn; 1 matplotlib is not installed (one line says how to install the extra); 2 bad input (the
log cannot be read or holds no filler line, the output's suffix is neither .png nor .svg, a GPU not in the log):
one line naming what was given and what is accepted.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn, TextIO

from forge_load.log import escape_controls
from forge_load.plot.logs import Run, read_log

EXIT_OK = 0
EXIT_NO_MATPLOTLIB = 1
EXIT_BAD_INPUT = 2
INSTALL_HINT = "pip install 'forge-load[plot]' (or: pip install matplotlib)"


class BadInput(Exception):
    """One line for the operator; exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise BadInput(f"{message} (see --help)")


def build_parser(prog: str = "forge-load plot") -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description="Draw a run from its log: target, NVML utilization, own and foreign "
                     "share, the yielding, paused and held spans, board power where logged.",
                     epilog="LOG is key=value or JSON, as the filler writes it, also with `docker logs -t`'s, "
                     "`docker compose logs`' or journald's prefixes. Exit codes: 0 drawn; 1 matplotlib missing; "
                     "2 bad input.")
    parser.add_argument("log", metavar="LOG", help="the log file, or - for stdin (docker logs NAME 2>&1 | ...)")
    parser.add_argument("-o", "--output", metavar="FILE", default=None,
                        help="the picture, PNG or SVG by its suffix; default LOG's name with .png (plot.png for -)")
    parser.add_argument("--gpu", metavar="GPU", default=None,
                        help="only this GPU (its index as the log's gpu field); default every GPU, a panel each")
    parser.add_argument("--title", default="", help="a title above the panels")
    return parser


def _shown(raw: str) -> str:
    text = escape_controls(raw)
    return repr(text if len(text) <= 80 else text[:80] + "...")


def output_path(log: str, output: str | None) -> Path:
    from forge_load.plot.draw import SUFFIXES  # draw.py imports matplotlib only inside draw()

    path = Path(output) if output is not None else (Path("plot.png") if log == "-" else Path(log).with_suffix(".png"))
    if path.suffix.lower() not in SUFFIXES:
        raise BadInput(f"-o={_shown(str(path))}: expected a file name ending in .png or .svg")
    return path


def read(log: str, stdin: TextIO) -> Run:
    if log == "-":
        return read_log(stdin)
    try:
        with open(log, encoding="utf-8", errors="replace") as file:
            return read_log(file)
    except OSError as error:
        raise BadInput(f"LOG={_shown(log)}: cannot be read ({error.strerror or error}): expected a log file, "
                       "or - for stdin") from None


def main(argv: Sequence[str] | None = None, stdin: TextIO | None = None) -> int:
    from forge_load.plot.draw import MissingExtra, draw, drawable

    try:
        args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        out = output_path(args.log, args.output)
        run = read(args.log, stdin if stdin is not None else sys.stdin)
        if args.gpu is not None:
            if args.gpu not in run.gpus:
                raise BadInput(f"--gpu={_shown(args.gpu)}: expected one of the log's GPUs: "
                               f"{', '.join(run.gpus) or 'none'}")
            run.gpus = {args.gpu: run.gpus[args.gpu]}
        if not drawable(run):
            raise BadInput(f"LOG={_shown(args.log)}: {run.lines} lines, none of them a filler's line with numbers: "
                           "expected key=value or JSON lines as forge-load writes them (t=... event=...)")
        drawn = draw(run, out, title=args.title)
    except BadInput as error:
        print(f"forge-load plot: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except MissingExtra:
        print(f"forge-load plot: matplotlib is not installed: {INSTALL_HINT}", file=sys.stderr)
        return EXIT_NO_MATPLOTLIB
    except OSError as error:
        print(f"forge-load plot: -o={_shown(str(out))}: cannot be written ({error.strerror or error})",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    gpus = sorted({name.split(":", 1)[0] for name in drawn})
    skipped = f"; {run.skipped} lines not the filler's left out" if run.skipped else ""
    print(f"forge-load plot: wrote {escape_controls(str(out))} (GPU {', '.join(gpus)}: {run.lines} lines{skipped})")
    return EXIT_OK
