"""The engine's output as the Responses API gives it: a `response` object, or its stream of
events.

Streamed, as OpenAI documents the sequence (each event with its `sequence_number`):
`response.created`, `response.in_progress`; per message item `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`..., `response.output_text.done`,
`response.content_part.done`, `response.output_item.done`; per call item
`response.output_item.added`, `response.function_call_arguments.delta`,
`response.function_call_arguments.done`, `response.output_item.done` (custom tools: the item
alone, its `input` whole); then `response.completed` (or `response.incomplete`, reason
`max_output_tokens`) with the usage and the whole response, which equals the body a
non-streamed request gets, items, ids and all. A failure after the first event is an `error`
event, then `response.failed`.

Calls come out whole (`output.OutputReader`): their arguments in one delta once valid; a call
cut short is text. Every response carries `speculative_stats`, as chat completions do.
"""

from __future__ import annotations

import json
import time

from specserve.engine.outputs import CompletionDelta, RequestOutput
from specserve.server import sse
from specserve.server.apis.output import Call, OutputReader, Text, ending, new_id
from specserve.server.apis.responses_request import ResponsesRequest, ToolNames
from specserve.server.errors import APIError
from specserve.server.responses import speculative_stats
from specserve.server.tool_calls.parser import ToolParsing


class ResponsesRenderer:
    def __init__(self, req: ResponsesRequest, names: ToolNames, parsing: ToolParsing | None,
                 speculative: bool) -> None:
        self.req, self.names, self.speculative = req, names, speculative
        self.id = new_id("resp_")
        self.created_at = int(time.time())
        self.reader = OutputReader(parsing)
        self.parses = parsing is not None  # reading the output takes a parser (off the loop)
        self.output: list[dict] = []  # the items so far
        self.message: dict | None = None  # the message item being written
        self.seq = 0

    # ---------------------------------------------------------------- the stream
    def start(self) -> list[str]:
        response = self.response("in_progress")
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def keepalive(self) -> list[str]:
        """`response.in_progress` again: an event, which a client's idle timer counts (Codex
        drops a stream quiet for 300 s), and one its parser takes."""
        return [self._event("response.in_progress", response=self.response("in_progress"))]

    def step(self, index: int, deltas: list[CompletionDelta]) -> list[str]:
        """The events of one engine step (one prompt, n = 1: at most one delta)."""
        return [e for delta in deltas for e in self._step(delta)]

    def _step(self, delta: CompletionDelta) -> list[str]:
        return self._items(self.reader.feed(delta.text, delta.finish_reason is not None))

    def close(self, outputs: list[RequestOutput], last: list[str]) -> list[str]:
        """`last`: the events of the last step, which come first."""
        (output,) = outputs
        events = last + self._close_message()
        if not self.output:  # a response has at least one item, if empty
            events += self._text("") + self._close_message()
        response = self.response(*self._status(output), output=output)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return events + [self._event(kind, response=response)]

    def failure(self, error: APIError) -> list[str]:
        body = error.body()["error"]
        response = self.response("failed")
        response["error"] = {"code": body["code"] or body["type"], "message": body["message"]}
        return [self._event("error", code=body["code"], message=body["message"],
                            param=body["param"]),
                self._event("response.failed", response=response)]

    # ---------------------------------------------------------------- whole
    def body(self, outputs: list[RequestOutput]) -> dict:
        (output,) = outputs
        self._items(self.reader.feed(output.outputs[0].text, final=True))
        self.close([output], [])
        return self.response(*self._status(output), output=output)

    # ---------------------------------------------------------------- items
    def _items(self, items: list[Text | Call]) -> list[str]:
        events: list[str] = []
        for item in items:
            events += self._text(item.text) if isinstance(item, Text) else self._call(item)
        return events

    def _text(self, text: str) -> list[str]:
        events = []
        if self.message is None:
            self.message = {"id": new_id("msg_"), "type": "message", "status": "in_progress",
                            "role": "assistant", "content": []}
            events += [self._event("response.output_item.added", output_index=len(self.output),
                                   item=self.message),
                       self._event("response.content_part.added", **self._where(),
                                   part=_part(""))]
            self.message["text"] = ""
        if text:
            self.message["text"] += text
            events.append(self._event("response.output_text.delta", **self._where(),
                                      delta=text, logprobs=[]))
        return events

    def _close_message(self) -> list[str]:
        if self.message is None:
            return []
        text = self.message.pop("text")
        where = self._where()
        item = {**self.message, "status": "completed", "content": [_part(text)]}
        self.message = None
        self.output.append(item)
        return [self._event("response.output_text.done", **where, text=text, logprobs=[]),
                self._event("response.content_part.done", **where, part=_part(text)),
                self._event("response.output_item.done", output_index=where["output_index"],
                            item=item)]

    def _call(self, call: Call) -> list[str]:
        events = self._close_message()
        index, call_id = len(self.output), new_id("call_")
        if call.name in self.names.custom:
            item = {"id": new_id("ctc_"), "type": "custom_tool_call", "status": "completed",
                    "call_id": call_id, "name": call.name,
                    "input": str(json.loads(call.arguments).get("input", ""))}
            events.append(self._event("response.output_item.added", output_index=index,
                                      item={**item, "status": "in_progress", "input": ""}))
        else:
            item = {"id": new_id("fc_"), "type": "function_call", "status": "completed",
                    "call_id": call_id, "name": call.name, "arguments": call.arguments}
            if call.name in self.names.namespace:
                item["namespace"] = self.names.namespace[call.name]
            fields = {"item_id": item["id"], "output_index": index}
            events += [self._event("response.output_item.added", output_index=index,
                                   item={**item, "status": "in_progress", "arguments": ""}),
                       self._event("response.function_call_arguments.delta", **fields,
                                   delta=call.arguments),
                       self._event("response.function_call_arguments.done", **fields,
                                   name=call.name, arguments=call.arguments)]
        self.output.append(item)
        return events + [self._event("response.output_item.done", output_index=index, item=item)]

    def _where(self) -> dict:
        return {"item_id": self.message["id"], "output_index": len(self.output),
                "content_index": 0}

    def _event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse.named_event(kind, payload)

    # ---------------------------------------------------------------- the response
    def _status(self, output: RequestOutput) -> tuple[str, dict | None]:
        if ending(output.outputs[0], self.reader.calls) == "max_tokens":
            return "incomplete", {"reason": "max_output_tokens"}
        return "completed", None

    def response(self, status: str, incomplete: dict | None = None,
                 output: RequestOutput | None = None) -> dict:
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        body = {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "error": None, "incomplete_details": incomplete,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": req.model, "output": list(self.output),
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
            "store": False, "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                     else {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
            "usage": None, "metadata": {}}
        if output is not None:
            body["usage"] = _usage(output)
            body["speculative_stats"] = speculative_stats(output.outputs, self.speculative)
        return body


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(output: RequestOutput) -> dict:
    prompt, completion = output.num_prompt_tokens, output.outputs[0].num_output_tokens
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": output.num_cached_tokens},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}
