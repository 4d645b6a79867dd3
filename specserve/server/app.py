"""The FastAPI app: `/v1/chat/completions`, `/v1/completions`, the agents' wires
(`/v1/responses`: OpenAI's Responses API; `/v1/messages` and `/v1/messages/count_tokens`:
Anthropic's Messages API; `apis/`), `/v1/models`, `/health`, `/metrics`, the OpenAPI schema
(`/openapi.json`, `/docs`) and the chat page (`/`, from `static/`).

Every generation route goes the same way: its body becomes jobs in the intake (the wires
through the chat request, so one template path, one parser and one grammar), then
`_generate` runs them under the same admission, deadline and stream rules and hands the
engine's output to the wire's renderer (`responses.ChatRenderer`, `apis/*_render.py`), whose
parsing of the output runs off the event loop.

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
from specserve.server.apis.jobs import messages_jobs, responses_jobs
from specserve.server.apis.messages_render import MessagesRenderer
from specserve.server.apis.messages_request import CountTokensRequest, MessagesRequest
from specserve.server.apis.responses_render import ResponsesRenderer
from specserve.server.apis.responses_request import ResponsesRequest
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
from specserve.server.responses import ChatRenderer, Responder, Shape
from specserve.server.tool_calls import ToolSupport, tool_support
from specserve.server.streams import (HEARTBEAT, ahead_of_client, merged, unless_disconnected,
                                      until, with_heartbeats)

log = logging.getLogger("specserve.server")
HEARTBEAT_S = 10.0  # a stream quiet this long (a long prefill) sends its wire's keep-alive
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
WIRE_STREAM_DOC = {"description": "the response; with `stream: true`, the API's named "
                                  "server-sent events",
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
        jobs = await _prepare(state, lambda: chat_jobs(body, *_context(state)), body.n)
        return await _generate(state, request, body.stream, jobs, body.n, _chat_renderer(
            state, body, jobs, Shape(chat=True), "chatcmpl", jobs[0].params.logprobs))

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**ERRORS, 200: STREAM_DOC})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        jobs = await _prepare(state, lambda: completion_jobs(body, state.tokenizer, state.limits,
                                                             state.bounds, state.compiler),
                            body.n)
        return await _generate(state, request, body.stream, jobs, body.n, _chat_renderer(
            state, body, jobs, Shape(chat=False), "cmpl", body.logprobs))

    @app.post("/v1/responses", responses={**ERRORS, 200: WIRE_STREAM_DOC})
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API (stateless: see `apis/responses_request.py`)."""
        jobs, names = await _prepare(state, lambda: responses_jobs(body, *_context(state)))
        return await _generate(state, request, body.stream, jobs, 1, ResponsesRenderer(
            body, names, jobs[0].tool_calls, _speculating(state, jobs)))

    @app.post("/v1/messages", responses={**ERRORS, 200: WIRE_STREAM_DOC})
    async def messages(body: MessagesRequest, request: Request) -> Response:
        """Anthropic's Messages API (see `apis/messages_request.py`); errors in its shape."""
        jobs = await _prepare(state, lambda: messages_jobs(body, *_context(state)))
        return await _generate(state, request, body.stream, jobs, 1, MessagesRenderer(
            body.model, len(jobs[0].prompt_ids), jobs[0].tool_calls, _speculating(state, jobs)))

    @app.post("/v1/messages/count_tokens", responses=ERRORS)
    async def count_tokens(body: CountTokensRequest) -> dict:
        """The input tokens `/v1/messages` would give the same body (nothing is generated)."""
        jobs = await _prepare(state, lambda: messages_jobs(body, *_context(state)), 0)
        return {"input_tokens": len(jobs[0].prompt_ids)}

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

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
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


def _context(state: ServerState) -> tuple:
    """What `chat_jobs` takes after the request."""
    return state.tokenizer, state.limits, state.bounds, state.tools, state.compiler


async def _prepare(state: ServerState, make_jobs, sequences: int = 1):
    """The request's jobs, prepared in the intake once it is sure the request could be
    admitted now (`sequences`: at least as many as it asks for)."""
    if state.dead_reason is not None:
        raise _dead(state.dead_reason)
    if not state.accepting:
        raise APIError(503, "the server is shutting down", code="shutting_down")
    state.admission.refuse_unless_room(sequences)
    return await state.intake.run(make_jobs)


def _speculating(state: ServerState, jobs: list[Job]) -> bool:
    return state.limits.speculative and all(
        j.speculation is None or j.speculation.enabled for j in jobs)


def _chat_renderer(state: ServerState, body: SamplingFields, jobs: list[Job], shape: Shape,
                   prefix: str, logprobs: int | None) -> ChatRenderer:
    responder = Responder(shape, f"{prefix}-{uuid.uuid4().hex}", body.model, body.n,
                          state.tokenizer, logprobs, body.return_token_origins,
                          _speculating(state, jobs), jobs[0].tool_calls)
    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
    return ChatRenderer(responder, include_usage)


async def _generate(state: ServerState, request: Request, stream: bool, jobs: list[Job], n: int,
                    renderer) -> Response:
    """Run `jobs` (each of `n` completions) and answer with `renderer`'s body, or its events
    as they come (`stream`)."""
    request_id = uuid.uuid4().hex
    ticket = state.admission.admit(len(jobs) * n)
    timeout = state.bounds.request_timeout
    deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
    if stream:
        events = _stream(state, jobs, request_id, renderer, deadline, ticket)
        weakref.finalize(events, ticket.release)  # also when the stream never starts
        return StreamingResponse(ahead_of_client(events), media_type=sse.MEDIA_TYPE,
                                 headers=sse.HEADERS)
    try:
        completed, outputs = await unless_disconnected(
            request, _collect(state, jobs, request_id, deadline))
    finally:
        ticket.release()
    if not completed:
        return Response(status_code=499)  # nobody is listening; the requests were aborted
    body = await _off_loop(renderer, renderer.body, outputs)
    return JSONResponse(body)


async def _off_loop(renderer, work, *args):
    """`work(*args)` on a worker thread where it parses model output (its time grows with
    the output, which a client can make long), else here."""
    if renderer.parses:
        return await asyncio.to_thread(work, *args)
    return work(*args)


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


async def _stream(state: ServerState, jobs: list[Job], request_id: str, renderer,
                  deadline: float | None, ticket: Ticket) -> AsyncIterator[str]:
    """The renderer's events: its opening ones, one batch per engine step, its keep-alive
    whenever `HEARTBEAT_S` pass without one (a long prompt's prefill), its closing ones once
    every job has finished. Cancelled (the client went away) → the engine requests are
    aborted; a failure once events are sent is the renderer's failure events."""
    outputs: list[RequestOutput | None] = [None] * len(jobs)
    try:
        for event in renderer.start():
            yield event
        deltas = _deltas(state, jobs, request_id, deadline)
        async for item in with_heartbeats(deltas, HEARTBEAT_S):
            if item is HEARTBEAT:
                for event in renderer.keepalive():
                    yield event
                continue
            i, delta = item
            _raise_engine_error(delta.error)
            events = await _off_loop(renderer, renderer.step, i, delta.completions)
            if delta.finished:
                outputs[i] = delta.output
                state.metrics.observe(delta.output)
            if all(o is not None for o in outputs):
                events = await _off_loop(renderer, renderer.close, outputs, events)
            for event in events:
                yield event
    except Exception as e:  # noqa: BLE001 - headers are sent: the error goes in the stream
        for event in renderer.failure(_failure(state, e, request_id)):
            yield event
    finally:
        ticket.release()


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


def _raise_engine_error(error: BaseException | None) -> None:
    if error is not None:
        raise error
