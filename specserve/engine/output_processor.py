"""From the engine's tokens to what callers see: text, stops, logprobs, deltas.

The engine core appends each round's tokens through `OutputProcessor.process`, which walks them
one by one: it detokenizes incrementally, decides whether the token ends the completion (EOS, a
stop token id, a stop string, `max_tokens`, the context limit) and records logprobs and the
token's origin (plain / accepted / recovered / bonus). Tokens after the one that ends a
completion are dropped and the core is told to finish that sequence.

Incremental detokenization decodes a small window of recent tokens, never the whole output: the
window starts at `prefix` (where the last emitted text began) and the text of the tokens from
`read` on is what is new. A window whose decoding ends in U+FFFD holds an incomplete multi-byte
character, so nothing is emitted until a later token completes it (the approach of Hugging
Face's `TextStreamer` and vLLM's `detokenize_incrementally`). The first window starts with the
prompt's last tokens (`CONTEXT_TOKENS`, already read), so that the output reads as the prompt's
continuation: a SentencePiece decoder drops the space at the start of a text, but the first
output token `▁Paris` after "The capital of France is" is " Paris".

Once per engine step `delta(request)` hands out what a request that advanced gained: the new
token ids and the new text; text that might still become a stop string is held back, so a
stream never shows text that the final output cuts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specserve.engine.outputs import (CompletionDelta, CompletionOutput, RequestDelta,
                                      RequestOutput)
from specserve.engine.request import Request
from specserve.engine.sequence import Sequence
from specserve.sampling.stop import FINISH_STOP, StopChecker, finish_reason_for_token

FINISH_LENGTH, FINISH_ABORT = "length", "abort"
_INCOMPLETE = "\ufffd"  # what a decoder yields for a multi-byte character cut short
CONTEXT_TOKENS = 4  # prompt tokens the first window starts with


class IncrementalDetokenizer:
    """Text of a growing token list, one token at a time, decoding only a recent window."""

    def __init__(self, tokenizer, context: list[int] = ()) -> None:
        """`context`: tokens before the first one pushed (the prompt's tail), never emitted;
        ignored where its text ends inside a character."""
        self._tokenizer = tokenizer
        context = list(context)
        if context and tokenizer.decode(context).endswith(_INCOMPLETE):
            context = []
        self._ids: list[int] = context  # the window: tokens from `prefix` on
        self._prefix = 0  # the window's first token (the last emitted text started there)
        self._read = len(context)  # tokens before this are already in the emitted text

    def push(self, token: int) -> str:
        """Add a token; returns the text it completes ("" while a character is incomplete)."""
        self._ids.append(token)
        return self._new_text(final=False)

    def flush(self) -> str:
        """The text still held (an incomplete character at the very end, as U+FFFD)."""
        return self._new_text(final=True)

    def _new_text(self, final: bool) -> str:
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix:self._read])
        text = decode(self._ids[self._prefix:])
        if len(text) <= len(before) or (text.endswith(_INCOMPLETE) and not final):
            return ""
        new = text[len(before):]
        del self._ids[:self._read]  # the next window starts at the old read offset
        self._prefix, self._read = 0, len(self._ids)
        return new


@dataclass(eq=False)
class CompletionState:
    """What one completion has produced: its text, what was streamed, its finish."""

    detokenizer: IncrementalDetokenizer
    stop: StopChecker | None
    text: str = ""
    sent: int = 0  # characters of `text` already streamed
    num_tokens: int = 0  # output tokens kept so far
    num_reported: int = 0  # output tokens already streamed
    logprobs: list[dict[int, float]] | None = None
    origins: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    stopped: bool = False  # a stop string cut the text: nothing more is added
    reported_finish: bool = False
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None


class OutputProcessor:
    """Text, stops and logprobs of each completion (kept in `seq.out`), and the deltas of a
    request (`delta`). It holds no table of its own: the state lives in the records."""

    def __init__(self, tokenizer, max_model_len: int, speculative: bool) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.speculative = speculative  # report per-request speculative metrics

    def start(self, seq: Sequence) -> None:
        """Give a new sequence its output state (its detokenizer reads on from the prompt's
        last `CONTEXT_TOKENS` tokens)."""
        params = seq.params
        context = list(seq.prompt_ids[-CONTEXT_TOKENS:])
        seq.out = CompletionState(IncrementalDetokenizer(self.tokenizer, context),
                                  StopChecker.from_params(params) if params.stop else None,
                                  logprobs=[] if params.logprobs is not None else None)

    @staticmethod
    def mark_scheduled(seqs, now: float) -> None:
        """Record the first time each sequence was scheduled (its queue time ends)."""
        for seq in seqs:
            if seq.out.scheduled_time is None:
                seq.out.scheduled_time = now

    # ------------------------------------------------------------------ tokens
    def process(self, seq: Sequence, tokens: list[int], logits: torch.Tensor,
                origins: list[str]) -> tuple[int, str | None]:
        """Take a round's tokens for `seq` (`logits`: `[>= len(tokens), vocab]`, row i scored
        token i). Returns how many to keep and the finish reason if one of them ends the
        completion (the caller then finishes the sequence)."""
        c, params = seq.out, seq.params
        if c.first_token_time is None and tokens:
            c.first_token_time = time.perf_counter()
        eos = self.tokenizer.eos_token_ids
        for i, token in enumerate(tokens):
            c.num_tokens += 1
            c.origins.append(origins[i])
            if c.logprobs is not None:
                c.logprobs.append(token_logprobs(logits[i], token, params.logprobs))
            reason = finish_reason_for_token(token, params, eos)
            if reason is not None and token in params.stop_token_ids:
                c.stop_reason = token
            if self._add_text(c, c.detokenizer.push(token)):
                reason = FINISH_STOP
            if reason is None and (
                    (params.max_tokens is not None and c.num_tokens >= params.max_tokens)
                    or seq.prompt_len + c.num_tokens >= self.max_model_len):
                reason = FINISH_LENGTH
            if reason is not None:
                return i + 1, reason
        return len(tokens), None

    @staticmethod
    def _add_text(c: CompletionState, piece: str) -> bool:
        """Append decoded text; True (and the text cut) when it completes a stop string."""
        if not piece or c.stopped:
            return False
        start = len(c.text)
        c.text += piece
        if c.stop is None:
            return False
        cut = c.stop.check(c.text, start)
        if cut is None:
            return False
        c.text = c.text[:cut]
        c.stopped, c.stop_reason = True, c.stop.matched
        return True

    def finish(self, seq: Sequence, reason: str) -> None:
        """The sequence ended (`reason`): flush the text still held and close it."""
        c = seq.out
        if c.finish_reason is not None:
            return
        if self._add_text(c, c.detokenizer.flush()):
            reason = FINISH_STOP
        c.finish_reason = reason
        c.finish_time = time.perf_counter()

    # ------------------------------------------------------------------ deltas
    def delta(self, req: Request) -> RequestDelta | None:
        """What `req` gained since the last call (None: nothing); once every completion has
        finished, the final delta with the whole output."""
        completions = [d for seq in req.seqs if (d := self._completion_delta(seq))]
        finished = req.finished
        if not completions and not finished:
            return None
        output = self._request_output(req) if finished else None
        return RequestDelta(req.request_id, completions, finished, output, req.error)

    @staticmethod
    def _completion_delta(seq: Sequence) -> CompletionDelta | None:
        c = seq.out
        done = c.finish_reason is not None
        visible = len(c.text)
        if not done and c.stop is not None:
            visible -= c.stop.held_back(c.text)
        new_tokens = c.num_tokens - c.num_reported
        if visible <= c.sent and not new_tokens and (not done or c.reported_finish):
            return None
        start = seq.prompt_len + c.num_reported
        delta = CompletionDelta(
            index=seq.index, token_ids=seq.token_ids[start:start + new_tokens],
            text=c.text[c.sent:visible] if visible > c.sent else "",
            logprobs=c.logprobs[c.num_reported:c.num_tokens] if c.logprobs is not None else None,
            origins=c.origins[c.num_reported:c.num_tokens],
            finish_reason=c.finish_reason)
        c.sent = max(c.sent, visible)
        c.num_reported = c.num_tokens
        c.reported_finish = done
        return delta

    def _request_output(self, req: Request) -> RequestOutput:
        outs = [self._completion_output(req, seq) for seq in req.seqs]
        queued = [o.queue_time for o in outs if o.queue_time is not None]
        return RequestOutput(req.request_id, req.prompt, req.prompt_ids, outs, finished=True,
                             queue_time=min(queued) if queued else None,
                             num_cached_tokens=min(s.prefix_hit for s in req.seqs))

    def _completion_output(self, req: Request, seq: Sequence) -> CompletionOutput:
        c = seq.out

        def since(start: float | None, end: float | None) -> float | None:
            return end - start if start is not None and end is not None else None

        return CompletionOutput(
            index=seq.index, text=c.text, token_ids=seq.output_ids[:c.num_tokens],
            finish_reason=c.finish_reason, num_output_tokens=c.num_tokens,
            ttft=since(req.arrival, c.first_token_time),
            decode_time=since(c.first_token_time, c.finish_time),
            e2e_time=since(req.arrival, c.finish_time),
            spec=seq.metrics if self.speculative else None,
            logprobs=c.logprobs, queue_time=since(req.arrival, c.scheduled_time),
            origins=list(c.origins), stop_reason=c.stop_reason)


def token_logprobs(logits_row: torch.Tensor, token: int, top: int) -> dict[int, float]:
    """Log-probability of `token` and of the `top` most likely tokens under `logits_row`."""
    logp = torch.log_softmax(logits_row.float(), dim=-1)  # [vocab]
    out = {token: float(logp[token])}
    if top:
        values, ids = logp.topk(top)
        out.update({int(i): float(v) for i, v in zip(ids, values)})
    return out
