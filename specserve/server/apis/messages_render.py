"""The engine's output as the Anthropic Messages API gives it: a `message` object, or its stream
of events.

Streamed, as Anthropic documents the sequence: `message_start` (the message with empty content
and the input tokens), `ping`; per content block `content_block_start`, its deltas
(`text_delta`; a `tool_use` block's input as one `input_json_delta`) and `content_block_stop`;
then `message_delta` (`stop_reason`, `stop_sequence`, the usage) and `message_stop`. The blocks
reassemble to the content of the body a non-streamed request gets, ids and all. A failure after
the first event is an `error` event in Anthropic's error shape.

`stop_reason`: `end_turn` (the model ended), `stop_sequence` (with the string), `max_tokens`
(max_tokens or the context), `tool_use` (the model made calls and stopped). Calls come out
whole (`output.OutputReader`): a call cut short is text. Every message carries
`speculative_stats`, as chat completions do.
"""

from __future__ import annotations

import json

from specserve.engine.outputs import CompletionDelta, RequestOutput
from specserve.server import sse
from specserve.server.apis.output import Call, OutputReader, Text, ending, new_id
from specserve.server.errors import APIError, anthropic_body
from specserve.server.responses import speculative_stats
from specserve.server.tool_calls.parser import ToolParsing


class MessagesRenderer:
    def __init__(self, model: str, prompt_tokens: int, parsing: ToolParsing | None,
                 speculative: bool) -> None:
        self.model, self.prompt_tokens, self.speculative = model, prompt_tokens, speculative
        self.id = new_id("msg_")
        self.reader = OutputReader(parsing)
        self.parses = parsing is not None  # reading the output takes a parser (off the loop)
        self.content: list[dict] = []  # the blocks so far
        self.open = False  # the last block is a text block still being written

    # ---------------------------------------------------------------- the stream
    def start(self) -> list[str]:
        message = self.message(None, None, {"input_tokens": self.prompt_tokens,
                                            "output_tokens": 0})
        return [_event("message_start", message=message), _event("ping")]

    def keepalive(self) -> list[str]:
        """A `ping`, which Anthropic's streams may hold any number of."""
        return [_event("ping")]

    def step(self, index: int, deltas: list[CompletionDelta]) -> list[str]:
        """The events of one engine step (one prompt, n = 1: at most one delta)."""
        return [e for delta in deltas for e in self._step(delta)]

    def _step(self, delta: CompletionDelta) -> list[str]:
        return self._blocks(self.reader.feed(delta.text, delta.finish_reason is not None))

    def close(self, outputs: list[RequestOutput], last: list[str]) -> list[str]:
        """`last`: the events of the last step, which come first."""
        (output,) = outputs
        events = last + self._close_text()
        stop_reason, stop_sequence = self._stop(output)
        usage = _usage(output)
        return events + [_event("message_delta", delta={"stop_reason": stop_reason,
                                                        "stop_sequence": stop_sequence},
                                usage=usage, speculative_stats=self._stats(output)),
                         _event("message_stop")]

    def failure(self, error: APIError) -> list[str]:
        return [_event("error", **{k: v for k, v in anthropic_body(error).items() if k != "type"})]

    # ---------------------------------------------------------------- whole
    def body(self, outputs: list[RequestOutput]) -> dict:
        (output,) = outputs
        self._blocks(self.reader.feed(output.outputs[0].text, final=True))
        self._close_text()
        body = self.message(*self._stop(output), _usage(output))
        body["speculative_stats"] = self._stats(output)
        return body

    def message(self, stop_reason: str | None, stop_sequence: str | None, usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": list(self.content), "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": usage}

    # ---------------------------------------------------------------- blocks
    def _blocks(self, items: list[Text | Call]) -> list[str]:
        events: list[str] = []
        for item in items:
            events += self._text(item.text) if isinstance(item, Text) else self._call(item)
        return events

    def _text(self, text: str) -> list[str]:
        events = []
        if not self.open:
            self.content.append({"type": "text", "text": ""})
            self.open = True
            events.append(_event("content_block_start", index=len(self.content) - 1,
                                 content_block={"type": "text", "text": ""}))
        self.content[-1]["text"] += text
        return events + [_event("content_block_delta", index=len(self.content) - 1,
                                delta={"type": "text_delta", "text": text})]

    def _close_text(self) -> list[str]:
        if not self.open:
            return []
        self.open = False
        return [_event("content_block_stop", index=len(self.content) - 1)]

    def _call(self, call: Call) -> list[str]:
        events = self._close_text()
        block = {"type": "tool_use", "id": new_id("toolu_"), "name": call.name,
                 "input": json.loads(call.arguments)}
        self.content.append(block)
        index = len(self.content) - 1
        return events + [
            _event("content_block_start", index=index, content_block={**block, "input": {}}),
            _event("content_block_delta", index=index,
                   delta={"type": "input_json_delta", "partial_json": call.arguments}),
            _event("content_block_stop", index=index)]

    def _stop(self, output: RequestOutput) -> tuple[str, str | None]:
        c = output.outputs[0]
        reason = ending(c, self.reader.calls)
        if reason == "abort":
            reason = "end_turn"
        sequence = c.stop_reason if reason == "stop_sequence" and isinstance(
            c.stop_reason, str) else None
        return reason, sequence

    def _stats(self, output: RequestOutput) -> dict:
        return speculative_stats(output.outputs, self.speculative)


def _event(kind: str, **fields) -> str:
    return sse.named_event(kind, {"type": kind, **fields})


def _usage(output: RequestOutput) -> dict:
    cached = output.num_cached_tokens
    return {"input_tokens": output.num_prompt_tokens - cached,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": output.outputs[0].num_output_tokens}
