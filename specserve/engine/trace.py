"""The step trace (`EngineConfig.trace_steps`): one JSON line per engine step, for diagnosis.

A line holds the step's start (perf_counter seconds) and length, the decoding batch `B`,
per decoding sequence its drafts `k`, their source (`suffix`, `ngram`, `draft_model`,
`grammar+suffix`, ... or null) and the controller's reason when it drafted none, how many
were accepted and how many tokens it gained, the prefill tokens that shared the pass, the
draft and verify seconds, and the cost model's prediction for the step (`predicted_s`).
`benchmarks/scripts/step_trace_summary.py` reads it.

The file is opened without following a symbolic link (a link in its place is refused at
start-up, naming the option), appended to, and bounded: past `MAX_TRACE_BYTES` it is renamed
to `<path>.1` (replacing the previous one) and a new file is started, so at most twice that
stays on disk. A line that cannot be written (a full disk, a removed folder) is logged, at
most once every `LOG_EVERY_S` seconds with the count of lines lost, and never fails a step.
"""

from __future__ import annotations

import json
import logging
import os
import time

MAX_TRACE_BYTES = 64 << 20  # a trace file past this is rotated to <path>.1
LOG_EVERY_S = 60.0  # at most one log line per this many seconds about lost trace lines
log = logging.getLogger(__name__)


class StepTrace:
    def __init__(self, path: str, max_bytes: int | None = None) -> None:
        self._path = path
        self._max_bytes = MAX_TRACE_BYTES if max_bytes is None else max_bytes
        try:
            self._file = _open(path, os.O_APPEND)
        except OSError as e:
            raise ValueError(f"trace_steps: cannot open {path!r} for writing ({e.strerror or e}"
                             f"{'; it is a symbolic link' if os.path.islink(path) else ''})") \
                from None
        self._lost = 0  # lines not written since the last log line about them
        self._logged_at: float | None = None

    def step(self, engine, plan, out, start: float) -> None:
        """A line for the step that ran `plan`'s round `out` (a `rounds.RoundOutput`)."""
        record = {"t": round(start, 6), "step_s": round(time.perf_counter() - start, 6),
                  "B": len(plan.decode), "prefill_tokens": sum(c.num_tokens for c in plan.chunks),
                  "prefill_path": engine.runner.prefill.label(),
                  "running": len(engine.scheduler.running),
                  "waiting": len(engine.scheduler.waiting),
                  "k": [p.k for p in out.proposals],
                  "accepted": [r.num_accepted for r in out.results],
                  "gained": [len(r.tokens) for r in out.results],
                  "draft_s": round(out.draft_s, 6), "verify_s": round(out.verify_s, 6)}
        if engine.spec is not None and plan.decode:
            record.update(engine.spec.describe(plan))
        self._write(json.dumps(record) + "\n")

    def _write(self, line: str) -> None:
        """Append a line, rotating the file past its bound; a failure is logged, not raised."""
        try:
            if self._file is None:
                self._file = _open(self._path, os.O_APPEND)
            self._file.write(line)
            if self._file.tell() > self._max_bytes:
                self._file.close()
                self._file = None
                os.replace(self._path, self._path + ".1")
                self._file = _open(self._path, os.O_TRUNC)
        except (OSError, ValueError) as e:  # ValueError: a file closed under it
            self._lost += 1
            now = time.monotonic()
            if self._logged_at is None or now - self._logged_at >= LOG_EVERY_S:
                log.warning("step trace %s: %d line(s) not written (%s)", self._path,
                            self._lost, e)
                self._logged_at, self._lost = now, 0


def _open(path: str, mode: int):
    """The trace file for appending (line-buffered text), never through a symbolic link."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | mode, 0o644)
    return os.fdopen(fd, "a", buffering=1)
