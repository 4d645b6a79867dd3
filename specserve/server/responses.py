"""Engine deltas and outputs → OpenAI response bodies and stream chunks.

One API request may hold several prompts (text completions with a list of prompts) of `n`
completions each; choice `i * n + j` is completion `j` of prompt `i`. The chat and text shapes
differ only in how a choice and its logprobs look, so one `Responder` serves both, given a
`Shape`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specserve.engine.outputs import CompletionDelta, CompletionOutput, RequestOutput
from specserve.models.tokenizer import Tokenizer
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

    def stream_choice(self, index: int, text: str, first: bool, finish: str | None,
                      logprobs: dict | None, origins: list[str] | None) -> dict:
        if self.chat:
            delta: dict = {"role": "assistant", "content": text} if first else {"content": text}
            if origins is not None:
                delta["origins"] = origins
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if origins is not None:
            choice["origins"] = origins
        return choice

    def final_choice(self, index: int, text: str, finish: str | None, logprobs: dict | None,
                     origins: list[str] | None) -> dict:
        if self.chat:
            choice = {"index": index, "message": {"role": "assistant", "content": text},
                      "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if origins is not None:
            choice["origins"] = origins
        return choice


@dataclass
class _ChoiceState:
    started: bool = False
    text_offset: int = 0  # characters of this choice's text so far (completions' text_offset)


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
    created: int = field(default_factory=lambda: int(time.time()))
    _choices: dict[int, _ChoiceState] = field(default_factory=dict)

    def envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    # ---------------------------------------------------------------- streaming
    def chunk(self, prompt_index: int, deltas: list[CompletionDelta], usage_field: bool) -> dict | None:
        """One chunk for one engine step of one prompt (None when nothing is worth sending)."""
        choices = []
        for d in deltas:
            index = prompt_index * self.n + d.index
            state = self._choices.setdefault(index, _ChoiceState())
            worth = d.text or d.finish_reason or not state.started or (
                d.token_ids and (self.logprobs is not None or self.origins))
            if not worth:
                continue
            logprobs = self._logprobs(d.token_ids, d.logprobs, state) if self.logprobs is not None else None
            choices.append(self.shape.stream_choice(index, d.text, not state.started, d.finish_reason,
                                                    logprobs, d.origins if self.origins else None))
            state.started = True
        if not choices:
            return None
        chunk = self.envelope(self.shape.chunk_object, choices)
        if usage_field:
            chunk["usage"] = None
        return chunk

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
                choices.append(self.shape.final_choice(p * self.n + c.index, c.text, c.finish_reason,
                                                       logprobs, origins))
        body = self.envelope(self.shape.object, choices)
        body["usage"] = usage(outputs)
        body["speculative_stats"] = self.stats(outputs)
        return body

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


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(out.num_prompt_tokens for out in outputs)
    completion = sum(c.num_output_tokens for out in outputs for c in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


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
