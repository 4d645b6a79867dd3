"""The engine step: schedule → draft → verify → commit → outputs.

Every decoding round is a speculative round; plain decoding is the round with k = 0 (no
draft, a one-row verify pass, one token sampled from the target). A round for a batch of
sequences runs one draft call and one ragged target pass; each sequence then accepts its own
number of tokens and rolls its caches back by arithmetic.
"""

from __future__ import annotations

import itertools
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch

from specserve.engine.outputs import CompletionOutput, RequestOutput
from specserve.engine.runner import ModelRunner, median_round_robin
from specserve.engine.scheduler import Scheduler
from specserve.engine.sequence import Sequence, Status
from specserve.models.tokenizer import Tokenizer
from specserve.sampling.params import SamplingParams
from specserve.sampling.processors import processed_probs
from specserve.sampling.rejection import VerifyResult, verify, verify_greedy
from specserve.sampling.stop import StopChecker, finish_reason_for_token
from specserve.speculative.config import SpeculativeConfig
from specserve.speculative.drafter import EMPTY, Drafter, Proposal
from specserve.speculative.metrics import EngineMetrics
from specserve.speculative.policies import CostModel, FixedPolicy, make_policy


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_num_seqs: int = 8
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass
class _Request:
    prompt: str | None
    prompt_ids: list[int]
    seqs: list[Sequence]


class LLMEngine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, config: EngineConfig,
                 spec: SpeculativeConfig | None = None, drafter: Drafter | None = None,
                 cost: CostModel | None = None) -> None:
        self.runner, self.tokenizer, self.config = runner, tokenizer, config
        self.spec, self.drafter = spec, drafter
        self.cost = cost if cost is not None else CostModel()
        self.scheduler = Scheduler(config.max_num_seqs)
        self.metrics = EngineMetrics()
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._seeds = random.Random()

    def calibrate(self, prefix_len: int = 32, repeats: int = 3) -> dict:
        """Seed the cost model from timed passes, so a cost-aware policy's first rounds
        already know this machine: target passes over k + 1 rows for k = 0..cap, and one draft
        model step (a drafter without a model drafts for free). The calibration fixes the
        shape of cost against k for the engine's life, so it is taken with care: every pass is
        timed `repeats` times, all of them in turn round after round (drift hits each alike),
        and the median kept. Needs a free slot in each cache; returns what it measured."""
        spec = self.spec
        cap = spec.max_k if spec.num_speculative_tokens == -1 else spec.num_speculative_tokens
        draft_runner = getattr(self.drafter, "runner", None)
        with self.runner.pass_timer(prefix_len) as time_target, \
                (draft_runner.pass_timer(prefix_len) if draft_runner else nullcontext()) as time_draft:
            timers = {k: partial(time_target, k) for k in range(cap + 1)}
            if time_draft is not None:
                timers["draft"] = partial(time_draft, 0)
            medians = median_round_robin(timers, repeats)
        draft_step = medians.pop("draft", 0.0)
        self.cost.seed(draft_step, medians)
        return {"draft_step_s": draft_step, "verify_s": medians}

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, prompt: str | None = None) -> str:
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        if len(prompt_ids) >= self.config.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; max_model_len is "
                             f"{self.config.max_model_len} (room for at least one new token needed)")
        vocab = self.runner.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seqs = [self._new_sequence(request_id, i, prompt_ids, params) for i in range(params.n)]
        self._requests[request_id] = _Request(prompt, list(prompt_ids), seqs)
        for seq in seqs:
            self.scheduler.add(seq)
        return request_id

    def _new_sequence(self, request_id: str, index: int, prompt_ids: list[int],
                      params: SamplingParams) -> Sequence:
        seed = params.seed + index if params.seed is not None else self._seeds.getrandbits(63)
        budget = params.tv_budget if params.tv_budget is not None else (
            self.spec.tv_budget if self.spec else 0.0)
        seq = Sequence(next(self._ids), request_id, index, list(prompt_ids), params,
                       torch.Generator().manual_seed(seed), StopChecker.from_params(params), budget)
        seq.policy = self._policy()
        return seq

    def _policy(self):
        if self.spec is None or self.drafter is None:
            return FixedPolicy(0)
        return make_policy(self.spec.policy_name, self.spec.num_speculative_tokens, self.cost,
                           max_k=self.spec.max_k)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that finished in it."""
        ongoing = list(self.scheduler.running)
        admitted = self.scheduler.admit(self.runner.cache.num_free_slots)
        if admitted:
            self._prefill(admitted)
        if ongoing:
            self._round(ongoing)
        return self._collect(self.scheduler.retire())

    def _prefill(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            seq.slot = self.runner.cache.allocate()
        logits = self.runner.forward([s.prompt_ids for s in seqs], [0] * len(seqs),
                                     [s.slot for s in seqs], [1] * len(seqs))
        for seq, lg in zip(seqs, logits):
            seq.num_cached = seq.prompt_len
            self._append(seq, self._sample_round(seq, EMPTY, lg).tokens, lg)
            if self.drafter is not None and not seq.finished:
                self.drafter.start(seq)
            seq.first_token_time = time.perf_counter()

    def _round(self, seqs: list[Sequence]) -> None:
        """One round: choose k, draft, verify, commit. The cost model learns the draft time
        and the rest of the round (choosing, the target pass, sampling, bookkeeping): that
        rest is what a plain decode step costs too, so k = 0 is priced like any other k."""
        start = time.perf_counter()
        ks = [self._choose_k(s, len(seqs)) for s in seqs]
        t0 = time.perf_counter()
        proposals = self.drafter.propose(seqs, ks) if self.drafter and any(ks) else [EMPTY] * len(seqs)
        t1 = time.perf_counter()
        rows = [[s.token_ids[-1]] + p.tokens for s, p in zip(seqs, proposals)]
        logits = self.runner.forward(rows, [s.num_cached for s in seqs], [s.slot for s in seqs])
        results = [self._sample_round(s, p, lg) for s, p, lg in zip(seqs, proposals, logits)]
        t2 = time.perf_counter()
        for seq, prop, res, lg in zip(seqs, proposals, results, logits):
            self._commit(seq, prop, res, lg, t1 - t0, t2 - t1)
        end = time.perf_counter()
        max_k = max(p.k for p in proposals)
        # a drafter resuming after rounds without drafting first catches up on what it missed:
        # that one-off cost is not what drafting k tokens costs, so it is not learned from
        resumed = any(k > 0 and s.idle_drafter for s, k in zip(seqs, ks))
        if max_k and not resumed:
            self.cost.observe_draft(max(ks), t1 - t0)
        self.cost.observe_verify(max_k, (end - start) - (t1 - t0))
        for seq, k in zip(seqs, ks):
            seq.idle_drafter = k == 0

    def _choose_k(self, seq: Sequence, batch_size: int) -> int:
        spec = self.spec
        if spec is None or self.drafter is None:
            return 0
        if spec.disable_by_batch_size is not None and batch_size >= spec.disable_by_batch_size:
            return 0
        room = min(seq.tokens_left() - (1 if spec.bonus_token else 0),
                   self.runner.max_len - len(seq.token_ids))
        if room <= 0:
            return 0
        return min(seq.policy.choose_k(room), room)

    def _sample_round(self, seq: Sequence, prop: Proposal, logits: torch.Tensor) -> VerifyResult:
        """Turn the target's k + 1 rows of logits into the round's tokens."""
        drafts = torch.tensor(prop.tokens, dtype=torch.long)  # [k]
        target_probs = processed_probs(logits, seq.params, seq.token_ids, seq.prompt_len,
                                       drafts)  # [k + 1, vocab]
        bonus = self.spec.bonus_token if self.spec else True
        if seq.params.greedy and seq.tv_budget == 0.0:
            return verify_greedy(drafts, target_probs, bonus)
        uniforms = torch.rand(prop.k, generator=seq.generator, dtype=torch.float64)  # [k]
        residual_u = float(torch.rand((), generator=seq.generator, dtype=torch.float64))
        return verify(drafts, prop.draft_probs, target_probs, uniforms, residual_u,
                      seq.tv_budget, bonus)

    def _commit(self, seq: Sequence, prop: Proposal, res: VerifyResult, logits: torch.Tensor,
                draft_time: float, verify_time: float) -> None:
        old_len = len(seq.token_ids)
        self._append(seq, res.tokens, logits)
        seq.num_cached = len(seq.token_ids) - 1  # stale draft positions are simply not counted
        if self.drafter is not None:
            self.drafter.commit(seq, res.num_accepted, old_len)
        seq.policy.observe(prop.k, res.num_accepted)
        m = seq.metrics
        m.record(prop.k, res.num_accepted, len(res.tokens), res.tv_distances)
        m.draft_time += draft_time
        m.verify_time += verify_time
        self.metrics.window.record(prop.k, res.num_accepted)

    # ------------------------------------------------------------------ tokens and stops
    def _append(self, seq: Sequence, tokens: list[int], logits: torch.Tensor) -> None:
        """Add the round's tokens one by one, stopping at the first that ends the sequence
        (EOS, a stop token or string, max_tokens, the context limit); the rest are dropped."""
        check_strings = bool(seq.params.stop)
        for i, token in enumerate(tokens):
            seq.token_ids.append(token)
            if seq.params.logprobs is not None:
                seq.logprobs.append(_logprobs(logits[i], token, seq.params.logprobs))
            reason = finish_reason_for_token(token, seq.params, self.tokenizer.eos_token_ids)
            if check_strings and self._stop_string(seq):
                reason = "stop"
            if reason is None and (seq.tokens_left() <= 0
                                   or len(seq.token_ids) >= self.config.max_model_len):
                reason = "length"
            if reason is not None:
                self._finish(seq, reason)
                break
        if not check_strings:
            seq.text = self.tokenizer.decode(seq.output_ids)

    def _stop_string(self, seq: Sequence) -> bool:
        previous = seq.text
        seq.text = self.tokenizer.decode(seq.output_ids)
        cut = seq.stop_checker.check(seq.text, len(previous))
        if cut is None:
            return False
        seq.text = seq.text[:cut]
        return True

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()

    # ------------------------------------------------------------------ outputs
    def _collect(self, finished: list[Sequence]) -> list[RequestOutput]:
        for seq in finished:
            self.runner.cache.release(seq.slot)
            if self.drafter is not None:
                self.drafter.finish(seq)
            self.metrics.total.merge(seq.metrics)
        done = {s.request_id for s in finished}
        outputs = []
        for rid, req in list(self._requests.items()):  # arrival order
            if rid in done and all(s.finished for s in req.seqs):
                outputs.append(self._request_output(rid, req))
                del self._requests[rid]
        return outputs

    def _request_output(self, rid: str, req: _Request) -> RequestOutput:
        spec_on = self.drafter is not None
        outs = [CompletionOutput(
            index=s.index, text=s.text, token_ids=s.output_ids, finish_reason=s.finish_reason,
            num_output_tokens=s.num_output, ttft=s.first_token_time - s.arrival,
            decode_time=s.finish_time - s.first_token_time, e2e_time=s.finish_time - s.arrival,
            spec=s.metrics if spec_on else None,
            logprobs=s.logprobs if s.params.logprobs is not None else None) for s in req.seqs]
        return RequestOutput(rid, req.prompt, req.prompt_ids, outs, finished=True)


def _logprobs(logits_row: torch.Tensor, token: int, top: int) -> dict[int, float]:
    logp = torch.log_softmax(logits_row.float(), dim=-1)  # [vocab]
    out = {token: float(logp[token])}
    if top:
        values, ids = logp.topk(top)
        out.update({int(i): float(v) for i, v in zip(ids, values)})
    return out
