"""An ASGI layer in front of the app: refuses oversized bodies (413) before they are read in
full, a Host header that does not name this server (400: a web page on a rebinding DNS
name must not reach a loopback server), a missing or wrong API key on `/v1/` routes and
`/metrics` (401), and counts error statuses for `/metrics`. `/health` answers any Host, so a
supervisor may probe by address."""

from __future__ import annotations

import hmac
import json
from typing import Callable

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specserve.server.errors import APIError
from specserve.server.limits import ServerLimits


class Guard:
    def __init__(self, app: ASGIApp, max_body_bytes: int, api_key: str | None,
                 on_error: Callable[[int], None], bounds: ServerLimits = ServerLimits()) -> None:
        self.app, self.max_body_bytes, self.api_key, self.on_error = app, max_body_bytes, api_key, on_error
        self.bounds = bounds  # the allowed Host names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self._refusal(scope["path"], headers)
        if refusal is not None:
            await _send_error(send, refusal)
            self.on_error(refusal.status)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:  # a body sent without a Content-Length
                    raise HTTPException(413, self._too_large().message)
            return message

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.on_error(message["status"])
            await send(message)

        await self.app(scope, limited_receive, counting_send)

    def _refusal(self, path: str, headers: dict[str, str]) -> APIError | None:
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return self._too_large()
        if path != "/health" and not self.bounds.allows_host(headers.get("host", "")):
            return APIError(400, f"Host {headers.get('host', '')!r} is not one this server answers "
                            f"to (see --allowed-hosts)", code="host_not_allowed")
        if self.api_key is not None and (path.startswith("/v1/") or path == "/metrics"):
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if not auth:
                return APIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                                code="missing_api_key")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                      self.api_key.encode()):
                return APIError(401, "invalid API key", code="invalid_api_key")
        return None

    def _too_large(self) -> APIError:
        return APIError(413, f"request body exceeds {self.max_body_bytes} bytes",
                        code="request_too_large")


async def _send_error(send: Send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
