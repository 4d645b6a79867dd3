"""`StepWatchdog`: notices an engine step that does not return.

The engine thread calls `started()` before each step and `finished()` after it; a thread of
the watchdog's own wakes every `timeout / 4` seconds and, once a step has been running for
more than `timeout` seconds, calls `on_overrun(seconds)` once. Python cannot stop a thread
that is stuck, so the watchdog only reports; `AsyncEngine` then fails every request.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class StepWatchdog:
    def __init__(self, timeout: float, on_overrun: Callable[[float], None]) -> None:
        if not timeout > 0:
            raise ValueError(f"step_timeout must be > 0 seconds, got {timeout!r}")
        self.timeout, self._on_overrun = timeout, on_overrun
        self._since: float | None = None  # when the running step started
        self._tripped = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="specserve-watchdog", daemon=True)
        self._thread.start()

    def started(self) -> None:
        self._since = time.monotonic()

    def finished(self) -> None:
        self._since = None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self.timeout / 4):
            since = self._since
            if since is not None and not self._tripped:
                running = time.monotonic() - since
                if running > self.timeout:
                    self._tripped = True
                    self._on_overrun(running)
