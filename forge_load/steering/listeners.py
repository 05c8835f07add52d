"""Who is told when something the fillers watch changes (the pause switch, the kubelet's holds): the run loops'
wake-ups, added and removed from any thread."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Listeners:
    """Thread-safe; `tell` calls every listener outside the lock, so a listener may add or remove one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[Callable[[], None]] = []

    def add(self, listener: Callable[[], None]) -> None:
        with self._lock:
            self._items.append(listener)

    def remove(self, listener: Callable[[], None]) -> None:
        with self._lock:
            if listener in self._items:
                self._items.remove(listener)

    def tell(self) -> None:
        with self._lock:
            items = list(self._items)
        for listener in items:
            listener()
