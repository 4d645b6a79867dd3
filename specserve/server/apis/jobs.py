"""From a Responses or Messages body to the engine's jobs: the wire's body becomes the chat
request (`chat_body`), which goes through the chat endpoint's own preparation (`chat_jobs`:
template, limits, tool parsing, grammar), so every check and bound applies alike. A
`max_tokens` beyond the room the prompt leaves is that room (these clients ask for more than
any context: Claude Code sends 32,000). An error names the wire's own field
(`RENAMED`)."""

from __future__ import annotations

import re

from pydantic import ValidationError

from specserve.server.apis import messages_request, responses_request
from specserve.server.apis.responses_request import ResponsesRequest, ToolNames
from specserve.server.errors import APIError
from specserve.server.preparation import Job, chat_jobs, field_error
from specserve.server.protocol import ChatCompletionRequest

# the chat request's fields as the Responses API names them
RENAMED = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}


def responses_jobs(req: ResponsesRequest, *context) -> tuple[list[Job], ToolNames]:
    """`context`: what `chat_jobs` takes after the request."""
    try:
        try:
            body, names = responses_request.chat_body(req)
        except ValueError as e:
            raise field_error(e) from e
        return _jobs(body, context), names
    except APIError as e:
        raise _renamed(e) from e


def messages_jobs(req: messages_request.CountTokensRequest, *context) -> list[Job]:
    try:
        body = messages_request.chat_body(req)
    except ValueError as e:
        raise field_error(e) from e
    return _jobs(body, context)


def _jobs(body: dict, context: tuple) -> list[Job]:
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        param = str(first["loc"][0]) if first["loc"] else None
        raise APIError(400, f"{where}: {first['msg']}", param=param) from e
    return chat_jobs(chat, *context, bound_max_tokens=True)


def _renamed(e: APIError) -> APIError:
    if e.param not in RENAMED:
        return e
    name = RENAMED[e.param]
    message = re.sub(rf"^{e.param}\b", name, e.message)
    return APIError(e.status, message, param=name, code=e.code, type=e.type, headers=e.headers)
