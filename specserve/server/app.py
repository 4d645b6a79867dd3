"""The FastAPI app: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health`,
`/metrics`, the OpenAPI schema (`/openapi.json`, `/docs`) and the chat page (`/`, from `static/`).

`build_app` takes a running `EngineClient` (an `AsyncEngine`, or a `ReplicaPool`) and what the
routes need to know about the model; it loads nothing, so tests and other front ends can build
one around any engine. `ServerLimits`
bounds what a request may ask for (`limits.py`); `Admission` refuses work beyond the waiting
bound with 429 (`admission.py`). Checking a body and preparing a request (template,
tokenizing, compiling its grammar with the `GrammarCompiler` given, if any) run in the bounded
`Intake` (`intake.py`), on worker threads, after a quick refusal when nothing more can be
admitted, so a large body never holds up other streams or `/health`. A stream is paced by its
client (`streams.py`): a client that stops reading has its engine request held, its slot
given to others, and is dropped by the write timeout if it reads nothing more (`guard.py`,
`http.py`).

When the engine is dead (`EngineClient.dead_reason`: its thread died or a step hung; for
replicas: none is live), every request, open or new, gets 503 `engine_dead` and `/health`
answers 503 with the reason; the process stays up so that clients get their answers and a
supervisor sees the failing probe.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from specserve.clients.client import EngineClient, EngineClosed, EngineDead, EngineError
from specserve.engine.outputs import RequestOutput
from specserve.models.tokenizer import Tokenizer
from specserve.server import errors, sse
from specserve.server.admission import Admission, Ticket
from specserve.server.config import DEFAULT_MAX_BODY_BYTES
from specserve.server.errors import APIError, from_value_error, internal_error
from specserve.server.guard import Guard
from specserve.server.intake import Intake, check_body, longest_token_chars
from specserve.server.limits import ServerLimits
from specserve.server.metrics import CONTENT_TYPE, ServerMetrics
from specserve.server.preparation import (GrammarCompiler, Job, ModelLimits, chat_jobs,
                                          completion_jobs)
from specserve.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from specserve.server.response_bodies import (ChatCompletionResponse, CompletionResponse,
                                              ErrorResponse, ModelList)
from specserve.server.responses import Responder, Shape
from specserve.server.tool_calls import ToolSupport, tool_support
from specserve.server.streams import ahead_of_client, merged, unless_disconnected, until

log = logging.getLogger("specserve.server")
STATIC = Path(__file__).with_name("static")  # the chat page at `/` (issue 17): plain HTML/CSS/JS
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                                           "frame-ancestors 'none'; base-uri 'none'; "
                                           "form-action 'self'",
                "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}
ERRORS = {status: {"model": ErrorResponse, "description": text} for status, text in [
    (400, "invalid request: malformed JSON, wrong type, out-of-range value, prompt or max_tokens "
          "beyond the context"),
    (401, "missing or wrong API key"), (404, "unknown model"), (413, "request body too large"),
    (415, "the body is not sent as JSON (Content-Type: application/json)"),
    (429, "the server is at capacity: retry after `Retry-After` seconds"),
    (503, "the server is shutting down, or its engine is dead"),
    (504, "the request ran past the server's request timeout")]}
STREAM_DOC = {"description": "the response; with `stream: true`, server-sent events of chunks "
                             "ending in `data: [DONE]`",
              "content": {sse.MEDIA_TYPE: {"schema": {"type": "string"}}}}


@dataclass
class ServerState:
    """What the routes share. `accepting` turns False when the server starts shutting down."""

    engine: EngineClient
    tokenizer: Tokenizer
    limits: ModelLimits
    metrics: ServerMetrics
    bounds: ServerLimits
    admission: Admission
    tools: ToolSupport
    intake: Intake
    compiler: GrammarCompiler | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    accepting: bool = True

    @property
    def dead_reason(self) -> str | None:
        return self.engine.dead_reason


def build_app(engine: EngineClient, tokenizer: Tokenizer, limits: ModelLimits, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, bounds: ServerLimits = ServerLimits(),
              compiler: GrammarCompiler | None = None) -> tuple[Guard, ServerState]:
    """The app around `engine`; `bounds`: what requests and clients may ask for (the
    defaults of `ServerLimits` unless given; no `max_prompt_chars`: `prompt_char_bound` of
    this model); `compiler`: checks and compiles requests' structured outputs (None: they are
    passed on unchecked)."""
    bounds = bounds.for_model(limits.max_model_len, longest_token_chars(
        tokenizer.backend.get_vocab(with_added_tokens=True)))
    state = ServerState(engine, tokenizer, limits, ServerMetrics(engine.stats, limits.name), bounds,
                        Admission(limits.max_num_seqs, bounds.max_waiting, bounds.retry_after_s),
                        tool_support(tokenizer), Intake(bounds.max_preparing, bounds.retry_after_s),
                        compiler)
    app = FastAPI(title="specserve", version="0.1.0", summary="OpenAI-compatible server with "
                  "speculative decoding (per-request settings and statistics)")
    errors.install(app)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**ERRORS, 200: STREAM_DOC})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        jobs = await _prepare(state, lambda: chat_jobs(body, state.tokenizer, state.limits,
                                                       state.bounds, state.tools, state.compiler),
                            body.n)
        return await _generate(state, request, body, jobs, Shape(chat=True), "chatcmpl",
                               jobs[0].params.logprobs)

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**ERRORS, 200: STREAM_DOC})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        jobs = await _prepare(state, lambda: completion_jobs(body, state.tokenizer, state.limits,
                                                             state.bounds, state.compiler),
                            body.n)
        return await _generate(state, request, body, jobs, Shape(chat=False), "cmpl", body.logprobs)

    @app.get("/v1/models", response_model=ModelList, responses={401: ERRORS[401]})
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": state.limits.name, "object": "model", "created": state.created,
            "owned_by": "specserve", "max_model_len": state.limits.max_model_len}]}

    @app.get("/health", responses={503: ERRORS[503]})
    async def health() -> JSONResponse:
        """200 while serving (with the speculative acceptance health flag); 503 once shutting
        down, when the engine is dead (with the reason) or once it cannot serve otherwise (its
        thread stopped after a shutdown)."""
        stats, dead = state.engine.stats(), state.dead_reason
        serving = state.accepting and state.engine.health()
        status = ("ok" if serving else "engine_dead" if dead else
                  "shutting_down" if not state.accepting else "unhealthy")
        body = {"status": status, "speculative_acceptance_healthy": stats.healthy,
                "running": stats.running, "waiting": stats.waiting}
        if dead:
            body["reason"] = dead
        return JSONResponse(body, status_code=200 if serving else 503)

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        """Prometheus text format."""
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        """The chat page: streaming answers with every token colored by its origin."""
        return FileResponse(STATIC / "index.html", headers=PAGE_HEADERS)

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    _document_400_not_422(app)
    guarded = Guard(app, max_body_bytes, api_key, state.metrics.error, bounds, state.intake,
                    lambda path, raw: check_body(path, raw, bounds.max_messages,
                                                 limits.max_model_len))
    app.state.server = state
    return guarded, state


def _document_400_not_422(app: FastAPI) -> None:
    """FastAPI documents a 422 for every body; this server answers validation errors with 400."""
    make_schema = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = make_schema()
            for path in schema["paths"].values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


async def _prepare(state: ServerState, make_jobs, sequences: int = 1) -> list[Job]:
    """The request's jobs, prepared in the intake once it is sure the request could be
    admitted now (`sequences`: at least as many as it asks for)."""
    if state.dead_reason is not None:
        raise _dead(state.dead_reason)
    if not state.accepting:
        raise APIError(503, "the server is shutting down", code="shutting_down")
    state.admission.refuse_unless_room(sequences)
    return await state.intake.run(make_jobs)


async def _generate(state: ServerState, request: Request, body: SamplingFields, jobs: list[Job],
                    shape: Shape, prefix: str, logprobs: int | None) -> Response:
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    spec_on = state.limits.speculative and all(
        j.speculation is None or j.speculation.enabled for j in jobs)
    responder = Responder(shape, request_id, body.model, body.n, state.tokenizer, logprobs,
                          body.return_token_origins, spec_on, jobs[0].tool_calls)
    ticket = state.admission.admit(len(jobs) * body.n)
    timeout = state.bounds.request_timeout
    deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _stream(state, jobs, request_id, responder, include_usage, deadline, ticket)
        weakref.finalize(chunks, ticket.release)  # also when the stream never starts
        return StreamingResponse(ahead_of_client(chunks), media_type=sse.MEDIA_TYPE,
                                 headers=sse.HEADERS)
    try:
        completed, outputs = await unless_disconnected(
            request, _collect(state, jobs, request_id, deadline))
    finally:
        ticket.release()
    if not completed:
        return Response(status_code=499)  # nobody is listening; the requests were aborted
    return JSONResponse(responder.body(outputs))


def _deltas(state: ServerState, jobs: list[Job], request_id: str, deadline: float | None):
    slots = state.limits.max_num_seqs
    share = None if slots is None else state.bounds.slots_per_request(slots)
    return until(deadline, merged(state.engine, jobs, request_id, share))


async def _collect(state: ServerState, jobs: list[Job], request_id: str,
                   deadline: float | None) -> list[RequestOutput]:
    outputs: list[RequestOutput | None] = [None] * len(jobs)
    try:
        async for i, delta in _deltas(state, jobs, request_id, deadline):
            _raise_engine_error(delta.error)
            if delta.finished:
                outputs[i] = delta.output
                state.metrics.observe(delta.output)
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - every failure gets its status (see _failure)
        raise _failure(state, e, request_id) from e
    return outputs


async def _stream(state: ServerState, jobs: list[Job], request_id: str, responder: Responder,
                  include_usage: bool, deadline: float | None, ticket: Ticket) -> AsyncIterator[str]:
    """SSE chunks; the last one (before `[DONE]`) carries `speculative_stats`, and the usage
    when asked for. Cancelled (the client went away) → the engine requests are aborted."""
    outputs: list[RequestOutput | None] = [None] * len(jobs)
    try:
        async for i, delta in _deltas(state, jobs, request_id, deadline):
            _raise_engine_error(delta.error)
            chunks = responder.chunks(i, delta.completions, include_usage)
            if delta.finished:
                outputs[i] = delta.output
                state.metrics.observe(delta.output)
            if all(o is not None for o in outputs):
                chunks = _last_chunks(responder, chunks, outputs, include_usage)
            for chunk in chunks:
                yield sse.event(chunk)
    except Exception as e:  # noqa: BLE001 - headers are sent: the error goes in the stream
        yield sse.event(_failure(state, e, request_id).body())
    finally:
        ticket.release()
    yield sse.DONE


def _failure(state: ServerState, e: Exception, request_id: str) -> APIError:
    """The API error for a request that failed while it ran."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return from_value_error(e)
    if isinstance(e, TimeoutError):
        return APIError(504, f"the request ran past this server's request timeout of "
                        f"{state.bounds.request_timeout:g} s and was aborted", code="request_timeout")
    if isinstance(e, EngineDead) or state.dead_reason is not None:
        return _dead(state.dead_reason or str(e))
    if isinstance(e, EngineClosed):
        return APIError(503, str(e), code="shutting_down")
    if isinstance(e, EngineError):
        # the engine's own message (e.g. which replica failed) and its cause's traceback, if any
        return internal_error("in the engine", e, traceback=e.__cause__, request_id=request_id,
                              code="engine_error")
    return internal_error("while serving", e, traceback=e, request_id=request_id)


def _dead(reason: str) -> APIError:
    return APIError(503, f"the engine is dead ({reason}); this server answers no more requests "
                    f"until it is restarted", code="engine_dead")


def _last_chunks(responder: Responder, chunks: list[dict], outputs: list[RequestOutput],
                 include_usage: bool) -> list[dict]:
    chunks = list(chunks)
    if include_usage:
        chunks.append(responder.usage_chunk(outputs))
    elif not chunks:
        chunks.append(responder.envelope(responder.shape.chunk_object, []))
    chunks[-1]["speculative_stats"] = responder.stats(outputs)
    return chunks


def _raise_engine_error(error: BaseException | None) -> None:
    if error is not None:
        raise error
