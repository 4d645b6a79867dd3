"""The engine core: `step()` = schedule → execute → update, on one thread.

Every decoding round is a speculative round; plain decoding is the round with k = 0 (no
draft, a one-row verify pass, one token sampled from the target). The speculation controller
plans each decoding sequence's drafts (source and k), the scheduler fits them into one step
with the prefill chunks and owns the KV blocks, and a round for the batch runs the drafters
and one ragged target pass; each sequence then accepts its own number of tokens and rolls
its caches back by arithmetic.

The core is single-threaded: every method is called from the thread that drives it (an
`LLM` call, or an `AsyncEngine`'s thread), so nothing here locks. One table holds the
requests (id → `Request`); all else about a request hangs off that record.
"""

from __future__ import annotations

import copy
import itertools
import logging
import random
import time

import torch

from specserve.engine.block_manager import BlockManager
from specserve.engine.config import EngineConfig
from specserve.engine import prefill_choice
from specserve.engine.output_processor import FINISH_ABORT, OutputProcessor
from specserve.engine.outputs import (EngineStats, RequestDelta, SpeculationOverride,
                                      TokenOrigin)
from specserve.engine.request import Request
from specserve.engine.rounds import sample_round, truncate_to_grammar
from specserve.engine.runner import ModelRunner
from specserve.engine.scheduler import Chunk, Scheduler, StepPlan
from specserve.engine.trace import StepTrace
from specserve.engine.sequence import Sequence, Status
from specserve.models.tokenizer import Tokenizer
from specserve.sampling.grammar import GrammarError, LazyGrammarCompiler
from specserve.sampling.params import SamplingParams
from specserve.sampling.rejection import VerifyResult
from specserve.sampling.stop import FINISH_STOP
from specserve.speculative.controller import SpeculationController
from specserve.speculative.drafter import EMPTY, Proposal
from specserve.speculative.metrics import EngineMetrics

log = logging.getLogger("specserve.engine")
PREFILL_DRAFT_SHARE = 64  # while prompts wait to prefill, drafts take ≤ 1/64 of a step's tokens


class LLMEngine:
    """`runner` runs the target's passes; `blocks` (the target cache's block manager) goes to
    the scheduler, its only owner; `spec` (None: no speculation) owns the drafters;
    `grammars` compiles structured-output specs (None: built on the first one).
    `prepare_tokenizer`: build the tokenizer's text-only copy at start-up (a server's)."""

    def __init__(self, runner: ModelRunner, blocks: BlockManager, tokenizer: Tokenizer,
                 config: EngineConfig, spec: SpeculationController | None = None,
                 prepare_tokenizer: bool = False, grammars=None) -> None:
        assert config.max_model_len is not None, "the context is resolved before the engine"
        self.runner, self.tokenizer, self.config, self.spec = runner, tokenizer, config, spec
        self.grammars = grammars or LazyGrammarCompiler(tokenizer, runner.model.cfg.vocab_size)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, blocks)
        self.metrics = EngineMetrics()
        self.output = OutputProcessor(tokenizer, config.max_model_len, spec is not None)
        self.num_aborted = 0
        self.requests: dict[str, Request] = {}  # added and not yet reported finished
        self._touched: dict[str, None] = {}  # requests with something to report (ordered)
        self._ids = itertools.count()
        self._seeds = random.Random()
        self._started = False
        self._prepare_tokenizer = prepare_tokenizer
        self._trace = StepTrace(config.trace_steps) if config.trace_steps else None

    @property
    def cost(self):
        """The speculation controller's cost model (None without speculation)."""
        return self.spec.cost if self.spec is not None else None

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, prompt: str | None = None,
                    speculation: SpeculationOverride | None = None,
                    client: str | None = None) -> str:
        """Queue a request; returns its id. Invalid input raises ValueError, before anything
        is queued (a structured output's grammar is compiled here, or found compiled).
        `client`: whom it serves (the scheduler shares the slots among clients)."""
        grammar = self.check_request(prompt_ids, params, speculation)
        if request_id is None:
            request_id = str(next(self._ids))
            while request_id in self.requests:  # an automatic id skips ids callers chose
                request_id = str(next(self._ids))
        elif request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        req = Request(request_id, prompt, list(prompt_ids), params, time.perf_counter(),
                      speculation, grammar, client=client)
        req.seqs = [self._new_sequence(req, i) for i in range(params.n)]
        if self.spec is not None:
            self.spec.join(req.seqs, speculation, self.tokenizer)
        self.requests[request_id] = req
        for seq in req.seqs:
            self.scheduler.add(seq)
        return request_id

    def check_request(self, prompt_ids: list[int], params: SamplingParams,
                      speculation: SpeculationOverride | None = None):
        """Raise ValueError (naming the field) if the request cannot be served; returns the
        compiled grammar of its structured output (None: none). Touches no engine state, so
        a client may call it on its own thread (grammars compile thread-safely, cached)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if speculation is not None and not isinstance(speculation, SpeculationOverride):
            raise ValueError("speculation must be a SpeculationOverride, got "
                             f"{type(speculation).__name__}")
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        if len(prompt_ids) >= self.config.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; max_model_len is "
                             f"{self.config.max_model_len} (room for at least one new token needed)")
        vocab = self.runner.model.cfg.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
               for t in prompt_ids):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        spec = params.structured_outputs
        return self.grammars.compile(spec) if spec is not None else None

    def _new_sequence(self, req: Request, index: int) -> Sequence:
        params = req.params
        seed = params.seed + index if params.seed is not None else self._seeds.getrandbits(63)
        override = req.speculation
        budget = (override.tv_budget if override is not None and override.tv_budget is not None
                  else params.tv_budget if params.tv_budget is not None
                  else self.spec.tv_budget if self.spec else 0.0)
        seq = Sequence(next(self._ids), req.request_id, index, list(req.prompt_ids), params,
                       torch.Generator().manual_seed(seed), budget, arrival=req.arrival,
                       client=req.client)
        self.output.start(seq)
        if req.grammar is not None:
            seq.grammar = req.grammar.matcher()
        return seq

    def abort_request(self, request_id: str) -> None:
        """Finish a request with "abort" and free its memory; its final delta comes from the
        next `step()`. Unknown or finished ids are ignored."""
        req = self.requests.get(request_id)
        seqs = [s for s in req.seqs if not s.finished] if req is not None else []
        if not seqs:
            return
        self.num_aborted += 1
        for seq in seqs:
            self._finish(seq, FINISH_ABORT)
            if seq in self.scheduler.waiting:
                self.scheduler.drop(seq)
                self._release([seq])
        self._release(self.scheduler.retire())

    def hold_request(self, request_id: str, held: bool = True) -> None:
        """Hold a request (its reader is behind: its sequences keep their memory but are not
        scheduled, and leave their slots to others; the first preempted when memory is short),
        or release it. Unknown or finished ids are ignored."""
        req = self.requests.get(request_id)
        if req is not None:
            self.scheduler.hold([s for s in req.seqs if not s.finished], held)

    def has_request(self, request_id: str) -> bool:
        """True from `add_request` until the request's final delta has been handed out."""
        return request_id in self.requests

    def request_ids(self) -> list[str]:
        """The requests added and not yet reported finished."""
        return list(self.requests)

    def abort_all(self) -> None:
        for request_id in list(self.requests):
            self.abort_request(request_id)

    def reset_prefix_cache(self) -> int:
        """Forget the cached prefix blocks no running sequence holds (the target's and the
        draft model's); returns how many target blocks were dropped."""
        if self.spec is not None:
            self.spec.reset_prefix_cache()
        return self.scheduler.blocks.reset_prefix_cache()

    def has_unfinished(self) -> bool:
        """Work left: sequences to run (held ones too), or deltas not yet handed out."""
        return self.scheduler.has_unfinished() or bool(self._touched)

    def has_work(self) -> bool:
        """Whether a step would do something: a sequence not held to run, or deltas to hand
        out (an engine whose requests are all held has nothing to do until one is released)."""
        return self.scheduler.has_runnable() or bool(self._touched)

    # ------------------------------------------------------------------ start-up, idle
    def run_startup(self) -> None:
        """The start-up work (the tokenizer's text-only copy; the prefill path's choice, timed
        where `prefill_path` is "auto"; the controller's: the draft's restricted head, the cost
        model's timed passes), once, on the thread that will step the engine: the kernels'
        OpenMP runtime keeps a team of workers for every thread that ever ran one of them, and
        with more such threads than cores every step slows down."""
        if self._started:
            return
        self._started = True
        if self._prepare_tokenizer:
            self.tokenizer.prepare()
        self._choose_prefill()
        if self.spec is not None:
            self.spec.startup()

    def _choose_prefill(self) -> None:
        """The target's prefill path (`engine/prefill_choice.py`), said in the log."""
        runner, config = self.runner, self.config
        choice = prefill_choice.choose(runner.model, config.prefill_path,
                                       config.max_num_batched_tokens, config.max_model_len,
                                       runner.cache.dtype)
        runner.use_prefill(choice)
        log.info("specserve: %s", prefill_choice.describe(choice, runner.prefill_bytes))

    @property
    def started(self) -> bool:
        """Whether the start-up work has run."""
        return self._started

    @property
    def has_idle_work(self) -> bool:
        return self.spec is not None and self.spec.has_idle_work

    def run_idle_work(self, interrupted) -> None:
        """Work left for a moment with nothing to do (the cost model's timed passes again,
        after other work on the machine disturbed them), only while no request is unfinished;
        `interrupted()` True stops it. The prefix caches' blocks are dropped first (the
        timed passes write over free blocks)."""
        if not self.has_idle_work or self.has_unfinished():
            return
        self.reset_prefix_cache()
        self.spec.idle_work(interrupted)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestDelta]:
        """One engine step; returns a delta for every request that advanced or finished in it.
        An exception inside the step fails the requests that were running (their final deltas
        carry the error) and leaves the engine usable."""
        self.run_startup()
        start = time.perf_counter()
        try:
            plan = self._schedule()
            if plan.decode or plan.chunks:
                self._execute(plan)
                if self._trace is not None:
                    self._trace.step(self, plan, start)
            elif self.spec is not None:
                self.spec.propose(plan)  # only draft prefill chunks are left to run
        except Exception as error:  # noqa: BLE001 - handed to the failed requests
            self._fail_running(error)
        self.output.mark_scheduled(self.scheduler.running, start)
        self._release(self.scheduler.retire())
        return self._deltas()

    def _schedule(self) -> StepPlan:
        """Plan the drafts, then the step. Verify rows share the step's token budget with
        prefill chunks, so while prompts wait to prefill, drafts take at most
        1/`PREFILL_DRAFT_SHARE` of it (a burst of long drafts would hold back every waiting
        request's first token)."""
        drafts = None
        if self.spec is not None:
            limit = self.config.max_num_batched_tokens // PREFILL_DRAFT_SHARE \
                if self.scheduler.has_prefill_work() else None
            drafts = self.spec.plan(self.scheduler.decoding(), limit)
        return self.scheduler.schedule(drafts)

    def _execute(self, plan: StepPlan) -> None:
        """Draft for the decoding sequences, then one target pass (each decoding sequence's
        last token and drafts, then the prefill chunks); sample and commit."""
        seqs, spec = plan.decode, self.spec
        t0 = time.perf_counter()
        proposals = spec.propose(plan) if spec is not None else [EMPTY] * len(seqs)
        proposals = [self._legal(s, p) for s, p in zip(seqs, proposals)]
        t1 = time.perf_counter()
        rows = [[s.token_ids[-1]] + p.tokens for s, p in zip(seqs, proposals)]
        starts = [s.num_cached for s in seqs]
        tables = [s.table for s in seqs]
        last_n = [len(r) for r in rows]
        prefill = [0] * len(rows)  # decode and verify rows stay off the prefill path
        for c in plan.chunks:
            rows.append(c.seq.token_ids[c.start:c.start + c.num_tokens])
            starts.append(c.start)
            tables.append(c.seq.table)
            last_n.append(1 if c.samples else 0)
            prefill.append(c.prompt_rows)
        if spec is not None and spec.wants_hidden:  # a source drafts from the target's states
            logits, hidden = self.runner.forward_hidden(rows, starts, tables, last_n, prefill)
            spec.observe_hidden(seqs + [c.seq for c in plan.chunks], starts, hidden)
        else:
            logits = self.runner.forward(rows, starts, tables, last_n, prefill)
        results = [self._round(s, p, lg) for s, p, lg in zip(seqs, proposals, logits)]
        t2 = time.perf_counter()
        if self._trace is not None:
            self._trace.round(proposals, results, t1 - t0, t2 - t1)
        old_lens = [len(s.token_ids) for s in seqs]
        for seq, prop, res, lg in zip(seqs, proposals, results, logits):
            self._commit(seq, prop, res, lg, t1 - t0, t2 - t1)
        if spec is not None and seqs:
            spec.observe(plan, proposals, [r.num_accepted for r in results], old_lens,
                         t1 - t0, t2 - t1)
        for chunk, lg in zip(plan.chunks, logits[len(seqs):]):
            self._prefilled(chunk, lg)

    def _legal(self, seq: Sequence, prop: Proposal) -> Proposal:
        """The proposal cut to what its grammar allows (a grammar that cannot go on: none;
        the round then fails that sequence alone)."""
        try:
            return truncate_to_grammar(seq, prop)
        except GrammarError:
            return EMPTY

    def _round(self, seq: Sequence, prop: Proposal, logits: torch.Tensor) -> VerifyResult:
        """The round's tokens; a grammar that cannot go on fails its sequence alone."""
        try:
            return sample_round(seq, prop, logits, self.spec.bonus_token if self.spec else True)
        except GrammarError as error:
            self._fail(seq, error)
            return VerifyResult([], 0, "none", [])

    def _fail(self, seq: Sequence, error: Exception) -> None:
        req = self.requests.get(seq.request_id)
        if req is not None and req.error is None:
            req.error = error
        self._finish(seq, FINISH_ABORT)

    def _fail_running(self, error: Exception) -> None:
        for seq in self.scheduler.scheduled():  # a held sequence was not in the step
            if not seq.finished:
                self._fail(seq, error)

    def _prefilled(self, chunk: Chunk, logits: torch.Tensor) -> None:
        """A prefill chunk ran: its blocks are computed; the prompt's last chunk samples the
        first token (a recomputation after a preemption samples nothing)."""
        seq = chunk.seq
        seq.num_cached = chunk.start + chunk.num_tokens
        if chunk.samples:
            self._append(seq, self._round(seq, EMPTY, logits).tokens, logits)  # plain
            if seq.first_token_time is None:
                seq.first_token_time = time.perf_counter()
        self.scheduler.commit(seq)

    def _commit(self, seq: Sequence, prop: Proposal, res, logits: torch.Tensor,
                draft_time: float, verify_time: float) -> None:
        self._append(seq, res.tokens, logits, prop.k, res.num_accepted)
        seq.num_cached = len(seq.token_ids) - 1  # stale draft positions are simply not counted
        self.scheduler.commit(seq)
        m = seq.metrics
        m.record(prop.k, res.num_accepted, len(res.tokens), res.tv_distances)
        m.draft_time += draft_time
        m.verify_time += verify_time
        self.metrics.window.record(prop.k, res.num_accepted)

    # ------------------------------------------------------------------ tokens and stops
    def _append(self, seq: Sequence, tokens: list[int], logits: torch.Tensor, k: int = 0,
                num_accepted: int = 0) -> None:
        """Add a round's tokens (`k` drafts, `num_accepted` of them kept; `logits` row i scored
        token i). The output processor keeps them up to the first that ends the sequence (EOS,
        a stop token or string, max_tokens, the context limit, a grammar complete); the rest
        are dropped."""
        origins = TokenOrigin.of_round(len(tokens), k, num_accepted)
        kept, reason = self.output.process(seq, tokens, logits, origins)
        seq.token_ids += tokens[:kept]
        self._touched[seq.request_id] = None
        if seq.grammar is not None:
            try:
                for token in tokens[:kept]:
                    seq.grammar.accept(token)
            except GrammarError as error:  # it cannot go on: this sequence fails alone
                self._fail(seq, error)
                return
            if reason is None and seq.grammar.is_terminated:
                reason = FINISH_STOP
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        self.output.finish(seq, reason)
        self._touched[seq.request_id] = None

    # ------------------------------------------------------------------ outputs
    def _deltas(self) -> list[RequestDelta]:
        """The step's deltas; a request's record goes with its final one."""
        out = []
        touched, self._touched = self._touched, {}
        for rid in touched:
            req = self.requests.get(rid)
            delta = self.output.delta(req) if req is not None else None
            if delta is not None:
                out.append(delta)
                if delta.finished:
                    del self.requests[rid]
        return out

    def _release(self, finished: list[Sequence]) -> None:
        """Sequences that left (their target blocks already freed by the scheduler): their
        speculation state goes, a completed output joins the suffix cache."""
        for seq in finished:
            if self.spec is not None:
                self.spec.release(seq, completed=seq.finish_reason != FINISH_ABORT)
            self.metrics.total.merge(seq.metrics)

    # ------------------------------------------------------------------ figures
    def stats(self) -> EngineStats:
        """A snapshot of the engine between steps (for /metrics and /health)."""
        scheduler, blocks = self.scheduler, self.scheduler.blocks
        used, total = blocks.num_used, blocks.num_blocks
        window = self.metrics.window
        return EngineStats(
            running=len(scheduler.running), waiting=len(scheduler.waiting),
            kv_usage=used / total if total else 0.0, kv_blocks_used=used, kv_blocks_total=total,
            preemptions=scheduler.num_preemptions, aborted=self.num_aborted,
            prefix_cache_hit_tokens=scheduler.prefix_cache_hit_tokens,
            prompt_tokens_computed=scheduler.prompt_tokens_computed,
            spec=copy.deepcopy(self.metrics.total), rolling_acceptance=window.acceptance_rate,
            healthy=window.healthy, kv_touched_bytes=self.kv_touched_bytes,
            prefill_onednn=tuple(self.runner.prefill.parts().items()),
            prefill_dense_bytes=self.runner.prefill_bytes, held=scheduler.num_held)

    @property
    def kv_blocks_total(self) -> int:
        return self.scheduler.blocks.num_blocks

    @property
    def kv_blocks_used(self) -> int:
        """Target blocks some sequence holds (cached blocks nobody holds count as free)."""
        return self.scheduler.blocks.num_used

    @property
    def kv_touched_bytes(self) -> int:
        """Bytes of the KV pools (the target's and the draft model's) whose blocks were ever
        taken: the pools are mapped lazily, so this is what they hold resident."""
        total = self.scheduler.blocks.high_water * self.runner.block_bytes
        if self.spec is not None:
            total += self.spec.kv_touched_bytes
        return total

    @property
    def preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def prefix_cache_hit_tokens(self) -> int:
        return self.scheduler.prefix_cache_hit_tokens

    @property
    def prompt_tokens_computed(self) -> int:
        return self.scheduler.prompt_tokens_computed
