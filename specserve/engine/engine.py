"""The engine step: plan drafts → schedule → draft → verify → commit → outputs.

Every decoding round is a speculative round; plain decoding is the round with k = 0 (no
draft, a one-row verify pass, one token sampled from the target). The speculation controller
plans each decoding sequence's drafts (source and k), the scheduler fits them into one step
with the prefill chunks and owns the KV blocks, and a round for the batch runs the drafters
and one ragged target pass; each sequence then accepts its own number of tokens and rolls
its caches back by arithmetic.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from specserve.engine.block_manager import BlockManager
from specserve.engine.config import EngineConfig
from specserve.engine.output_processor import FINISH_ABORT, OutputProcessor
from specserve.engine.outputs import RequestDelta, SpeculationOverride, TokenOrigin
from specserve.engine.runner import ModelRunner
from specserve.engine.scheduler import Chunk, Scheduler, StepPlan
from specserve.engine.sequence import Sequence, Status
from specserve.models.tokenizer import Tokenizer
from specserve.sampling.entropy import entropy_budgets, gate_distribution
from specserve.sampling.fly import FlySettings, fly_gate_distribution, verify_fly
from specserve.sampling.params import SamplingParams
from specserve.sampling.processors import greedy_scores, processed_probs
from specserve.sampling.rejection import VerifyResult, verify, verify_greedy
from specserve.speculative.controller import SpeculationController
from specserve.speculative.drafter import EMPTY, Proposal
from specserve.speculative.metrics import EngineMetrics

PREFILL_DRAFT_SHARE = 64  # while prompts wait to prefill, drafts take ≤ 1/64 of a step's tokens


@dataclass(frozen=True, slots=True)
class _Add:
    """A validated request waiting in the inbox for the next step."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None
    speculation: SpeculationOverride | None
    arrival: float


class LLMEngine:
    """`runner` runs the target's passes; `blocks` (the target cache's block manager) goes to
    the scheduler, its only owner; `spec` (None: no speculation) owns the drafters."""

    def __init__(self, runner: ModelRunner, blocks: BlockManager, tokenizer: Tokenizer,
                 config: EngineConfig, spec: SpeculationController | None = None) -> None:
        self.runner, self.tokenizer, self.config, self.spec = runner, tokenizer, config, spec
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, blocks)
        self.startup: Callable[[], object] | None = None  # see `run_startup`
        self.idle_work: Callable[[Callable[[], bool]], bool] | None = None  # `run_idle_work`
        self.metrics = EngineMetrics()
        self.output = OutputProcessor(tokenizer, config.max_model_len, spec is not None)
        self.num_aborted = 0
        self._ids = itertools.count()
        self._seeds = random.Random()
        # add_request / abort_request may come from any thread: they go through an inbox that
        # the step drains under `_step_lock` (at once when no step is running)
        self._step_lock = threading.Lock()
        self._inbox: deque[_Add | str] = deque()  # an _Add, or the id of a request to abort
        self._live: set[str] = set()  # ids added and not yet reported finished
        self._live_lock = threading.Lock()

    @property
    def cost(self):
        """The speculation controller's cost model (None without speculation)."""
        return self.spec.cost if self.spec is not None else None

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, prompt: str | None = None,
                    speculation: SpeculationOverride | None = None) -> str:
        """Queue a request (from any thread); returns its id. Invalid input raises ValueError
        here, before anything is queued."""
        self.check_request(prompt_ids, params, speculation)
        arrival = time.perf_counter()
        with self._live_lock:
            if request_id is None:
                request_id = str(next(self._ids))
                while request_id in self._live:  # an automatic id skips ids callers chose
                    request_id = str(next(self._ids))
            elif request_id in self._live:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._live.add(request_id)
        self._inbox.append(_Add(request_id, list(prompt_ids), params, prompt, speculation, arrival))
        self._drain_if_idle()
        return request_id

    def check_request(self, prompt_ids: list[int], params: SamplingParams,
                      speculation: SpeculationOverride | None = None) -> None:
        """Raise ValueError (naming the field) if the request cannot be served; touches nothing."""
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

    def abort_request(self, request_id: str) -> None:
        """Finish a request with "abort" and free its memory, from any thread at any moment
        (at once when no step is running, else at the start of the next step). Its final
        delta comes from the next `step()`. Unknown or finished ids are ignored."""
        self._inbox.append(request_id)
        self._drain_if_idle()

    def reset_prefix_cache(self) -> int:
        """Forget the cached prefix blocks no running sequence holds (the target's and the
        draft model's), under the step lock; returns how many target blocks were dropped."""
        with self._step_lock:
            return self._drop_prefix_cache()

    def _drop_prefix_cache(self) -> int:
        """`reset_prefix_cache`'s work, for a caller that holds the step lock."""
        if self.spec is not None:
            self.spec.reset_prefix_cache()
        return self.scheduler.blocks.reset_prefix_cache()

    def has_request(self, request_id: str) -> bool:
        """True from `add_request` until the request's final delta has been handed out."""
        with self._live_lock:
            return request_id in self._live

    def request_ids(self) -> list[str]:
        """The requests added and not yet reported finished."""
        with self._live_lock:
            return list(self._live)

    def _drain_if_idle(self) -> None:
        if self._step_lock.acquire(blocking=False):
            try:
                self._drain_inbox()
            finally:
                self._step_lock.release()

    def _drain_inbox(self) -> None:
        """Apply queued adds and aborts in order (caller holds `_step_lock`)."""
        while self._inbox:
            item = self._inbox.popleft()
            if isinstance(item, str):
                self._abort(item)
                continue
            try:
                self._queue_request(item)
            except Exception as error:  # noqa: BLE001 - handed to that request alone
                self.output.reject(item.request_id, item.prompt, item.prompt_ids, item.arrival,
                                   error)

    def _queue_request(self, item: _Add) -> None:
        """Create an added request's sequences and queue them for scheduling."""
        seqs = [self._new_sequence(item.request_id, i, item.prompt_ids, item.params)
                for i in range(item.params.n)]
        views = self.spec.prompt_views(self.tokenizer, item.prompt_ids) if self.spec else []
        for seq in seqs:
            seq.arrival = item.arrival
            if item.speculation is not None and item.speculation.tv_budget is not None:
                seq.tv_budget = item.speculation.tv_budget
            if self.spec is not None:
                self.spec.add(seq, item.speculation, views)
        self.output.add(item.request_id, item.prompt, item.prompt_ids, seqs, item.arrival)
        for seq in seqs:
            self.scheduler.add(seq)

    def _abort(self, request_id: str) -> None:
        seqs = [s for s in self.output.sequences(request_id) if not s.finished]
        if not seqs:
            return
        self.num_aborted += 1
        for seq in seqs:
            self._finish(seq, FINISH_ABORT)
            if seq in self.scheduler.waiting:
                self.scheduler.drop(seq)
                self._release([seq])
        self._release(self.scheduler.retire())

    def _new_sequence(self, request_id: str, index: int, prompt_ids: list[int],
                      params: SamplingParams) -> Sequence:
        seed = params.seed + index if params.seed is not None else self._seeds.getrandbits(63)
        budget = params.tv_budget if params.tv_budget is not None else (
            self.spec.config.tv_budget if self.spec else 0.0)
        return Sequence(next(self._ids), request_id, index, list(prompt_ids), params,
                        torch.Generator().manual_seed(seed), budget)

    def has_unfinished(self) -> bool:
        """Work left: queued adds or aborts, sequences to run, or deltas not yet handed out."""
        return bool(self._inbox) or self.scheduler.has_unfinished() or self.output.has_pending()

    # ------------------------------------------------------------------ the step
    def run_startup(self) -> None:
        """Run the start-up work (`startup`: the draft's restricted head, the cost model's timed
        passes), once, on this thread. It belongs on the thread that will step the engine: the kernels' OpenMP
        runtime keeps a team of workers for every thread that ever ran a parallel region, and
        once it counts more threads than cores it stops letting idle workers spin, so every
        parallel region (a decode step has over a hundred) waits for its workers to wake. On two
        cores a step then took 1.6x as long."""
        with self._step_lock:
            work, self.startup = self.startup, None
            if work is not None:
                work()

    def run_idle_work(self) -> None:
        """Run the work left for a moment with nothing to do (`idle_work(interrupted)`:
        returns True once done, e.g. the cost model's timed passes again after other work on
        the machine disturbed them at start-up; it stops early when `interrupted()`, which
        says a request arrived, so a request waits for one timed pass at most), under the
        step lock and only while no request is unfinished; the prefix caches' blocks are
        dropped first (the timed passes write over free blocks). An `AsyncEngine` calls it
        when it has been idle a while."""
        with self._step_lock:
            if self.idle_work is None or self.has_unfinished():
                return
            self._drop_prefix_cache()
            if self.idle_work(self.has_unfinished):
                self.idle_work = None

    def step(self) -> list[RequestDelta]:
        """One engine step; returns a delta for every request that advanced or finished in it.
        An exception inside the step fails the requests that were running (their final deltas
        carry the error) and leaves the engine usable."""
        if self.startup is not None:
            self.run_startup()
        with self._step_lock:
            self._drain_inbox()
            start = time.perf_counter()
            try:
                self._run_step()
            except Exception as error:  # noqa: BLE001 - handed to the failed requests
                self._fail_running(error)
            self.output.mark_scheduled(self.scheduler.running, start)
            return self._collect(self.scheduler.retire())

    def _run_step(self) -> None:
        """Plan the drafts and the step, draft, run one target pass over every decode/verify
        row and prefill chunk, then sample and commit. Verify rows share the step's token
        budget with prefill chunks, so while prompts wait to prefill the drafts may take at
        most 1/`PREFILL_DRAFT_SHARE` of it: a burst of long drafts would otherwise hold back
        every waiting request's first token (8 requests at once, unbounded: p50 TTFT 1.11x
        target-only's; drafts that hit their bound are the likeliest to survive)."""
        spec = self.spec
        drafts = None
        if spec is not None:
            limit = self.config.max_num_batched_tokens // PREFILL_DRAFT_SHARE \
                if self.scheduler.has_prefill_work() else None
            drafts = spec.plan(self.scheduler.decoding(), limit)
        plan = self.scheduler.schedule(drafts)
        if spec is not None:
            for seq in plan.preempted:
                spec.forget(seq)
            for seq in plan.admitted:
                spec.admitted(seq)
        if plan.decode or plan.chunks:
            self._pass(plan)
        elif spec is not None and spec.pending():
            spec.run_pending()  # only draft prefill chunks are left to run

    def _fail_running(self, error: Exception) -> None:
        for seq in self.scheduler.running:
            if not seq.finished:
                self.output.fail(seq.request_id, error)
                self._finish(seq, FINISH_ABORT)

    def _pass(self, plan: StepPlan) -> None:
        """Draft for the decoding sequences (lookups cost nothing; one batched draft-model
        call, which also runs its prefill chunks), then one target pass: each decoding
        sequence's last token and drafts, then the prefill chunks."""
        seqs, ks, spec = plan.decode, plan.ks, self.spec
        draft_prefill = spec is not None and spec.pending()
        t0 = time.perf_counter()
        proposals = spec.propose(seqs, ks) if spec is not None else [EMPTY] * len(seqs)
        t1 = time.perf_counter()
        rows = [[s.token_ids[-1]] + p.tokens for s, p in zip(seqs, proposals)]
        starts = [s.num_cached for s in seqs]
        tables = [s.table for s in seqs]
        last_n = [len(r) for r in rows]
        for c in plan.chunks:
            rows.append(c.seq.token_ids[c.start:c.start + c.num_tokens])
            starts.append(c.start)
            tables.append(c.seq.table)
            last_n.append(1 if c.samples else 0)
        logits = self.runner.forward(rows, starts, tables, last_n)
        results = [self._sample_round(s, p, lg) for s, p, lg in zip(seqs, proposals, logits)]
        t2 = time.perf_counter()
        if spec is not None and seqs:
            self._observe_costs(plan, proposals, draft_prefill, t1 - t0, t2 - t1)
        for seq, prop, res, lg in zip(seqs, proposals, results, logits):
            self._commit(seq, prop, res, lg, t1 - t0, t2 - t1)
        for chunk, lg in zip(plan.chunks, logits[len(seqs):]):
            self._prefilled(chunk, lg)

    def _observe_costs(self, plan: StepPlan, proposals: list[Proposal], draft_prefill: bool,
                       draft_s: float, rest_s: float) -> None:
        """The cost model learns the draft-model time and the rest of the round (the target
        pass and sampling: what a plain decode step costs too, so k = 0 is priced like any
        other k). Steps that also prefilled are not learned from, nor a draft model's
        catch-up after rounds without it."""
        spec, seqs = self.spec, plan.decode
        steps = spec.model_steps(seqs, plan.ks)
        if steps and not draft_prefill and not spec.model_resumed(seqs, plan.ks):
            spec.cost.observe_draft(steps, draft_s)
        if not plan.chunks:
            spec.cost.observe_verify(sum(p.k + 1 for p in proposals) - 1, rest_s)

    def _prefilled(self, chunk: Chunk, logits: torch.Tensor) -> None:
        """A prefill chunk ran: its blocks are computed; the prompt's last chunk samples the
        first token (a recomputation after a preemption samples nothing)."""
        seq = chunk.seq
        seq.num_cached = chunk.start + chunk.num_tokens
        if chunk.samples:
            self._append(seq, self._sample_round(seq, EMPTY, logits).tokens, logits)  # plain
            if seq.first_token_time is None:
                seq.first_token_time = time.perf_counter()
        self.scheduler.commit(seq)

    def _sample_round(self, seq: Sequence, prop: Proposal, logits: torch.Tensor) -> VerifyResult:
        """Turn the target's k + 1 rows of logits into the round's tokens: lossless or mentored
        (a flat budget, or one shaped by the target's entropy), with FLy when the request asks."""
        drafts = torch.tensor(prop.tokens, dtype=torch.long)  # [k]
        params = seq.params
        bonus = self.spec.config.bonus_token if self.spec else True
        fly = FlySettings.of(params) if prop.k >= 2 else None
        if params.greedy and seq.tv_budget == 0.0 and fly is None:
            scores = greedy_scores(logits, params, seq.token_ids, seq.prompt_len, drafts)
            return verify_greedy(drafts, scores, bonus)
        target_probs = processed_probs(logits, params, seq.token_ids, seq.prompt_len,
                                       drafts)  # [k + 1, vocab]
        shaped = params.tv_entropy_top_k is not None and seq.tv_budget > 0 and prop.k > 0
        budget = seq.tv_budget
        if shaped:
            gate = gate_distribution(logits, target_probs, params.greedy)  # [k + 1, vocab]
            budget = entropy_budgets(gate[:prop.k], seq.tv_budget, params.tv_entropy_top_k)
        uniforms = torch.rand(prop.k, generator=seq.generator, dtype=torch.float64)  # [k]
        residual_u = float(torch.rand((), generator=seq.generator, dtype=torch.float64))
        if fly is not None:
            gate = fly_gate_distribution(fly, logits, target_probs, params.greedy)  # [k + 1, vocab]
            return verify_fly(drafts, prop.draft_probs, target_probs, uniforms, residual_u, fly,
                              gate, budget, bonus)
        return verify(drafts, prop.draft_probs, target_probs, uniforms, residual_u, budget, bonus)

    def _commit(self, seq: Sequence, prop: Proposal, res: VerifyResult, logits: torch.Tensor,
                draft_time: float, verify_time: float) -> None:
        old_len = len(seq.token_ids)
        self._append(seq, res.tokens, logits, prop.k, res.num_accepted)
        seq.num_cached = len(seq.token_ids) - 1  # stale draft positions are simply not counted
        self.scheduler.commit(seq)
        if self.spec is not None:
            self.spec.commit(seq, prop, res.num_accepted, old_len)
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
        a stop token or string, max_tokens, the context limit); the rest are dropped."""
        origins = TokenOrigin.of_round(len(tokens), k, num_accepted)
        kept, reason = self.output.process(seq, tokens, logits, origins)
        seq.token_ids += tokens[:kept]
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        self.output.finish(seq, reason)

    # ------------------------------------------------------------------ outputs
    def _collect(self, finished: list[Sequence]) -> list[RequestDelta]:
        """Free what finished sequences hold; the step's deltas."""
        self._release(finished)
        deltas = self.output.deltas()
        with self._live_lock:
            self._live.difference_update(d.request_id for d in deltas if d.finished)
        return deltas

    def _release(self, finished: list[Sequence]) -> None:
        """Sequences that left (their target blocks already freed by the scheduler): their
        speculation state goes, a completed output joins the suffix cache."""
        for seq in finished:
            if self.spec is not None:
                self.spec.finish(seq, completed=seq.finish_reason != FINISH_ABORT)
            self.metrics.total.merge(seq.metrics)

    # ------------------------------------------------------------------ memory figures
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
        taken: the pools are mapped lazily, so this is what they hold resident, at most the
        budget. A prefix cache that keeps finished prompts' blocks grows it toward the budget."""
        total = self.scheduler.blocks.high_water * self.runner.block_bytes
        model = self.spec.model if self.spec is not None else None
        if model is not None:
            total += model.blocks.high_water * model.runner.block_bytes
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