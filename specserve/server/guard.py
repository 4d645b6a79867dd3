"""An ASGI layer in front of the app: refuses oversized bodies (413) before they are read in
full, a Host header that does not name this server (400: a web page on a rebinding DNS
name must not reach a loopback server), a missing or wrong API key on `/v1/` routes and
`/metrics` (401), a POST to `/v1/` whose body is not declared JSON (415: a page elsewhere can
send a body without a JSON content type, and no key, with no CORS preflight), and counts error
statuses for `/metrics`. `/health` answers any Host, so a supervisor may probe by address.

On every POST under `/v1/` (whatever the route, so a new one is covered too) the body is read
here, in full, then checked by the intake (`intake.check_body`, on a worker thread; 429 when
the intake is full, 400 for JSON nested too deep and for what would make the app's own
validation long) before the app reads it. Every response says
`X-Content-Type-Options: nosniff`.

Streams are paced by their readers: after each part of a streamed body is sent, `send` waits
while the client has more than `max_unread_bytes` unread (the connection's `Backlog`, from
the HTTP layer) and drops a client that takes nothing for `write_timeout_s` meanwhile; the
app's stream, and the engine request behind it, wait with it (`streams.py`). And each
request runs with `streams.CLIENT` set to its client's address, whom its engine requests
serve."""

from __future__ import annotations

import email.message
import hmac
import json
from typing import Callable

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specserve.server.errors import APIError, body_for
from specserve.server.http import BACKLOG
from specserve.server.intake import Intake
from specserve.server.limits import ServerLimits
from specserve.server.streams import CLIENT

BodyCheck = Callable[[str, bytes], "APIError | None"]


class Guard:
    def __init__(self, app: ASGIApp, max_body_bytes: int, api_key: str | None,
                 on_error: Callable[[int], None], bounds: ServerLimits = ServerLimits(),
                 intake: Intake | None = None, check_body: BodyCheck | None = None) -> None:
        self.app, self.max_body_bytes, self.api_key, self.on_error = app, max_body_bytes, api_key, on_error
        self.bounds = bounds  # the allowed Host names
        self.intake, self.check_body = intake, check_body  # None: bodies go to the app as sent

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        send = self._paced(scope, self._counting(send))
        try:
            refusal = self._refusal(scope["method"], scope["path"], headers)
            if refusal is None and self._checks_body(scope):
                receive = await self._checked_body(scope["path"], receive)
        except APIError as e:
            refusal = e
        if refusal is not None:
            await _send_error(send, refusal, scope["path"])
            return
        token = CLIENT.set(client_of(scope))
        try:
            await self.app(scope, self._limited(receive), send)
        finally:
            CLIENT.reset(token)

    def _paced(self, scope: Scope, send: Send) -> Send:
        """`send`, waiting after each part of a streamed body while the client has more than
        `max_unread_bytes` unread (see the module)."""
        backlog = scope.get("extensions", {}).get(BACKLOG)
        if backlog is None:
            return send

        async def paced_send(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and message.get("more_body"):
                await backlog.drained(self.bounds.max_unread_bytes, self.bounds.write_timeout_s)
        return paced_send

    def _counting(self, send: Send) -> Send:
        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                if message["status"] >= 400:
                    self.on_error(message["status"])
                message = {**message, "headers": [*message.get("headers", []),
                                                   (b"x-content-type-options", b"nosniff")]}
            await send(message)
        return counting_send

    def _limited(self, receive: Receive) -> Receive:
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:  # a body sent without a Content-Length
                    raise HTTPException(413, self._too_large().message)
            return message
        return limited_receive

    def _checks_body(self, scope: Scope) -> bool:
        return (self.intake is not None and self.check_body is not None
                and scope["method"] == "POST" and scope["path"].startswith("/v1/"))

    async def _checked_body(self, path: str, receive: Receive) -> Receive:
        """Read the whole body (413 beyond the limit), have the intake check it, and hand the
        app a `receive` that gives the body once, then what the client sends next (its
        disconnect)."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise APIError(499, "the client went away")
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                raise self._too_large()
            more = message.get("more_body", False)
        body = b"".join(chunks)
        problem = await self.intake.run(lambda: self.check_body(path, body))
        if problem is not None:
            raise problem
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return replay

    def _refusal(self, method: str, path: str, headers: dict[str, str]) -> APIError | None:
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return self._too_large()
        if path != "/health" and not self.bounds.allows_host(headers.get("host", "")):
            return APIError(400, f"Host {headers.get('host', '')!r} is not one this server answers "
                            f"to (see --allowed-hosts)", code="host_not_allowed")
        if self.api_key is not None and (path.startswith("/v1/") or path == "/metrics"):
            refusal = self._key_refusal(headers)
            if refusal is not None:
                return refusal
        if method == "POST" and path.startswith("/v1/") \
                and not is_json(headers.get("content-type")):
            return APIError(415, f"the body must be sent as JSON (Content-Type: application/json), "
                            f"got {headers.get('content-type')!r}", code="unsupported_media_type")
        return None

    def _key_refusal(self, headers: dict[str, str]) -> APIError | None:
        """The key comes as `Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key`
        (Anthropic's)."""
        auth, key = headers.get("authorization", ""), headers.get("x-api-key")
        if not auth and key is None:
            return APIError(401, "missing API key: send 'Authorization: Bearer <key>' or "
                            "'x-api-key: <key>'", code="missing_api_key")
        scheme, _, token = auth.partition(" ")
        given = token.strip() if auth and scheme.lower() == "bearer" else key
        if given is None or not hmac.compare_digest(given.encode(), self.api_key.encode()):
            return APIError(401, "invalid API key", code="invalid_api_key")
        return None

    def _too_large(self) -> APIError:
        return APIError(413, f"request body exceeds {self.max_body_bytes} bytes",
                        code="request_too_large")


def client_of(scope: Scope) -> str | None:
    """Whom a request is for: its client's address (one API key serves every client here)."""
    client = scope.get("client")
    return client[0] if client else None


def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type names JSON (application/json, application/*+json)."""
    if not content_type:
        return False
    parsed = email.message.Message()
    parsed["content-type"] = content_type
    subtype = parsed.get_content_subtype()
    return parsed.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json"))


async def _send_error(send: Send, error: APIError, path: str) -> None:
    body = json.dumps(body_for(path, error)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1"))
                for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
