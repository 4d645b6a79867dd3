"""The FastAPI app: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health`,
`/metrics`, the OpenAPI schema (`/openapi.json`, `/docs`) and the chat page (`/`, from `static/`).

`build_app` takes a running `EngineClient` (an `AsyncEngine`, or a `ReplicaPool`) and what the
routes need to know about the model; it loads nothing, so tests and other front ends can build
one around any engine.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from specserve.engine.client import EngineClient, EngineClosed, EngineError
from specserve.engine.outputs import RequestOutput
from specserve.models.tokenizer import Tokenizer
from specserve.server import errors, sse
from specserve.server.errors import APIError, from_value_error
from specserve.server.config import DEFAULT_MAX_BODY_BYTES
from specserve.server.guard import Guard
from specserve.server.metrics import CONTENT_TYPE, ServerMetrics
from specserve.server.preparation import Job, ModelLimits, chat_jobs, completion_jobs
from specserve.server.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                       CompletionResponse, ErrorResponse, ModelList, SamplingFields)
from specserve.server.responses import Responder, Shape
from specserve.server.streams import merged, unless_disconnected

log = logging.getLogger("specserve.server")
STATIC = Path(__file__).with_name("static")  # the chat page at `/` (issue 17): plain HTML/CSS/JS
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:",
                "Cache-Control": "no-cache"}
ERRORS = {status: {"model": ErrorResponse, "description": text} for status, text in [
    (400, "invalid request: malformed JSON, wrong type, out-of-range value, prompt or max_tokens "
          "beyond the context"),
    (401, "missing or wrong API key"), (404, "unknown model"), (413, "request body too large"),
    (503, "the server is shutting down")]}
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
    created: int = field(default_factory=lambda: int(time.time()))
    accepting: bool = True


def build_app(engine: EngineClient, tokenizer: Tokenizer, limits: ModelLimits, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> tuple[Guard, ServerState]:
    state = ServerState(engine, tokenizer, limits, ServerMetrics(engine.stats, limits.name))
    app = FastAPI(title="specserve", version="0.1.0", summary="OpenAI-compatible server with "
                  "speculative decoding (per-request settings and statistics)")
    errors.install(app)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**ERRORS, 200: STREAM_DOC})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        jobs = _prepare(state, lambda: chat_jobs(body, state.tokenizer, state.limits))
        return await _generate(state, request, body, jobs, Shape(chat=True), "chatcmpl",
                               jobs[0].params.logprobs)

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**ERRORS, 200: STREAM_DOC})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        jobs = _prepare(state, lambda: completion_jobs(body, state.tokenizer, state.limits))
        return await _generate(state, request, body, jobs, Shape(chat=False), "cmpl", body.logprobs)

    @app.get("/v1/models", response_model=ModelList, responses={401: ERRORS[401]})
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": state.limits.name, "object": "model", "created": state.created,
            "owned_by": "specserve", "max_model_len": state.limits.max_model_len}]}

    @app.get("/health", responses={503: ERRORS[503]})
    async def health() -> JSONResponse:
        """200 while serving (with the speculative acceptance health flag), 503 once shutting
        down or once the engine cannot serve (its thread stopped, no replica is live)."""
        stats = state.engine.stats()
        serving = state.accepting and state.engine.health()
        status = "ok" if serving else "unhealthy" if state.accepting else "shutting_down"
        body = {"status": status, "speculative_acceptance_healthy": stats.healthy,
                "running": stats.running, "waiting": stats.waiting}
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
    guarded = Guard(app, max_body_bytes, api_key, state.metrics.error)
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


def _prepare(state: ServerState, make_jobs) -> list[Job]:
    if not state.accepting:
        raise APIError(503, "the server is shutting down", code="shutting_down")
    return make_jobs()


async def _generate(state: ServerState, request: Request, body: SamplingFields, jobs: list[Job],
                    shape: Shape, prefix: str, logprobs: int | None) -> Response:
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    spec_on = state.limits.speculative and all(
        j.speculation is None or j.speculation.enabled for j in jobs)
    responder = Responder(shape, request_id, body.model, body.n, state.tokenizer, logprobs,
                          body.return_token_origins, spec_on)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(state, jobs, request_id, responder, include_usage),
                                 media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
    completed, outputs = await unless_disconnected(request, _collect(state, jobs, request_id))
    if not completed:
        return Response(status_code=499)  # nobody is listening; the requests were aborted
    return JSONResponse(responder.body(outputs))


async def _collect(state: ServerState, jobs: list[Job], request_id: str) -> list[RequestOutput]:
    outputs: list[RequestOutput | None] = [None] * len(jobs)
    try:
        async for i, delta in merged(state.engine, jobs, request_id):
            _raise_engine_error(delta.error)
            if delta.finished:
                outputs[i] = delta.output
                state.metrics.observe(delta.output)
    except ValueError as e:
        raise from_value_error(e) from e
    except EngineClosed as e:
        raise APIError(503, str(e), code="shutting_down") from e
    except EngineError as e:
        log.error("%s", e, exc_info=e.__cause__)
        raise APIError(500, str(e), code="engine_error") from e
    return outputs


async def _stream(state: ServerState, jobs: list[Job], request_id: str, responder: Responder,
                  include_usage: bool) -> AsyncIterator[str]:
    """SSE chunks; the last one (before `[DONE]`) carries `speculative_stats`, and the usage
    when asked for. Cancelled (the client went away) → the engine requests are aborted."""
    outputs: list[RequestOutput | None] = [None] * len(jobs)
    try:
        async for i, delta in merged(state.engine, jobs, request_id):
            _raise_engine_error(delta.error)
            chunk = responder.chunk(i, delta.completions, include_usage)
            if delta.finished:
                outputs[i] = delta.output
                state.metrics.observe(delta.output)
            if all(o is not None for o in outputs):
                for last in _last_chunks(responder, chunk, outputs, include_usage):
                    yield sse.event(last)
            elif chunk is not None:
                yield sse.event(chunk)
    except ValueError as e:
        yield sse.event(from_value_error(e).body())
    except EngineClosed as e:
        yield sse.event(APIError(503, str(e), code="shutting_down").body())
    except EngineError as e:
        log.error("%s", e, exc_info=e.__cause__)
        yield sse.event(APIError(500, str(e), code="engine_error").body())
    except Exception as e:  # noqa: BLE001 - headers are sent: the error goes in the stream
        log.exception("request %s failed", request_id)
        yield sse.event(APIError(500, f"internal error: {e}", code="internal_error").body())
    yield sse.DONE


def _last_chunks(responder: Responder, chunk: dict | None, outputs: list[RequestOutput],
                 include_usage: bool) -> list[dict]:
    chunks = [chunk] if chunk is not None else []
    if include_usage:
        chunks.append(responder.usage_chunk(outputs))
    elif not chunks:
        chunks.append(responder.envelope(responder.shape.chunk_object, []))
    chunks[-1]["speculative_stats"] = responder.stats(outputs)
    return chunks


def _raise_engine_error(error: BaseException | None) -> None:
    if error is not None:
        raise error
