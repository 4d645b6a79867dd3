"""`Intake`: the bounded stage between a request's body arriving and its admission, where the
work a client can make expensive happens: parsing a body and tokenizing its prompts.

That work runs on `threads` worker threads of its own (never on the event loop, never in an
unbounded queue), for at most `max_preparing` requests at once, queued or running: one more
gets 429 with `Retry-After` at once, before any of its work is done. A slot is held until
its work has finished, even when the client that asked for it went away, so requests that
leave cannot pile work up behind the bound.

`check_body` is the first piece of that work for every POST under `/v1/` (whatever its path,
so a new route gets it too): the body is scanned for its nesting depth without recursion, then
parsed once, on a worker thread, and refused (400) when it nests deeper than
`json_depth.MAX_DEPTH` (as do the tool arguments it carries as JSON text, strings under an
`arguments` key), is malformed, or holds more than the server takes of what would make
validating it long (on the routes that have them: messages and their text parts beyond
`max_messages`, prompt token lists longer than the context), so the app's own parse and
validation, on the event loop, only ever see bodies of bounded size, depth and count.
"""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from specserve import json_depth
from specserve.server.errors import APIError

T = TypeVar("T")
# where each wire keeps its conversation: the field, and the field of each entry's parts
CONVERSATIONS = {"/v1/chat/completions": ("messages", "content"),
                 "/v1/messages": ("messages", "content"),
                 "/v1/messages/count_tokens": ("messages", "content"),
                 "/v1/responses": ("input", "content")}


class Intake:
    def __init__(self, max_preparing: int, retry_after_s: int, threads: int = 2) -> None:
        self.max_preparing, self.retry_after_s = max_preparing, retry_after_s
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="intake")
        self._lock = threading.Lock()
        self.preparing = 0  # requests whose work is queued or running

    async def run(self, work: Callable[[], T]) -> T:
        """`work()` on a worker thread, or 429 when `max_preparing` requests are in hand."""
        with self._lock:
            if self.preparing >= self.max_preparing:
                raise APIError(429, f"the server is at capacity ({self.preparing} requests being "
                               f"prepared); retry after {self.retry_after_s} s",
                               code="server_overloaded", type="rate_limit_error",
                               headers={"Retry-After": str(self.retry_after_s)})
            self.preparing += 1
        future = self._pool.submit(work)
        future.add_done_callback(self._release)  # when the work ends, or is cancelled unstarted
        return await asyncio.wrap_future(future)

    def _release(self, _future) -> None:
        with self._lock:
            self.preparing -= 1


def check_body(path: str, body: bytes, max_messages: int, max_model_len: int) -> APIError | None:
    """Why the body of a request to `path` is refused before the app validates it: JSON
    nested too deep (the body, or tool arguments in it), malformed JSON, more than
    `max_messages` messages (or text parts over all of them), a prompt of token ids that
    cannot fit `max_model_len`; None when the app may read it (what else is wrong with it,
    the app's validation says)."""
    try:
        json_depth.check_text(body, "")
        data = json.loads(body)
        _check_arguments(data)
    except json_depth.NestedTooDeep as e:
        return APIError(400, str(e), param=e.field, code="nested_too_deep")
    except (ValueError, UnicodeDecodeError) as e:
        return APIError(400, f"malformed JSON body: {e}", code="invalid_json")
    if not isinstance(data, dict):
        return None
    name, part = CONVERSATIONS.get(path, ("messages", "content"))
    messages = data.get(name)
    if path in CONVERSATIONS and isinstance(messages, list):
        parts = sum(len(m[part]) for m in messages
                    if isinstance(m, dict) and isinstance(m.get(part), list))
        if max(len(messages), parts) > max_messages:
            return APIError(400, f"{name}: {len(messages)} entries with {parts} parts; this "
                            f"server takes at most {max_messages} of each per request",
                            param=name, code="too_many_messages")
    prompt = data.get("prompt")
    if path == "/v1/completions" and isinstance(prompt, list) and prompt \
            and isinstance(prompt[0], (int, list)):
        lists = prompt if isinstance(prompt[0], list) else [prompt]
        longest = max(len(p) if isinstance(p, list) else 0 for p in lists)
        if longest >= max_model_len:
            return APIError(400, f"prompt: a prompt of {longest} token ids does not fit this "
                            f"model's context of {max_model_len} tokens", param="prompt",
                            code="context_length_exceeded")
    return None


def _check_arguments(data: object) -> None:
    """Check the depth of every string under an `arguments` key (tool calls' arguments, JSON
    text that is parsed later); `data` is nested at most `MAX_DEPTH` deep already."""
    stack: list[tuple[object, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value) \
            if isinstance(value, list) else ()
        for key, child in items:
            where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}".lstrip(".")
            if key == "arguments" and isinstance(child, str):
                json_depth.check_text(child, where)
            elif isinstance(child, (dict, list)):
                stack.append((child, where))


def longest_token_chars(vocabulary: dict[str, int]) -> int:
    """Characters of the longest entry of a tokenizer's vocabulary, as the backend stores it
    (byte-level BPE: one character per byte), at least the characters one token stands for."""
    return max(map(len, vocabulary), default=1)
