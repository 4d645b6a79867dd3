"""The step's update: what a round computed becomes the sequences' state (`Update.__call__`).

One place commits a round (`rounds.RoundOutput`): a grammar that could not go on fails its
sequence alone; each decoding sequence appends its round's tokens (the output processor keeps
them up to the first that ends it, and its grammar advances over them), counts what it cached
and returns its spare blocks to the scheduler; the speculation controller learns what was
kept; each prefill chunk marks its blocks computed, and a prompt's last chunk appends the
first token. A sequence that ends is finished here, and every request that advanced or
finished is remembered until its delta is handed out (`deltas`).
"""

from __future__ import annotations

import time

import torch

from specserve.engine.output_processor import FINISH_ABORT, OutputProcessor
from specserve.engine.outputs import RequestDelta, TokenOrigin
from specserve.engine.scheduler import Chunk, Scheduler
from specserve.engine.sequence import Sequence, Status
from specserve.sampling.grammar import GrammarError
from specserve.sampling.stop import FINISH_STOP
from specserve.speculative.drafter import Proposal
from specserve.speculative.metrics import EngineMetrics


class Update:
    """Commits rounds over `scheduler`, `output` and `spec` (None: no speculation) into the
    engine's `requests` table (id → `Request`, shared with the engine) and `metrics`."""

    def __init__(self, scheduler: Scheduler, output: OutputProcessor, spec, requests: dict,
                 metrics: EngineMetrics) -> None:
        self.scheduler, self.output, self.spec = scheduler, output, spec
        self.requests, self.metrics = requests, metrics
        self.touched: dict[str, None] = {}  # requests with something to report (ordered)

    def __call__(self, plan, out) -> None:
        """Commit the round `out` (None: nothing ran) of `plan`."""
        if out is None:
            return
        seqs = plan.decode
        for seq, error in zip(seqs, out.errors):
            if error is not None:
                self.fail(seq, error)
        for seq, prop, res, lg in zip(seqs, out.proposals, out.results, out.logits):
            self._commit(seq, prop, res, lg, out.draft_s, out.verify_s)
        if self.spec is not None and seqs:
            self.spec.observe(plan, out.proposals, [r.num_accepted for r in out.results],
                              out.old_lens, out.draft_s, out.verify_s)
        for chunk, lg, first, error in zip(plan.chunks, out.logits[len(seqs):], out.firsts,
                                           out.chunk_errors):
            self._prefilled(chunk, lg, first, error)

    def _commit(self, seq: Sequence, prop: Proposal, res, logits: torch.Tensor,
                draft_time: float, verify_time: float) -> None:
        self.append(seq, res.tokens, logits, prop.k, res.num_accepted)
        seq.num_cached = len(seq.token_ids) - 1  # stale draft positions are simply not counted
        self.scheduler.commit(seq)
        m = seq.metrics
        m.record(prop.k, res.num_accepted, len(res.tokens), res.tv_distances)
        m.draft_time += draft_time
        m.verify_time += verify_time
        self.metrics.window.record(prop.k, res.num_accepted)

    def _prefilled(self, chunk: Chunk, logits: torch.Tensor, first, error) -> None:
        """A prefill chunk ran: its blocks are computed; the prompt's last chunk appends the
        first token (a recomputation after a preemption samples nothing)."""
        seq = chunk.seq
        seq.num_cached = chunk.start + chunk.num_tokens
        if first is not None:
            if error is not None:
                self.fail(seq, error)
            self.append(seq, first.tokens, logits)  # plain
            if seq.first_token_time is None:
                seq.first_token_time = time.perf_counter()
        self.scheduler.commit(seq)

    # ------------------------------------------------------------------ tokens and stops
    def append(self, seq: Sequence, tokens: list[int], logits: torch.Tensor, k: int = 0,
               num_accepted: int = 0) -> None:
        """Add a round's tokens (`k` drafts, `num_accepted` of them kept; `logits` row i scored
        token i). The output processor keeps them up to the first that ends the sequence (EOS,
        a stop token or string, max_tokens, the context limit, a grammar complete); the rest
        are dropped."""
        origins = TokenOrigin.of_round(len(tokens), k, num_accepted)
        kept, reason = self.output.process(seq, tokens, logits, origins)
        seq.token_ids += tokens[:kept]
        self.touched[seq.request_id] = None
        if seq.grammar is not None:
            try:
                for token in tokens[:kept]:
                    seq.grammar.accept(token)
            except GrammarError as error:  # it cannot go on: this sequence fails alone
                self.fail(seq, error)
                return
            if reason is None and seq.grammar.is_terminated:
                reason = FINISH_STOP
        if reason is not None:
            self.finish(seq, reason)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        self.output.finish(seq, reason)
        self.touched[seq.request_id] = None

    def fail(self, seq: Sequence, error: Exception) -> None:
        """The sequence fails with `error` (its request's first error is what it reports)."""
        req = self.requests.get(seq.request_id)
        if req is not None and req.error is None:
            req.error = error
        self.finish(seq, FINISH_ABORT)

    # ------------------------------------------------------------------ outputs
    def deltas(self) -> list[RequestDelta]:
        """The step's deltas; a request's record goes with its final one."""
        out = []
        touched, self.touched = self.touched, {}
        for rid in touched:
            req = self.requests.get(rid)
            delta = self.output.delta(req) if req is not None else None
            if delta is not None:
                out.append(delta)
                if delta.finished:
                    del self.requests[rid]
        return out

    def release(self, finished: list[Sequence]) -> None:
        """Sequences that left (their target blocks already freed by the scheduler): their
        speculation state goes, a completed output joins the suffix cache."""
        for seq in finished:
            if self.spec is not None:
                self.spec.release(seq, completed=seq.finish_reason != FINISH_ABORT)
            self.metrics.total.merge(seq.metrics)
