"""The engine core: `step()` = schedule → `round.run(plan)` → `update(plan, out)`, on one thread.

Every decoding round is a speculative round; plain decoding is the round with k = 0 (no
draft, a one-row verify pass, one token sampled from the target). The speculation controller
plans each decoding sequence's drafts (source and k), the scheduler fits them into one step
with the prefill chunks and owns the KV blocks; the round (`rounds.py`) runs the drafters and
one ragged target pass and samples; the update (`update.py`) commits what it computed: each
sequence accepts its own number of tokens and rolls its caches back by arithmetic.

The core is single-threaded: every method is called from the thread that drives it (an
`LLM` call, or an `AsyncEngine`'s thread), so nothing here locks. One table holds the
requests (id → `Request`); all else about a request hangs off that record.
"""

from __future__ import annotations

import copy
import itertools
import random
import time

from specserve.engine.block_manager import BlockManager
from specserve.engine.config import EngineConfig
from specserve.engine import intake, prefill_choice
from specserve.engine.output_processor import FINISH_ABORT, OutputProcessor
from specserve.engine.outputs import EngineStats, RequestDelta, SpeculationOverride
from specserve.engine.request import Request
from specserve.engine.rounds import Round
from specserve.engine.runner import ModelRunner
from specserve.engine.scheduler import Scheduler, StepPlan
from specserve.engine.trace import StepTrace
from specserve.engine.sequence import Sequence
from specserve.engine.update import Update
from specserve.models.tokenizer import Tokenizer
from specserve.sampling.params import SamplingParams
from specserve.speculative.controller import SpeculationController
from specserve.speculative.metrics import EngineMetrics

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
        self.grammars = grammars or intake.compiler(tokenizer, runner.model.cfg.vocab_size)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, blocks)
        self.metrics = EngineMetrics()
        self.output = OutputProcessor(tokenizer, config.max_model_len, spec is not None)
        self.num_aborted = 0
        self.requests: dict[str, Request] = {}  # added and not yet reported finished
        self.round = Round(runner, spec)
        self.update = Update(self.scheduler, self.output, spec, self.requests, self.metrics)
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
        a client may call it on its own thread (`intake.check`)."""
        return intake.check(prompt_ids, params, speculation, self.config.max_model_len,
                            self.runner.model.cfg.vocab_size, self.grammars)

    def _new_sequence(self, req: Request, index: int) -> Sequence:
        seq = intake.sequence(req, index, next(self._ids), self._seeds,
                              self.spec.tv_budget if self.spec else 0.0)
        self.output.start(seq)
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
            self.update.finish(seq, FINISH_ABORT)
            if seq in self.scheduler.waiting:
                self.scheduler.drop(seq)
                self.update.release([seq])
        self.update.release(self.scheduler.retire())

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
        return self.scheduler.has_unfinished() or bool(self.update.touched)

    def has_work(self) -> bool:
        """Whether a step would do something: a sequence not held to run, or deltas to hand
        out (an engine whose requests are all held has nothing to do until one is released)."""
        return self.scheduler.has_runnable() or bool(self.update.touched)

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
        # the target's prefill path, and the draft model's for its own prompt rows (timed where
        # it is "auto"; a draft that is the target's model takes the target's choice)
        for runner in [self.runner, *(self.spec.runners if self.spec is not None else ())]:
            prefill_choice.apply(runner, self.config)
        if self.spec is not None:
            self.spec.startup()

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
        """One engine step, schedule → round → update; returns a delta for every request that
        advanced or finished in it. An exception inside the step fails the requests that were
        running (their final deltas carry the error) and leaves the engine usable."""
        self.run_startup()
        start = time.perf_counter()
        try:
            plan = self._schedule()
            out = self.round.run(plan)
            self.update(plan, out)
            if self._trace is not None and out is not None:
                self._trace.step(self, plan, out, start)
        except Exception as error:  # noqa: BLE001 - handed to the failed requests
            for seq in self.scheduler.scheduled():  # a held sequence was not in the step
                if not seq.finished:
                    self.update.fail(seq, error)
        self.output.mark_scheduled(self.scheduler.running, start)
        self.update.release(self.scheduler.retire())
        return self.update.deltas()

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
            healthy=window.healthy, kv_touched_bytes=self._kv_touched_bytes(),
            prefill_onednn=tuple(self.runner.prefill.parts().items()),
            prefill_dense_bytes=self.runner.prefill_bytes, held=scheduler.num_held)

    def _kv_touched_bytes(self) -> int:
        """Bytes of the KV pools (the target's and the drafters') whose blocks were ever
        taken: the pools are mapped lazily, so this is what they hold resident."""
        total = self.scheduler.blocks.high_water * self.runner.block_bytes
        return total + (self.spec.kv_touched_bytes if self.spec is not None else 0)
