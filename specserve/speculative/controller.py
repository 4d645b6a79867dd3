"""The speculation controller: which source drafts for each sequence, and how many tokens.

One per engine. It owns the drafters (a *lookup* source — suffix drafting or prompt lookup —
and optionally a draft model), each sequence's draft-length policy, the engine's cost model
and the acceptance statistics, and decides before every step, per decoding sequence, how many
drafts to verify from which source (`plan`); the scheduler receives those numbers and the
engine runs the round (`propose`, then `commit` with what the verifier kept).

The choice, for a step decoding B sequences (see `cost_aware.py` for the single-source rule):
1. **Offers.** Each sequence's lookup source proposes a candidate continuation with a
   survival estimate per position (`match_stats.py`: from the match's length and the votes
   behind each token, learned online). Its draft model, if there is one, is considered when
   the lookup would not pay (and, before its first start, has not for `MODEL_AFTER_MISSES`
   rounds in a row: text that copies itself should not pay for a draft prefill the lookup
   makes useless): its cost-aware policy picks k (and decides whether starting the draft —
   its deferred prefill — repays itself); its survivals are the products of the policy's
   per-position acceptance. The two are priced by expected tokens per second,
   E(k) / T(k), against plain decoding (E = 1, T = T(0)); the better source is offered.
2. **One budget.** The offered draft slots of all sequences compete for the rows of one
   pass: slots are taken in order of survival while the step's expected tokens per second,
   (B + Σ survivals) / (draft time + pass time of B + n rows), is highest, and only if what
   they add (expected tokens over the seconds they add) beats plain decoding's rate by the
   policy's margin. So under load, where every row costs, only
   the drafts most likely to survive are verified, and speculation never lowers the step's
   expected throughput by its own estimate. And no sequence pays more than its share for
   the others' drafts: a step's drafts may stretch it to at most 1 + `SLOWDOWN_CAP` times
   its time without them, times the smallest expected tokens (1 + Σ survivals) of any of its
   sequences — one that drafts nothing is slowed by at most that much, whatever the others
   gain. Without the bound a story sharing a pass with three code edits ran 1.4x slower
   than on a server without speculation, and a batch of requests finished later: the copying
   requests were done early, and the slowed ones ran on alone, in small batches. A fixed k (a config or request asking for one),
   the k of a policy other than the cost-aware one, and the cost-aware policy's probes are
   taken as asked.
3. **Probes.** The budget prices rows by the cost model, which learns only from the passes
   it sees; one whose start-up calibration over-priced extra rows (another process shared
   the cores while it timed them) would never verify a draft, never see a larger pass and
   never learn (a server seeded so drafted 73 tokens in 4,011 rounds). So once every
   `PROBE_EVERY` steps in which the budget left out a lookup slot (or a sequence did not
   look, backed off for offers not taken), the next step that leaves one out verifies one
   more: the likeliest left out. That pass size is then timed by serving; a few such passes
   correct its price (`cost_model.py`), and if it pays, the next size is probed from there.
   It costs one row in `PROBE_EVERY` steps where the price was right.
   The converse error drafts at a loss: a pass over the batch's own rows (nothing drafted)
   that the calibration over-priced makes every draft row look cheap, and once the engine
   drafts every step that pass is never timed again (at 8 clients a server verified one
   draft row on 93% of its steps, 145 tokens/s where plain passes gave 155, its model having
   timed two plain passes of that batch). So once every `PROBE_DOWN_EVERY` steps whose
   budget took a slot, if a pass one row smaller has not been timed lately (its weight in
   the cost model's shape correction below `SEEN_LATELY`), the step verifies the likeliest
   taken slots without the least likely one, and that smaller pass is timed.

A sequence whose plan is k = 0 costs what plain decoding costs: no draft model runs for it
(unless it is catching up a started draft's prefill), and the lookup is a host-side search.
That search is the one cost left, so a sequence that copies poorly (or has not yet), in a
batch, looks less often (`_back_off`); each request's short matches are priced by its own
record as well as the engine's table (`match_stats.RequestFit`), and the cost model learns
from the passes it sees which pass sizes its start-up calibration got wrong (`cost_model.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specserve.speculative.candidate import NO_CANDIDATE, Candidate
from specserve.speculative.cost_aware import DEFAULT_MARGIN, CostAwarePolicy
from specserve.speculative.cost_model import CostModel
from specserve.speculative.draft_model import DraftModelDrafter
from specserve.speculative.drafter import EMPTY, Proposal
from specserve.speculative.match_stats import MatchStats, RequestFit
from specserve.speculative.ngram import NgramDrafter
from specserve.speculative.policies import FixedPolicy, make_policy
from specserve.speculative.suffix import SuffixCache, SuffixDrafter, escaped_view

LOOKUP, MODEL = "lookup", "draft_model"  # the two kinds of source
MODEL_AFTER_MISSES = 8  # rounds in a row without a lookup offer before a draft model starts
BACKOFF_AFTER = 4  # idle rounds of a poorly copying sequence before its lookups thin out
MAX_BACKOFF = 3  # ... to one look per this many rounds + 1
SLOWDOWN_CAP = 0.25  # a step's drafts leave no sequence's expected rate below 1/1.25 of plain
PROBE_EVERY = 64  # steps whose budget left a lookup slot out, per probe of one more row
PROBE_DOWN_EVERY = 16  # steps whose budget took a slot, per probe of one row fewer ...
SEEN_LATELY = 4.0  # ... of a pass size the cost model has seen less than this lately
IDLE_REASONS = ("off", "no_room", "no_match", "did_not_pay", "batch_limit", "draft_starting",
                "backed_off")


@dataclass(slots=True)
class Offer:
    """What one sequence could verify this step: `survival` [k] P(first i drafts accepted)."""

    source: str | None = None
    survival: list[float] = field(default_factory=list)
    forced: bool = False  # taken whole (a fixed k, a probe), outside the budget
    reason: str = "no_match"  # why nothing is offered


@dataclass(slots=True)
class SeqSpeculation:
    """The controller's state of one sequence."""

    enabled: bool
    fixed_k: int | None  # a fixed k: drafts of that length whenever a source has them
    policy: object  # the draft model's policy (None without a draft model)
    candidate: Candidate = NO_CANDIDATE  # this step's lookup candidate
    source: str | None = None  # this step's source
    reason: str = "no_match"
    model_idle: bool = False  # the draft model drafted nothing in this sequence's last round
    lookup_misses: int = 0  # rounds in a row whose lookup offered nothing worth verifying
    fit: RequestFit = field(default_factory=RequestFit)  # its lookups' first positions
    idle: int = 0  # rounds in a row it was offered nothing or its offer was not taken
    wait: int = 0  # rounds left before its next look (see `_back_off`)


class SpeculationController:
    def __init__(self, config, cost, lookup=None, model=None, source_name: str = "suffix",
                 max_model_len: int = 1 << 30) -> None:
        """`config`: the engine's SpeculativeConfig; `cost`: its CostModel; `lookup`: a
        lookup drafter (`candidate(seq, limit)`, `finish(seq, keep)`); `model`: a draft-model
        drafter (see `drafter.Drafter`) or None; `source_name` names the lookup in metrics."""
        self.config, self.cost, self.lookup, self.model = config, cost, lookup, model
        self.source_name, self.max_model_len = source_name, max_model_len
        self.stats = MatchStats()
        self._seqs: dict[int, SeqSpeculation] = {}
        self.probe_every = PROBE_EVERY  # (see the module doc, step 3)
        self.probe_down_every = PROBE_DOWN_EVERY
        self._left_out = 0  # steps since the last probe whose budget left a lookup slot out
        self._took = 0  # steps since the last downward probe whose budget took a slot
        self.probes = 0  # probes taken (see the module doc, step 3)
        self.probes_down = 0  # ... and downward probes

    @property
    def cap(self) -> int:
        """The most drafts one sequence verifies in a round."""
        k = self.config.num_speculative_tokens
        return self.config.max_k if k == -1 else k

    def state(self, seq) -> SeqSpeculation:
        """The controller's state of a sequence it tracks."""
        return self._seqs[seq.seq_id]

    # ------------------------------------------------------------------ lifecycle
    def add(self, seq, override=None, views: list[list[int]] = ()) -> None:
        """A request's sequence joins (`override`: its SpeculationOverride, or None; `views`:
        other renderings of its prompt, from `prompt_views`: none unless the lookup searches
        them)."""
        for view in views:
            self.lookup.add_view(seq, view)
        config, k = self.config, self.config.num_speculative_tokens
        name = config.policy_name
        if override is not None and override.num_speculative_tokens is not None:
            k = override.num_speculative_tokens
            name = "cost_aware" if k == -1 else "fixed"
        enabled = override is None or override.enabled
        policy = None
        if self.model is not None:
            policy = make_policy(name, k, self.cost, max_k=config.max_k) if enabled \
                else FixedPolicy(0)
        self._seqs[seq.seq_id] = SeqSpeculation(enabled and k != 0,
                                                k if name == "fixed" else None, policy)

    def admitted(self, seq) -> None:
        """The scheduler admitted the sequence (its prompt may still be prefilling)."""
        if self.model is not None:
            self.model.start(seq)

    def forget(self, seq) -> None:
        """The sequence was preempted: what the draft model held of it goes."""
        if self.model is not None:
            self.model.finish(seq)
        self._seqs[seq.seq_id].model_idle = False

    def prompt_views(self, tokenizer, prompt_ids: list[int]) -> list[list[int]]:
        """The views of a prompt that the lookup searches (`add`'s `views`; none if it
        searches none): the prompt escaped as a JSON string (`suffix.escaped_view`)."""
        if not hasattr(self.lookup, "add_view"):
            return []
        view = escaped_view(tokenizer, prompt_ids)
        return [view] if view else []

    def finish(self, seq, completed: bool) -> None:
        """The sequence left; a completed output joins the lookup's shared cache."""
        if self.model is not None:
            self.model.finish(seq)
        if self.lookup is not None:
            self.lookup.finish(seq, keep=completed)
        self._seqs.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> None:
        """Forget the draft model's cached prefix blocks that no sequence holds."""
        if self.model is not None:
            self.model.blocks.reset_prefix_cache()

    def clear_cache(self) -> None:
        """Forget the earlier requests' outputs the lookup keeps (if it keeps any)."""
        cache = getattr(self.lookup, "cache", None)
        if cache is not None:
            cache.clear()

    def pending(self) -> bool:
        """Whether the draft model has prefill work even when no sequence drafts."""
        return self.model is not None and self.model.pending()

    def run_pending(self) -> None:
        self.model.propose([], [])

    # ------------------------------------------------------------------ the plan
    def plan(self, seqs: list, max_rows: int | None = None) -> dict[int, int]:
        """Drafts to verify per decoding sequence (seq_id → k), oldest sequence first;
        `max_rows`: at most that many draft rows in all, beyond those taken as asked (the
        engine's bound while prompts wait to prefill, see `LLMEngine._run_step`)."""
        self.cost.set_step(len(seqs))
        limit = self.config.disable_by_batch_size
        offers = []
        for seq in seqs:
            st = self._seqs[seq.seq_id]
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
        ks = self._within_budget(offers, len(seqs), max_rows)
        for seq, offer, k in zip(seqs, offers, ks):
            st = self._seqs[seq.seq_id]
            st.source = offer.source if k else None
            if not k and offer.source is not None:
                st.reason = "did_not_pay"
            self._back_off(seq, st, k, len(seqs))
        return {seq.seq_id: k for seq, k in zip(seqs, ks)}

    def _back_off(self, seq, st: SeqSpeculation, k: int, batch: int) -> None:
        """Looking costs host time every round (a search of the context and the shared
        cache: ~1% of a step per sequence at four sequences), so a sequence that has not
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
            lookup_rate = self._best_prefix(lookup.survival, LOOKUP)[1]
            st.lookup_misses = st.lookup_misses + 1 if lookup_rate <= plain else 0
            patient = self.lookup is not None and st.fixed_k is None
            if lookup_rate <= plain and (not patient or st.lookup_misses >= MODEL_AFTER_MISSES
                                         or self.model.started(seq)):
                # the free source would not pay (and has not for a while): the draft model
                model = self._model_offer(seq, st, room)
                model_rate = self._best_prefix(model.survival, MODEL)[1]
                if model.forced or (model.survival and model_rate > max(plain, lookup_rate)):
                    return model
                if not lookup.survival:
                    return Offer(reason=model.reason)
        return lookup

    def _lookup_offer(self, seq, st: SeqSpeculation, room: int) -> Offer:
        if self.lookup is None:
            return Offer(reason="no_match")
        limit = room if st.fixed_k is None else min(room, st.fixed_k)
        cand = self.lookup.candidate(seq, limit)
        st.candidate = cand
        if not cand.tokens:
            return Offer(reason="no_match")
        if st.fixed_k is not None:
            return Offer(LOOKUP, [1.0] * len(cand.tokens), reason="")
        return Offer(LOOKUP, self.stats.survival(cand.confidence, cand.match_len,
                                                 cand.from_cache, st.fit), reason="")

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

    def _best_prefix(self, survival: list[float], source: str) -> tuple[int, float]:
        """(j, rate): the prefix length of `survival` with the most expected tokens per
        second at this step's batch size, and that rate (0 when there is nothing)."""
        best, best_rate, expected = 0, 0.0, 1.0
        for j, s in enumerate(survival, 1):
            expected += s
            seconds = self.cost.step_time(j) if source == MODEL else \
                self.cost.pass_time(self.cost.batch_size * (j + 1))
            rate = expected / max(seconds, 1e-12)
            if rate > best_rate:
                best, best_rate = j, rate
        return best, best_rate

    def _within_budget(self, offers: list[Offer], batch: int, max_rows: int | None = None
                       ) -> list[int]:
        """Per offer, how many of its slots the step verifies (see the module doc, step 2):
        the prefix of the slots by survival with the most expected tokens per second, kept
        only if what it adds (tokens over seconds) beats the rate without it by the margin;
        and no more than `max_rows` slots of the budget's."""
        counts = [len(o.survival) if o.forced else 0 for o in offers]
        gains = [1.0 + (sum(o.survival) if o.forced else 0.0) for o in offers]  # E per sequence
        value = sum(gains)
        slots = sorted((-s, pos, i) for i, o in enumerate(offers) if not o.forced
                       for pos, s in enumerate(o.survival))
        if max_rows is not None:
            slots = slots[:max_rows]
        base_value, base_time = value, self._step_seconds(offers, counts, batch)
        chosen, best_rate = list(counts), base_value / base_time
        # the most any sequence's expected tokens can reach: once a prefix of the slots is
        # slower than the cap allows for it, every longer prefix is too where a pass over
        # more rows never costs less (a calibrated cost model), so the search stops there
        fair_bound = (1.0 + SLOWDOWN_CAP) * base_time * min(
            (g + sum(o.survival) * (not o.forced) for g, o in zip(gains, offers)), default=1.0
        ) if self.cost.seeded else math.inf
        for neg_s, pos, i in slots:
            assert counts[i] == pos, "slots of one sequence are taken in order"
            counts[i] += 1
            value -= neg_s
            gains[i] -= neg_s
            seconds = self._step_seconds(offers, counts, batch)
            if seconds > fair_bound:
                break
            rate = value / seconds
            added = (value - base_value) / max(seconds - base_time, 1e-12)
            fair = seconds <= (1.0 + SLOWDOWN_CAP) * base_time * min(gains, default=1.0)
            if (rate > best_rate and fair
                    and added > (1.0 + DEFAULT_MARGIN) * base_value / base_time):
                best_rate, chosen = rate, list(counts)
        return self._probe(offers, chosen, slots, batch)

    def _probe(self, offers: list[Offer], chosen: list[int], slots: list, batch: int
               ) -> list[int]:
        """`chosen`, plus one more lookup slot once every `probe_every` steps that left one
        out: the likeliest slot next in line for its sequence; or less the least likely
        slot taken, once every `probe_down_every` steps that took one, where a pass that
        much smaller was not timed lately (see the module doc, step 3)."""
        left_out = [(neg_s, i) for neg_s, pos, i in slots
                    if pos == chosen[i] and offers[i].source == LOOKUP]
        if left_out or any(o.reason == "backed_off" for o in offers):  # (left out unlooked)
            self._left_out += 1
            if left_out and self._left_out >= self.probe_every:
                self._left_out = 0
                self.probes += 1
                chosen = list(chosen)
                chosen[min(left_out)[1]] += 1
                return chosen
        taken = [(neg_s, i) for neg_s, pos, i in slots if pos == chosen[i] - 1]
        if taken:
            self._took += 1
            if (self._took >= self.probe_down_every
                    and self.cost.seen(batch + sum(chosen) - 1) < SEEN_LATELY):
                self._took = 0
                self.probes_down += 1
                chosen = list(chosen)
                chosen[max(taken)[1]] -= 1
        return chosen

    def _step_seconds(self, offers: list[Offer], counts: list[int], batch: int) -> float:
        steps = max((c for o, c in zip(offers, counts) if o.source == MODEL), default=0)
        seconds = self.cost.draft_time(steps) + self.cost.pass_time(batch + sum(counts))
        return max(seconds, 1e-12)

    # ------------------------------------------------------------------ the round
    def propose(self, seqs: list, ks: list[int]) -> list[Proposal]:
        """The drafts of the scheduled sequences (`ks` may be below the plan: a sequence the
        cache could not grow for drafts none), plus any draft-model prefill chunks."""
        proposals = [EMPTY] * len(seqs)
        model_ks = [0] * len(seqs)
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            st = self._seqs[seq.seq_id]
            if k and st.source == LOOKUP:
                proposals[i] = Proposal(st.candidate.tokens[:k], None)
            elif k and st.source == MODEL:
                model_ks[i] = k
        if self.model is not None and (any(model_ks) or self.model.pending()):
            drafted = self.model.propose(seqs, model_ks)
            for i, k in enumerate(model_ks):
                if k:
                    proposals[i] = drafted[i]
        return proposals

    def model_resumed(self, seqs: list, ks: list[int]) -> bool:
        """Whether a draft model drafts this round for a sequence it sat out the last round
        of (its catch-up makes the round's draft time unrepresentative)."""
        return any(k and self._seqs[s.seq_id].source == MODEL and self._seqs[s.seq_id].model_idle
                   for s, k in zip(seqs, ks))

    def model_steps(self, seqs: list, ks: list[int]) -> int:
        """Draft-model steps this round (the longest draft it makes)."""
        return max((k for s, k in zip(seqs, ks) if self._seqs[s.seq_id].source == MODEL),
                   default=0)

    def commit(self, seq, proposal: Proposal, num_accepted: int, old_len: int) -> None:
        """The verifier kept `num_accepted` of the proposal; `seq.token_ids` holds them and
        the recovered or bonus token. Sources and policies learn; metrics are recorded."""
        st = self._seqs[seq.seq_id]
        k = proposal.k
        if self.model is not None:
            self.model.commit(seq, num_accepted, old_len)
        if k and st.source == LOOKUP:
            cand = st.candidate
            self.stats.observe(cand.confidence[:k], cand.match_len, cand.from_cache,
                               num_accepted, st.fit)
        if st.policy is not None:
            st.policy.observe(k if st.source == MODEL else 0, num_accepted)
        st.model_idle = not (k and st.source == MODEL)
        name = (self.source_name if st.source == LOOKUP else MODEL) if k else None
        seq.metrics.record_source(name, k, num_accepted, st.reason)


def build_controller(config, draft_runner=None, target_vocab: int = 0,
                     max_prefill_tokens: int = 256, max_model_len: int = 1 << 30,
                     prefix_caching: bool = True) -> SpeculationController:
    """The controller a SpeculativeConfig asks for: its lookup source (suffix drafting with
    the shared cache of earlier outputs for `hybrid` and `suffix`, prompt lookup for
    `ngram`) and its draft model (for `draft_model`, and `hybrid` with a model), which
    drafts through `draft_runner` with a block manager of its own."""
    lookup, name = None, "suffix"
    if config.method == "ngram":
        lookup, name = NgramDrafter(config.prompt_lookup_max, config.prompt_lookup_min), "ngram"
    elif config.method in ("hybrid", "suffix"):
        cache = SuffixCache(config.suffix_cache_tokens) if config.suffix_cache_tokens else None
        lookup = SuffixDrafter(cache, max_draft=config.max_k)
    model = None
    if config.uses_draft_model:
        model = DraftModelDrafter(draft_runner, draft_runner.block_manager(prefix_caching),
                                  target_vocab, max_prefill_tokens=max_prefill_tokens,
                                  prefill_window=config.prefill_window)
    return SpeculationController(config, CostModel(), lookup, model, name, max_model_len)
