"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`; on the
Anthropic Messages API's routes (`/v1/messages...`) Anthropic's: `{"type": "error", "error":
{"type", "message"}}` (`body_for`).

Everything a client can get wrong ends here as a 4xx: pydantic's validation errors (wrong
types, out-of-range values, malformed JSON), `ValueError`s from sampling parameters or the
engine (their messages start with the field's name), unknown routes and methods. Anything
else is a bug and gets a 500 with the same shape, naming a request id; the exception and its
traceback go to the log under that id, never into the body.
"""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("specserve.server")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
         405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
         421: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable_error",
         504: "timeout_error"}


ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}
ANTHROPIC_PATHS = "/v1/messages"


class APIError(Exception):
    """A request the server refuses, with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self, path: str = "") -> JSONResponse:
        return JSONResponse(body_for(path, self), status_code=self.status, headers=self.headers)


def anthropic_body(e: APIError) -> dict:
    kind = ANTHROPIC_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def body_for(path: str, e: APIError) -> dict:
    """The error body in the shape of the API `path` belongs to."""
    return anthropic_body(e) if path.startswith(ANTHROPIC_PATHS) else e.body()


def from_value_error(e: ValueError, code: str = "invalid_value") -> APIError:
    """A `ValueError` from our own validation: its message starts with the field's name."""
    message = str(e)
    first = message.split(" ", 1)[0].strip(":,")
    param = first if first.isidentifier() and first.islower() else None
    return APIError(400, message, param=param, code=code)


def from_validation_error(e: RequestValidationError) -> APIError:
    """The first of pydantic's errors, named by its path in the body."""
    errors = e.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('msg')}", code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    if first.get("type") == "missing" and not loc:
        return APIError(400, "request body must be a JSON object", code="invalid_json")
    code = "unknown_field" if first.get("type") == "extra_forbidden" else "invalid_value"
    return APIError(400, f"{where}: {first.get('msg')}", param=param, code=code)


def install(app: FastAPI) -> None:
    """Route every failure through the OpenAI error shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        return from_validation_error(e).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status_code)
        return APIError(e.status_code, str(e.detail), code=code).response(request.url.path)

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception) -> JSONResponse:
        error = internal_error(f"serving {request.url.path}", e, traceback=e)
        return error.response(request.url.path)


def internal_error(what: str, e: BaseException, *, traceback: BaseException | None,
                   request_id: str | None = None, code: str = "internal_error") -> APIError:
    """A 500 that names an id to look up in the log, which has the exception and the traceback
    of `traceback` (None: none); the body carries no internal text."""
    request_id = request_id or f"err-{uuid.uuid4().hex}"
    log.error("request %s failed %s: %r", request_id, what, e, exc_info=traceback)
    return APIError(500, f"internal server error (request id {request_id}; see the server log)",
                    code=code)
