"""The engine's event stream, split into events here rather than by the docker SDK.

The SDK's decoder (`events(decode=True)`: docker.utils.json_stream) keeps whatever it cannot parse at the head of
its buffer and tries again from there with every later chunk, so one chunk that is not JSON silences every event
after it until the stream closes, which a real engine keeps open for days. Here the raw chunks
(`events(decode=False)`) are split into lines (the engine ends each event with a newline) and each line is read
on its own: what is not an event costs itself, with one call of `bad`, and the next event is read as usual.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

MAX_PENDING = 1 << 20  # bytes without a newline kept waiting for the rest of their event; more is not an event
_DECODER = json.JSONDecoder()
_SPACE = " \t\r\n"


class EventSplitter:
    """Bytes from the event stream in, events (JSON objects) out. `bad` is called once per line (or piece kept
    too long without one) that holds something other than JSON objects, with that text (its first 200
    characters) and its length in characters (a byte that is not UTF-8 counts as one)."""

    def __init__(self, bad: Callable[[str, int], None]) -> None:
        self.bad = bad
        self.pending = b""

    def feed(self, data: bytes | str) -> list[dict[str, Any]]:
        if isinstance(data, str):  # the SDK's answer where the engine did not stream (an error): the whole body
            data = data.encode()
        self.pending += data
        events: list[dict[str, Any]] = []
        *lines, self.pending = self.pending.split(b"\n")
        for line in lines:
            events.extend(self._objects(line))
        if self.pending.strip():
            rest = self.pending.decode("utf-8", "replace")
            start = len(rest) - len(rest.lstrip(_SPACE))
            try:  # an engine (or a proxy) that ends an event without its newline: complete already?
                obj, end = _DECODER.raw_decode(rest, start)
            except ValueError:
                if len(self.pending) > MAX_PENDING:
                    self.bad(rest[:200], len(rest))
                    self.pending = b""
                return events
            if not rest[end:].strip(_SPACE):
                self.pending = b""
                events.extend(self._kept(obj, rest[start:end]))
        return events

    def _objects(self, line: bytes) -> list[dict[str, Any]]:
        """The events of one complete line: normally one object. What is not one is skipped up to the next `{`,
        so that an event glued behind bytes that are not one is still read; all of it is one call of `bad`."""
        text = line.decode("utf-8", "replace")
        found: list[dict[str, Any]] = []
        junk: list[str] = []
        at = 0
        while True:
            while at < len(text) and text[at] in _SPACE:
                at += 1
            if at >= len(text):
                break
            try:
                obj, end = _DECODER.raw_decode(text, at)
            except ValueError:
                resume = text.find("{", at + 1)
                end = resume if resume >= 0 else len(text)
                junk.append(text[at:end])
                at = end
                continue
            if isinstance(obj, dict):
                found.append(obj)
            else:
                junk.append(text[at:end])
            at = end
        if junk:
            self.bad(" ".join(piece.strip(_SPACE) for piece in junk)[:200],
                     sum(len(piece) for piece in junk))
        return found

    def _kept(self, obj: object, text: str) -> list[dict[str, Any]]:
        if isinstance(obj, dict):
            return [obj]
        self.bad(text[:200], len(text))
        return []
