"""`forge-load plot LOG [-o FILE]`: a run drawn from its log (docs/operating.md, Plot a run); the log is read by
forge_load/plot/logs.py and drawn by forge_load/plot/draw.py, which imports matplotlib only to draw.

Exit codes (forge_load/exits.py): 0 drawn; 1 matplotlib is not installed (one line says how to install the extra);
2 bad input (the log cannot be read or holds no filler line, the output's suffix is neither .png nor .svg, a GPU not
in the log): one line naming what was given and what is accepted.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from forge_load.commands.shared import BadInput, shown
from forge_load.config.cmdline import ArgParser, UsageError
from forge_load.exits import EXIT_BAD_INPUT, EXIT_NO_MATPLOTLIB, EXIT_OK
from forge_load.log import escape_controls, say
from forge_load.plot.logs import Run, read_log

INSTALL_HINT = "pip install 'forge-load[plot]' (or: pip install matplotlib)"


def build_parser(prog: str = "forge-load plot") -> ArgParser:
    parser = ArgParser(prog=prog, description="Draw a run from its log: target, NVML utilization, own and foreign "
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


def output_path(log: str, output: str | None) -> Path:
    from forge_load.plot.draw import SUFFIXES  # draw.py imports matplotlib only inside draw()

    path = Path(output) if output is not None else (Path("plot.png") if log == "-" else Path(log).with_suffix(".png"))
    if path.suffix.lower() not in SUFFIXES:
        raise BadInput(f"-o={shown(str(path))}: expected a file name ending in .png or .svg")
    return path


def read(log: str, stdin: TextIO) -> Run:
    if log == "-":
        return read_log(stdin)
    try:
        with open(log, encoding="utf-8", errors="replace") as file:
            return read_log(file)
    except OSError as error:
        raise BadInput(f"LOG={shown(log)}: cannot be read ({error.strerror or error}): expected a log file, "
                       "or - for stdin") from None


def main(argv: Sequence[str] | None = None, stdin: TextIO | None = None) -> int:
    from forge_load.plot.draw import MissingExtra, draw, drawable

    try:
        args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        out = output_path(args.log, args.output)
        run = read(args.log, stdin if stdin is not None else sys.stdin)
        if args.gpu is not None:
            if args.gpu not in run.gpus:
                raise BadInput(f"--gpu={shown(args.gpu)}: expected one of the log's GPUs: "
                               f"{', '.join(run.gpus) or 'none'}")
            run.gpus = {args.gpu: run.gpus[args.gpu]}
        if not drawable(run):
            raise BadInput(f"LOG={shown(args.log)}: {run.lines} lines, none of them a filler's line with numbers: "
                           "expected key=value or JSON lines as forge-load writes them (t=... event=...)")
        drawn = draw(run, out, title=args.title)
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
    gpus = sorted({name.split(":", 1)[0] for name in drawn})
    skipped = f"; {run.skipped} lines not the filler's left out" if run.skipped else ""
    print(f"forge-load plot: wrote {escape_controls(str(out))} (GPU {', '.join(gpus)}: {run.lines} lines{skipped})")
    return EXIT_OK
