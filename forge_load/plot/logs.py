"""A filler's log read back into series: JSON or key=value lines, from a file, stdin or `docker logs` output.

Each line is found by its own start (`{"t":` for JSON, `t=... event=` for key=value, other fields allowed between
the two), so whatever a log collector put before it is skipped: `docker logs -t`'s timestamp, `docker compose
logs`' `name  | `, `kubectl logs --prefix`'s `[pod/...]`, journald's `host forge-load[pid]: `. Lines that are not
the filler's (its stderr, a shell's, a line too long or too deep to be one) are counted and left out, and so are
lines with an impossible number (not finite, or beyond any GPU's range): a log is input, and may be corrupt.

The log is streamed: each series keeps its points in two compact arrays (8 bytes a number), so memory grows with
what is drawn, not with the text. Pure: no matplotlib, no GPU library.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from forge_load.plot.lines import LineReader
from forge_load.plot.series import METRIC_FIELDS, SHARES, Impossible, Series, status_plan

MAX_LINE_BYTES = 65536  # the filler's longest line (a JSON start line) is a few KiB
MAX_GPUS = 1024  # panels kept while reading; a log naming more is not a host's
# The fields read: the rest of a line is passed over (LineReader captures only these).
WANTED = frozenset(("t", "event", "state", "target", "power_w", "gpu", "uuid", "count", "reason", "child_pid",
                    "filling", "metric", "gpu_uuid", "mig_profile", "gpu_instance", *SHARES, *METRIC_FIELDS))


@dataclass
class Run:
    """A log read: one Series per GPU or MIG device, in the order they first appear; how many lines were read,
    how many were not the filler's, how many had an impossible number, and how many named GPUs beyond MAX_GPUS."""

    gpus: dict[str, Series]
    lines: int
    skipped: int
    impossible: int = 0
    beyond: int = 0


class _Reading:
    """A log as it is read: its GPUs' series and its counts. Lines come one by one (line()) or as a block of whole
    lines (block()): there a status line of a shape read before goes straight to its series (Series.add_status),
    and any other line the way line() reads it."""

    def __init__(self) -> None:
        self.run = Run({}, 0, 0)
        self.reader = LineReader(WANTED)
        self._series_of: dict[tuple[str, str], Series] = {}  # a shape's gpu and uuid tokens: their series

    def line(self, line: str | None) -> None:
        """One line (None: a line too long to be the filler's)."""
        run = self.run
        record = self.reader.fields(line) if line is not None else None
        if record is None:
            if line is None or line.strip():  # blank lines are nobody's
                run.lines += 1
                run.skipped += 1
            return
        run.lines += 1
        gpu = record.get("gpu")
        if gpu is None:  # the process's own lines (an error before any GPU): nothing to draw
            return
        if type(gpu) is not str and type(gpu) is not int:
            run.skipped += 1  # no filler names a GPU so
            return
        uuid = record.get("uuid")
        key = uuid if type(uuid) is str and uuid.startswith("MIG-") else str(gpu)
        series = run.gpus.get(key)
        if series is None:
            if len(run.gpus) >= MAX_GPUS:
                run.beyond += 1
                return
            series = run.gpus[key] = Series(key, str(gpu))
        try:
            series.add(record)
        except Impossible:
            run.impossible += 1
        matched = self.reader.matched
        if matched is not None and len(self._series_of) < MAX_GPUS:
            plan = status_plan(matched[0])
            if plan is not None:
                self._series_of[plan.key(matched[1])] = series

    def block(self, text: str) -> None:
        """Whole lines, each ending in a newline (the last may not)."""
        position, size = 0, len(text)
        series_of = self._series_of
        taken = 0
        while position < size:
            shape = self.reader.shape
            plan = status_plan(shape) if shape is not None else None
            if plan is not None:  # the lines of the last shape, as long as they come
                match, key = plan.pattern.match, plan.key
                while (found := match(text, position)) is not None:
                    groups = found.groups()
                    series = series_of.get(key(groups))
                    if series is None or not series.add_status(groups, plan):
                        break
                    taken += 1
                    position = found.end()
                if position >= size:
                    break
            end = text.find("\n", position)
            end = size if end < 0 else end + 1
            self.line(text[position:end] if end - position <= MAX_LINE_BYTES else None)
            position = end
        self.run.lines += taken

    def finish(self) -> Run:
        for series in self.run.gpus.values():
            series.finish()
            self.run.impossible += series.impossible_lines
        return self.run


def read_log(lines: Iterable[str | None]) -> Run:
    """Every line of a log (None: a line too long to be the filler's)."""
    reading = _Reading()
    for line in lines:
        reading.line(line)
    return reading.finish()


def read_file(stream: BinaryIO) -> Run:
    """A log from a file or stdin, read the same way: in blocks of whole lines, decoded as UTF-8 with a byte that is
    not replaced; a line longer than MAX_LINE_BYTES is counted and left out unread (it is no filler's, and would
    cost its length)."""
    reading = _Reading()
    for block in _blocks(stream):
        if block is None:
            reading.line(None)
        else:
            reading.block(block)
    return reading.finish()


_BLOCK_BYTES = 1 << 20


def _blocks(stream: BinaryIO) -> Iterator[str | None]:
    """The stream as blocks of whole lines (split at a newline, which no UTF-8 character holds), or None for a line
    too long, whose bytes are passed over as they come (a line within a block is judged by block())."""
    pending = b""  # the start of a line not ended yet
    passing = False  # inside a line too long, counted already
    while data := stream.read(_BLOCK_BYTES):
        if passing:
            end = data.find(b"\n")
            if end < 0:
                continue
            data, passing = data[end + 1:], False
        data = pending + data
        cut = data.rfind(b"\n") + 1
        pending = data[cut:]
        if cut:
            yield data[:cut].decode("utf-8", errors="replace")
        if len(pending) > MAX_LINE_BYTES:
            yield None
            pending, passing = b"", True
    if pending and not passing:
        yield pending.decode("utf-8", errors="replace")


class NotInLog(ValueError):
    """A --gpu entry that names no GPU of the log; `names` says which it has."""

    def __init__(self, entry: str, names: list[str]) -> None:
        super().__init__(entry)
        self.entry = entry
        self.names = names


MAX_PANELS = 16  # panels in one picture: beyond, each is too thin to read


def _order(series: Series) -> tuple[int, str, str]:
    index = int(series.gpu) if series.gpu.isdigit() and len(series.gpu) < 10 else 1 << 40
    instance = series.gpu_instance.zfill(8) if series.gpu_instance.isdigit() else series.gpu_instance
    return index, instance, series.key


def panels(run: Run, selection: str | None = None) -> tuple[list[Series], list[str]]:
    """The panels to draw, in GPU order: every GPU with something to draw, or those `selection` names (a comma list
    of indices, GPU-/MIG- UUIDs; a GPU's index or UUID picks each of its MIG devices); at most MAX_PANELS of them.
    Returns them and the keys of the GPUs left out past MAX_PANELS. NotInLog for an entry that names none."""
    shown = sorted((s for s in run.gpus.values() if s.drawable()), key=_order)
    if selection is not None:
        entries = [entry.strip() for entry in selection.split(",")]
        for entry in entries:
            if not entry or not any(entry in (s.key, s.gpu, s.uuid, s.gpu_uuid) for s in shown):
                raise NotInLog(entry, list(dict.fromkeys(name for s in shown for name in (s.gpu, s.key))))
        shown = [s for s in shown if any(entry in (s.key, s.gpu, s.uuid, s.gpu_uuid) for entry in entries)]
    return shown[:MAX_PANELS], [s.key for s in shown[MAX_PANELS:]]
