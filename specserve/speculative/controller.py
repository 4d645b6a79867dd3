"""The speculation controller: which source drafts for each sequence, and how many tokens.

One per engine. It owns the method's drafters (`sources.SOURCES`; each implements
`drafter.Drafter` and declares what it is: free or in-step, forced, needing a grammar's mask
or the target's hidden states; the controller reads only that), each sequence's draft-length
policy, the cost model (seeded by timed passes at start-up, then learning from every round)
and the acceptance statistics. The engine sees a narrow surface:

- `join(seqs, override, tokenizer)` / `release(seq, completed)`: a request's sequences come
  and go (their state lives on the sequence, `seq.spec`; drafters' indexes are created and
  dropped here);
- `plan(seqs, max_rows)` → k per decoding sequence, before the step is scheduled;
- `propose(plan)` → the drafts of the scheduled sequences (and the draft model's prefill);
- `wants_hidden` / `observe_hidden(seqs, starts, hidden)`: a drafter reads the target's
  hidden states of each pass;
- `observe(plan, proposals, accepted, old_lens, draft_s, rest_s)`: what the verifier kept and
  what the round cost: drafters roll back, policies and the cost model learn;
- `describe(plan)`: the plan in words, for the step trace;
- `startup()`, `idle_work(interrupted)`: the cost model's timed passes.

How a plan is chosen (offers priced by expected tokens per second, one budget of rows for the
whole step, a slowdown cap per sequence, probes up and down) is described with its reasons in
docs/design.md ("The speculation controller"); the rule for one source is in `cost_aware.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.speculative.budget import LOOKUP, MODEL, Offer, StepBudget, best_prefix
from specserve.speculative.candidate import NO_CANDIDATE, Candidate
from specserve.speculative.cost_aware import DEFAULT_MARGIN, CostAwarePolicy
from specserve.speculative.drafter import EMPTY, Proposal
from specserve.speculative.free_drafts import FreeDrafts
from specserve.speculative.match_stats import RequestFit
from specserve.speculative.policies import FixedPolicy, make_policy

MODEL_AFTER_MISSES = 8  # rounds in a row without a lookup offer before a draft model starts
BACKOFF_AFTER = 4  # idle rounds of a poorly copying sequence before its lookups thin out
MAX_BACKOFF = 3  # ... to one look per this many rounds + 1
IDLE_REASONS = ("off", "no_room", "no_match", "did_not_pay", "batch_limit", "draft_starting",
                "backed_off", "probe")


@dataclass(slots=True)
class SeqSpeculation:
    """The controller's state of one sequence."""

    enabled: bool
    fixed_k: int | None  # a fixed k: drafts of that length whenever a source has them
    policy: object  # the draft model's policy (None without a draft model)
    candidate: Candidate = NO_CANDIDATE  # this step's lookup candidate (after `forced`)
    forced: list[int] = field(default_factory=list)  # this step's grammar-forced drafts
    source: str | None = None  # this step's source
    reason: str = "no_match"
    model_idle: bool = False  # the draft model drafted nothing in this sequence's last round
    lookup_misses: int = 0  # rounds in a row whose lookup offered nothing worth verifying
    fit: RequestFit = field(default_factory=RequestFit)  # its lookups' first positions
    idle: int = 0  # rounds in a row it was offered nothing or its offer was not taken
    wait: int = 0  # rounds left before its next look (see `_back_off`)


class SpeculationController:
    def __init__(self, config, cost, drafters=(), max_model_len: int = 1 << 30,
                 calibration=None) -> None:
        """`config`: the engine's SpeculativeConfig; `cost`: its CostModel; `drafters`: the
        method's drafters (`sources.SOURCES`), read by their declared capabilities
        (`drafter.Drafter`): a forced free drafter (a grammar's), a lookup (another free
        one) and an in-step one (a draft model), each optional; `calibration`:
        `calibration.Calibration` of the cost model (None: not timed)."""
        self.config, self.cost, self.drafters = config, cost, list(drafters)
        self.free = FreeDrafts(self.drafters)
        self.lookup, self.stats = self.free.lookup, self.free.stats
        self.model = next((d for d in self.drafters if d.in_step), None)
        self.max_model_len, self.calibration = max_model_len, calibration
        self.budget = StepBudget()  # the step's rows, and the probes
        self._draft_prefilled = False  # the draft model prefilled in this step's propose

    @property
    def cap(self) -> int:
        """The most drafts one sequence verifies in a round."""
        k = self.config.num_speculative_tokens
        return self.config.max_k if k == -1 else k

    @property
    def bonus_token(self) -> bool:
        return self.config.bonus_token

    @property
    def tv_budget(self) -> float:
        """The mentored-decoding budget of a request that sets none."""
        return self.config.tv_budget

    @property
    def kv_touched_bytes(self) -> int:
        """Bytes of the drafters' KV pools ever taken."""
        return sum(d.kv_touched_bytes for d in self.drafters)

    @staticmethod
    def state(seq) -> SeqSpeculation:
        """The controller's state of a sequence (kept on the sequence)."""
        return seq.spec

    # ------------------------------------------------------------------ lifecycle
    def join(self, seqs: list, override=None, tokenizer=None) -> None:
        """A request's sequences join (`override`: its SpeculationOverride, or None); the
        drafters index what they want of them (`tokenizer`: other renderings of the prompt)."""
        config, k = self.config, self.config.num_speculative_tokens
        name = config.policy_name
        if override is not None and override.num_speculative_tokens is not None:
            k = override.num_speculative_tokens
            name = "cost_aware" if k == -1 else "fixed"
        enabled = override is None or override.enabled
        for drafter in self.drafters:
            drafter.join(seqs, tokenizer)
        for seq in seqs:
            policy = None
            if self.model is not None:
                policy = make_policy(name, k, self.cost, max_k=config.max_k) if enabled \
                    else FixedPolicy(0)
            seq.spec = SeqSpeculation(enabled and k != 0, k if name == "fixed" else None, policy)

    def release(self, seq, completed: bool) -> None:
        """The sequence left; a completed output may join a drafter's shared cache."""
        for drafter in reversed(self.drafters):  # (the draft model first, as before)
            drafter.finish(seq, keep=completed)

    def reset_prefix_cache(self) -> None:
        """Forget the drafters' cached prefix blocks that no sequence holds."""
        for drafter in self.drafters:
            drafter.reset_prefix_cache()

    def clear_cache(self) -> None:
        """Forget the earlier requests' outputs the drafters keep (if they keep any)."""
        for drafter in self.drafters:
            drafter.clear()

    # ------------------------------------------------------------------ start-up, idle
    @property
    def runners(self) -> list:
        """The drafters' own model runners (a draft model's), whose prompt rows take a prefill
        path as the target's do."""
        return [d.runner for d in self.drafters if d.runner is not None]

    def startup(self) -> None:
        """The drafters' start-up work (a draft's restricted head), then the cost model's
        timed passes (on the thread that steps the engine)."""
        for drafter in self.drafters:
            drafter.startup()
        if self.calibration is not None:
            self.calibration.run()

    @property
    def has_idle_work(self) -> bool:
        """Whether the timed passes must run again (other work disturbed them)."""
        return self.calibration is not None and self.calibration.pending

    def idle_work(self, interrupted) -> None:
        """The timed passes once more, stopped by `interrupted()`."""
        self.calibration.retry(interrupted)

    # ------------------------------------------------------------------ the plan
    def plan(self, seqs: list, max_rows: int | None = None) -> dict[int, int]:
        """Drafts to verify per decoding sequence (seq_id → k), oldest sequence first;
        `max_rows`: at most that many draft rows in all, beyond those taken as asked (the
        engine's bound while prompts wait to prefill, see `LLMEngine._run_step`)."""
        self.cost.set_step(len(seqs))
        limit = self.config.disable_by_batch_size
        offers = []
        for seq in seqs:
            st = seq.spec
            st.candidate, st.source = NO_CANDIDATE, None
            if limit is not None and len(seqs) >= limit:
                offer = Offer(reason="batch_limit")
            elif st.wait > 0:
                st.wait -= 1
                st.lookup_misses += 1
                offer = Offer(reason="backed_off")
            else:
                offer = self._offer(seq, st)
            st.reason = offer.reason
            offers.append(offer)
        ks = self.budget.choose(offers, len(seqs), self.cost, max_rows)
        for seq, offer, k in zip(seqs, offers, ks):
            st = seq.spec
            st.source = offer.source if k else None
            if not k and offer.source is not None:
                st.reason = "probe" if self.budget.plain_probe else "did_not_pay"
            self._back_off(seq, st, k, len(seqs))
        return {seq.seq_id: k for seq, k in zip(seqs, ks)}

    def _back_off(self, seq, st: SeqSpeculation, k: int, batch: int) -> None:
        """Looking costs host time every round (a search of the context and the shared
        cache), so a sequence that has not
        copied better than the engine's average (its fit at most 1: below it, or no record
        yet, as for a story at eight sequences whose one-row offers never pay there) and has
        drafted nothing for `BACKOFF_AFTER` looks in a row, in a batch (where that time adds
        up and a verify row costs more), looks only every second round, then third, then
        fourth, until a look drafts again. Not while its draft model runs (that would make
        it catch up)."""
        if k:
            st.idle = st.wait = 0
        elif st.reason in ("no_match", "did_not_pay"):
            st.idle += 1
            if (batch > 1 and st.fit.factor() <= 1.0 and st.fixed_k is None
                    and seq.grammar is None
                    and (self.model is None or not self.model.started(seq))):
                st.wait = min(st.idle // BACKOFF_AFTER, MAX_BACKOFF)

    def _room(self, seq) -> int:
        bonus = 1 if self.config.bonus_token else 0
        return min(seq.tokens_left() - bonus, self.max_model_len - len(seq.token_ids), self.cap)

    def _offer(self, seq, st: SeqSpeculation) -> Offer:
        room = self._room(seq)
        if not st.enabled:
            return Offer(reason="off")
        if room <= 0:
            return Offer(reason="no_room")
        lookup = self._lookup_offer(seq, st, room)
        if st.fixed_k is not None:
            if lookup.survival:
                lookup.forced = True
                return lookup
            return self._model_offer(seq, st, room) if self.model is not None else lookup
        if self.model is not None:
            plain = (1.0 + DEFAULT_MARGIN) / max(self.cost.step_time(0), 1e-12)
            lookup_rate = best_prefix(lookup.survival, LOOKUP, self.cost)[1]
            st.lookup_misses = st.lookup_misses + 1 if lookup_rate <= plain else 0
            patient = self.lookup is not None and st.fixed_k is None
            if lookup_rate <= plain and (not patient or st.lookup_misses >= MODEL_AFTER_MISSES
                                         or self.model.started(seq)):
                # the free source would not pay (and has not for a while): the draft model
                model = self._model_offer(seq, st, room)
                model_rate = best_prefix(model.survival, MODEL, self.cost)[1]
                if model.forced or (model.survival and model_rate > max(plain, lookup_rate)):
                    return model
                if not lookup.survival:
                    return Offer(reason=model.reason)
        return lookup

    def _lookup_offer(self, seq, st: SeqSpeculation, room: int) -> Offer:
        """The free drafters' offer (`free_drafts.py`)."""
        n = self.free.find(seq, st, room if st.fixed_k is None else min(room, st.fixed_k))
        if not n:
            return Offer(reason="no_match")
        fixed = st.fixed_k is not None
        return Offer(LOOKUP, [1.0] * n if fixed else self.free.survival(st), reason="")

    def _model_offer(self, seq, st: SeqSpeculation, room: int) -> Offer:
        model, policy = self.model, st.policy
        if not model.ready(seq):
            if model.started(seq):
                return Offer(reason="draft_starting")  # its prefill is under way
            startup = self.cost.draft_prefill_time(model.startup_tokens(seq))
            if not policy.worth_starting(min(seq.tokens_left(), self.max_model_len), startup):
                return Offer(reason="did_not_pay")
            model.activate(seq)
            if not model.ready(seq):
                return Offer(reason="draft_starting")
        k = min(policy.choose_k(room), room)
        if k <= 0:
            return Offer(reason="did_not_pay")
        if not isinstance(policy, CostAwarePolicy) or policy.probing:
            return Offer(MODEL, [1.0] * k, forced=True, reason="")  # taken as the policy asks
        survival, reach = [], 1.0
        for alpha in policy.acceptance()[:k]:
            reach *= alpha
            survival.append(reach)
        return Offer(MODEL, survival, reason="")

    # ------------------------------------------------------------------ the round
    @property
    def wants_hidden(self) -> bool:
        """Whether a drafter drafts from the target's hidden states (`observe_hidden`)."""
        return any(d.needs_hidden for d in self.drafters)

    def observe_hidden(self, seqs: list, starts: list[int], hidden: list) -> None:
        """The target's final hidden states of a pass: `hidden[i]` `[rows, hidden]` of
        `seqs[i]` from position `starts[i]` on (decode rows and prefill chunks alike)."""
        for drafter in self.drafters:
            if drafter.needs_hidden:
                for seq, start, h in zip(seqs, starts, hidden):
                    if drafter.started(seq):
                        drafter.observe(seq, start, h)

    def propose(self, plan) -> list[Proposal]:
        """The drafts of the step's decoding sequences (`plan.decode`, `plan.ks`: the
        scheduler may have cut a plan's k to 0 where the cache could not grow for drafts),
        plus any draft-model prefill chunks. Sequences the step admitted start with the draft
        model; preempted ones lose what it held of them."""
        model = self.model
        if model is not None:
            for seq in plan.preempted:
                model.finish(seq, keep=False)
                seq.spec.model_idle = False
            for seq in plan.admitted:
                model.start(seq)
        seqs, ks = plan.decode, plan.ks
        proposals = [EMPTY] * len(seqs)
        model_ks = [0] * len(seqs)
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            st = seq.spec
            if k and st.source == LOOKUP:
                proposals[i] = Proposal((st.forced + st.candidate.tokens)[:k], None)
            elif k and st.source == MODEL:
                model_ks[i] = k
        self._draft_prefilled = model is not None and model.pending()
        if model is not None and (any(model_ks) or self._draft_prefilled):
            drafted = model.propose(seqs, model_ks)
            for i, k in enumerate(model_ks):
                if k:
                    proposals[i] = drafted[i]
        return proposals

    def observe(self, plan, proposals: list[Proposal], accepted: list[int],
                old_lens: list[int], draft_s: float | None = None,
                rest_s: float | None = None) -> None:
        """The round ran: the verifier kept `accepted[i]` of `proposals[i]` (each sequence's
        tokens now hold them and the recovered or bonus token; `old_lens[i]`: its length
        before). Drafters roll back, policies and statistics learn, and the cost model learns
        the draft time and the rest of the round (the target pass and sampling: what a plain
        decode step costs too, so k = 0 is priced like any other k) — not from steps that
        also prefilled, nor from a draft model's catch-up after rounds without it (nor at all
        without timings)."""
        seqs, ks = plan.decode, plan.ks
        steps = max((k for s, k in zip(seqs, ks) if s.spec.source == MODEL), default=0)
        resumed = any(k and s.spec.source == MODEL and s.spec.model_idle
                      for s, k in zip(seqs, ks))
        if draft_s is not None and steps and not self._draft_prefilled and not resumed:
            self.cost.observe_draft(steps, draft_s)
        if rest_s is not None and not plan.chunks:
            self.cost.observe_verify(sum(p.k + 1 for p in proposals) - 1, rest_s)
        for seq, prop, n, old_len in zip(seqs, proposals, accepted, old_lens):
            self._commit(seq, prop, n, old_len)

    def describe(self, plan) -> dict:
        """The step's plan in words (for the step trace): per decoding sequence the source
        that drafted (None: none) and why it drafted nothing (None: it drafted), and the
        cost model's prediction of the step's seconds."""
        seqs, ks = plan.decode, plan.ks
        steps = max((k for s, k in zip(seqs, ks) if s.spec.source == MODEL), default=0)
        predicted = self.cost.draft_time(steps) + self.cost.pass_time(len(seqs) + sum(ks))
        return {"source": [self._source_name(s.spec) if k else None for s, k in zip(seqs, ks)],
                "reason": [None if k else s.spec.reason for s, k in zip(seqs, ks)],
                "predicted_s": round(predicted, 6)}

    def _source_name(self, st: SeqSpeculation) -> str | None:
        if st.source == MODEL:
            return self.model.name
        return self.free.name(st) if st.source == LOOKUP else st.source

    def _commit(self, seq, proposal: Proposal, num_accepted: int, old_len: int) -> None:
        st = seq.spec
        k = proposal.k
        if self.model is not None:
            self.model.commit(seq, num_accepted, old_len)
        if k and st.source == LOOKUP:
            self.free.learn(seq, st, k, num_accepted)
        elif k and st.source == MODEL:
            seq.metrics.record_source(self.model.name, k, num_accepted, st.reason)
        else:
            seq.metrics.record_source(None, 0, 0, st.reason)
        if st.policy is not None:
            st.policy.observe(k if st.source == MODEL else 0, num_accepted)
        st.model_idle = not (k and st.source == MODEL)
