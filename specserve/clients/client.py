"""`EngineClient`: what a front end (the HTTP app, its stream helpers) needs of an engine it
does not own: stream a request's deltas, abort it, read the engine's stats and health, shut
it down. `AsyncEngine` (one engine on a thread of this process) and `ReplicaPool` (engine
replicas behind Ray Serve) implement it; the app is written against it alone.

A stream raises `EngineClosed` when the engine takes no new requests (it is shutting down,
or its thread stopped), `EngineError` when the request failed inside the engine, and
`EngineDead` (an `EngineError`) when the engine itself died or hung: it will serve nothing
more, and `health` is False.
"""

from __future__ import annotations

from typing import AsyncIterator, Protocol, runtime_checkable

from specserve.engine.outputs import EngineStats, RequestDelta, SpeculationOverride
from specserve.sampling.params import SamplingParams


class EngineError(RuntimeError):
    """A request failed inside the engine (the cause is chained)."""


class EngineClosed(RuntimeError):
    """The engine is shutting down and takes no new requests."""


class EngineDead(EngineError):
    """The engine thread died or a step never returned: nothing will be served any more."""


@runtime_checkable
class EngineClient(Protocol):
    def stream(self, prompt: str | list[int], params: SamplingParams,
               request_id: str | None = None,
               speculation: SpeculationOverride | None = None,
               client: str | None = None) -> AsyncIterator[RequestDelta]:
        """Add a request and yield its deltas until it finishes; leaving early aborts it.
        `client`: whom it serves (the engine shares its slots among clients). A reader that
        stops taking deltas may have its request held (not scheduled) until it takes them."""
        ...

    def abort(self, request_id: str) -> None:
        """Finish a request with "abort" and free its memory (any thread, any moment)."""
        ...

    def stats(self) -> EngineStats:
        """The engine's latest state: running, waiting, KV use, speculation."""
        ...

    def health(self) -> bool:
        """True while the engine takes and serves requests."""
        ...

    @property
    def dead_reason(self) -> str | None:
        """None while the engine can serve; else why it never will again (`EngineDead`)."""
        ...

    def shutdown(self, timeout: float | None = None) -> None:
        """Take no new requests; let those in flight finish for up to `timeout` seconds, then
        abort the rest."""
        ...
