"""Engine deltas and outputs → OpenAI response bodies and stream chunks.

One API request may hold several prompts (text completions with a list of prompts) of `n`
completions each; choice `i * n + j` is completion `j` of prompt `i`. The chat and text shapes
differ only in how a choice and its logprobs look, so one `Responder` serves both, given a
`Shape`.

A chat request whose output may hold tool calls (`ToolParsing`) has each choice's text read
by a tool-call parser: streamed, every engine step's text goes through it and comes out as
OpenAI deltas (`content`, `tool_calls`), one chunk per delta where a step makes several;
whole, the same parser reads the final text. A choice that made calls and stopped on its
own ends with finish_reason "tool_calls".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specserve.engine.outputs import CompletionDelta, CompletionOutput, RequestOutput
from specserve.models.tokenizer import Tokenizer
from specserve.server import sse
from specserve.server.errors import APIError
from specserve.server.tool_calls.parser import (ToolCallParser, ToolParsing, new_call_id,
                                                stream_deltas)
from specserve.speculative.metrics import SpecMetrics


@dataclass(frozen=True)
class Shape:
    """The parts of the OpenAI format that differ between chat and text completions."""

    chat: bool

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def stream_choices(self, index: int, parts: list[dict], first: bool, finish: str | None,
                       logprobs: dict | None, origins: list[str] | None) -> list[dict]:
        """One engine step of one choice as stream choices (several where its text made
        several deltas): the first carries the logprobs and origins, the last the finish."""
        choices = []
        for k, part in enumerate(parts):
            extra = {"logprobs": logprobs, "origins": origins} if k == 0 else {"logprobs": None}
            choices.append(self._stream_choice(index, part, first and k == 0,
                                               finish if k == len(parts) - 1 else None, **extra))
        return choices

    def _stream_choice(self, index: int, part: dict, first: bool, finish: str | None,
                       logprobs: dict | None, origins: list[str] | None = None) -> dict:
        if self.chat:
            delta = {"role": "assistant", **part} if first else dict(part)
            if first and "content" not in delta:
                delta["content"] = None
            if origins is not None:
                delta["origins"] = origins
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        choice = {"index": index, "text": part["content"], "logprobs": logprobs,
                  "finish_reason": finish}
        if origins is not None:
            choice["origins"] = origins
        return choice

    def final_choice(self, index: int, message: dict, finish: str | None, logprobs: dict | None,
                     origins: list[str] | None) -> dict:
        if self.chat:
            choice = {"index": index, "message": {"role": "assistant", **message},
                      "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": message["content"], "logprobs": logprobs,
                      "finish_reason": finish}
        if origins is not None:
            choice["origins"] = origins
        return choice


@dataclass
class _ChoiceState:
    started: bool = False
    text_offset: int = 0  # characters of this choice's text so far (completions' text_offset)
    parser: ToolCallParser | None = None
    call_ids: list[str] = field(default_factory=list)


@dataclass
class Responder:
    """Builds one API request's chunks (streaming) or final body."""

    shape: Shape
    request_id: str
    model: str
    n: int
    tokenizer: Tokenizer
    logprobs: int | None  # None: not requested; else the number of top alternatives
    origins: bool
    speculative: bool  # whether this request was allowed to speculate
    tool_calls: ToolParsing | None = None  # chat: read tool calls out of the text this way
    created: int = field(default_factory=lambda: int(time.time()))
    _choices: dict[int, _ChoiceState] = field(default_factory=dict)

    def envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    # ---------------------------------------------------------------- streaming
    def chunks(self, prompt_index: int, deltas: list[CompletionDelta],
               usage_field: bool) -> list[dict]:
        """The chunks of one engine step of one prompt (none when nothing is worth sending);
        chunk k holds the k-th delta of each choice that made several."""
        rows = []
        for d in deltas:
            index = prompt_index * self.n + d.index
            state = self._choices.setdefault(index, _ChoiceState())
            parts, finish = self._parts(state, d)
            worth = parts or finish or not state.started or (
                d.token_ids and (self.logprobs is not None or self.origins))
            if not worth:
                continue
            logprobs = self._logprobs(d.token_ids, d.logprobs, state) if self.logprobs is not None else None
            origins = d.origins if self.origins else None
            rows.append(self.shape.stream_choices(index, parts or [self._empty()],
                                                  not state.started, finish, logprobs, origins))
            state.started = True
        chunks = []
        for k in range(max(map(len, rows), default=0)):
            chunk = self.envelope(self.shape.chunk_object, [row[k] for row in rows if len(row) > k])
            if usage_field:
                chunk["usage"] = None
            chunks.append(chunk)
        return chunks

    def _parts(self, state: _ChoiceState, d: CompletionDelta) -> tuple[list[dict], str | None]:
        """The deltas of one step's text, and its finish reason."""
        if self.tool_calls is None or not self.shape.chat:
            return ([{"content": d.text}] if d.text else []), d.finish_reason
        if state.parser is None:
            state.parser = self.tool_calls.parser()
        events = state.parser.feed(d.text) if d.text else []
        if d.finish_reason is not None:
            events += state.parser.finish()
        return stream_deltas(events, state.call_ids), _finish(d.finish_reason, state.call_ids)

    def _empty(self) -> dict:
        return {} if self.tool_calls is not None and self.shape.chat else {"content": ""}

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict:
        chunk = self.envelope(self.shape.chunk_object, [])
        chunk["usage"] = usage(outputs)
        return chunk

    # ---------------------------------------------------------------- final body
    def body(self, outputs: list[RequestOutput]) -> dict:
        choices = []
        for p, out in enumerate(outputs):
            for c in out.outputs:
                state = _ChoiceState()
                logprobs = (self._logprobs(c.token_ids, c.logprobs, state)
                            if self.logprobs is not None else None)
                origins = list(c.origins or []) if self.origins else None
                message, finish = self._message(c)
                choices.append(self.shape.final_choice(p * self.n + c.index, message, finish,
                                                       logprobs, origins))
        body = self.envelope(self.shape.object, choices)
        body["usage"] = usage(outputs)
        body["speculative_stats"] = self.stats(outputs)
        return body

    def _message(self, c: CompletionOutput) -> tuple[dict, str | None]:
        if self.tool_calls is None or not self.shape.chat:
            return {"content": c.text}, c.finish_reason
        parsed = self.tool_calls.parse(c.text)
        calls = [{"id": new_call_id(), "type": "function",
                  "function": {"name": name, "arguments": arguments}}
                 for name, arguments in parsed.calls]
        if not calls:
            return {"content": parsed.content}, c.finish_reason
        message = {"content": parsed.content or None, "tool_calls": calls}
        return message, _finish(c.finish_reason, calls)

    def stats(self, outputs: list[RequestOutput]) -> dict:
        return speculative_stats([c for out in outputs for c in out.outputs], self.speculative)

    # ---------------------------------------------------------------- logprobs
    def _logprobs(self, token_ids: list[int], entries: list[dict[int, float]] | None,
                  state: _ChoiceState) -> dict:
        entries = entries or [{} for _ in token_ids]
        top_n = self.logprobs or 0
        rows = []
        for token, lps in zip(token_ids, entries):
            top = sorted(lps.items(), key=lambda kv: -kv[1])[:top_n]
            rows.append((self._piece(token), lps.get(token),
                         [(self._piece(t), lp) for t, lp in top]))
        if self.shape.chat:
            return {"content": [
                {"token": s, "logprob": lp, "bytes": list(s.encode()),
                 "top_logprobs": [{"token": ts, "logprob": tl, "bytes": list(ts.encode())} for ts, tl in top]}
                for s, lp, top in rows]}
        offsets = []
        for s, _, _ in rows:
            offsets.append(state.text_offset)
            state.text_offset += len(s)
        return {"tokens": [s for s, _, _ in rows], "token_logprobs": [lp for _, lp, _ in rows],
                "top_logprobs": [dict(top) for _, _, top in rows], "text_offset": offsets}

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)


@dataclass
class ChatRenderer:
    """Chat and text completions as the app drives every wire: server-sent chunks per engine
    step (`step`); at the end (`close`, given the last step's events) that step's chunks again
    with `speculative_stats` on the last one and the usage chunk when asked, then `[DONE]`; or
    the whole body. `parses`: whether reading the output takes a parser (tool calls), work
    the app keeps off its event loop."""

    responder: Responder
    include_usage: bool = False
    _last: list[dict] = field(default_factory=list)  # the last step's chunks

    @property
    def parses(self) -> bool:
        return self.responder.tool_calls is not None

    def start(self) -> list[str]:
        return []

    def keepalive(self) -> list[str]:
        return [sse.COMMENT]

    def step(self, index: int, deltas: list[CompletionDelta]) -> list[str]:
        self._last = self.responder.chunks(index, deltas, self.include_usage)
        return [sse.event(c) for c in self._last]

    def close(self, outputs: list[RequestOutput], last: list[str]) -> list[str]:
        r, chunks = self.responder, list(self._last)
        if self.include_usage:
            chunks.append(r.usage_chunk(outputs))
        elif not chunks:
            chunks.append(r.envelope(r.shape.chunk_object, []))
        chunks[-1]["speculative_stats"] = r.stats(outputs)
        return [sse.event(c) for c in chunks] + [sse.DONE]

    def failure(self, error: APIError) -> list[str]:
        return [sse.event(error.body()), sse.DONE]

    def body(self, outputs: list[RequestOutput]) -> dict:
        return self.responder.body(outputs)


def _finish(reason: str | None, calls: list) -> str | None:
    """A choice that made calls (cut ones aside) and stopped on its own stopped to have them
    run."""
    return "tool_calls" if any(c is not None for c in calls) and reason == "stop" else reason


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(out.num_prompt_tokens for out in outputs)
    completion = sum(c.num_output_tokens for out in outputs for c in out.outputs)
    cached = sum(out.num_cached_tokens for out in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def speculative_stats(completions: list[CompletionOutput], enabled: bool) -> dict:
    """A request's speculative decoding, summed over its completions."""
    total = SpecMetrics()
    for c in completions:
        if c.spec is not None:
            total.merge(c.spec)
    return {"enabled": enabled, "rounds": total.rounds, "drafted": total.drafted,
            "accepted": total.accepted, "emitted": total.emitted,
            "acceptance_rate": total.acceptance_rate,
            "mean_acceptance_length": total.mean_acceptance_length, "realised_tv": total.mean_tv,
            "per_position_acceptance": total.per_position_acceptance,
            "by_source": total.by_source, "idle_rounds": dict(sorted(total.idle.items()))}
