"""Suffix drafting: continue the text the way earlier copies of its last tokens continued, in
this request (prompt + output so far, and views of its prompt such as the prompt escaped as a
JSON string) and in the outputs of earlier requests (`SuffixCache`, bounded, LRU).

Contract: `candidate(seq, limit, extra)` returns the voted continuation of the longest
earlier match of the context's end (context: the sequence's tokens, then `extra`), with each
position's share of the votes as its confidence; deterministic (one-hot) drafts. How much of
it is verified is the controller's choice. E.g. context [a b c d x a b c], no cache: the
longest earlier suffix is [a b c]; the draft is [d x a b c][:limit], every confidence 1.
Why it is built this way: docs/design.md, "Suffix drafting".
"""

from __future__ import annotations

import json
from collections import Counter, OrderedDict
from collections.abc import Iterator

import numpy as np

from specserve.speculative.candidate import NO_CANDIDATE, Candidate, TokenBuffer
from specserve.speculative.drafter import BuildContext, Drafter

DEFAULT_MAX_MATCH = 32  # longest context suffix matched (longer matches are not told apart)
DEFAULT_MAX_DRAFT = 16  # longest draft proposed
DEFAULT_MIN_CONFIDENCE = 0.1  # a draft stops where the product of its confidences falls below
DEFAULT_CACHE_TOKENS = 1 << 18  # output tokens the shared cache keeps (about 65 MB)
KEY_LEN = 3  # tokens of the cache's longest index keys (every gram of 1..KEY_LEN is a key)
MAX_ENDS_PER_KEY = 8  # most recent ends kept per index key
END_BITS = 32  # an index entry is one int, doc id << END_BITS | end (a tuple costs 3 objects)
MAX_CANDIDATES = 16  # occurrences that vote, most recent first
PROMPT_CONTEXT = 16  # prompt tokens kept before each cached output, to match its start
MAX_VIEW_TOKENS = 8192  # prompts longer than this get no view (its tokenization would hold
# up the engine's step for milliseconds)




class SuffixCache:
    """Earlier requests' outputs, bounded by `max_tokens`, shared by every sequence.

    `docs` maps a document id to its tokens (int64 array), least recently used first; `index`
    maps each n-gram (n = `min_key`..`KEY_LEN`) to up to `MAX_ENDS_PER_KEY` entries (doc id,
    end position: `entries`), newest last, so it holds at most `KEY_LEN` per kept token.
    Evicting a document drops its entries, and a key whose entries all went.
    """

    def __init__(self, max_tokens: int = DEFAULT_CACHE_TOKENS, min_key: int = 1) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        if not 1 <= min_key <= KEY_LEN:
            raise ValueError(f"min_key must be in [1, {KEY_LEN}], got {min_key}")
        self.max_tokens, self.min_key = max_tokens, min_key
        self.docs: OrderedDict[int, np.ndarray] = OrderedDict()
        self.index: dict[tuple[int, ...], list[int]] = {}
        self.num_tokens = 0
        self._next_id = 0
        self._leads: dict[int, int] = {}  # doc id → its lead

    def clear(self) -> None:
        """Forget every output (a benchmark's calls each start from an empty cache)."""
        self.docs.clear()
        self.index.clear()
        self._leads.clear()
        self.num_tokens = 0

    def add(self, tokens: list[int], lead: int = 0) -> None:
        """Keep `tokens` (a finished output, after `lead` tokens of context that are matched
        but never continued into); evict the least recently used past the bound."""
        if not 0 <= lead <= len(tokens):
            raise ValueError(f"lead must be in [0, {len(tokens)}], got {lead}")
        if len(tokens) == lead or len(tokens) <= KEY_LEN or len(tokens) > self.max_tokens:
            return
        doc, arr = self._next_id, np.asarray(tokens, dtype=np.int64)
        self._next_id += 1
        self.docs[doc] = arr
        self._leads[doc] = lead
        self.num_tokens += len(arr)
        for key, end in _keys(tokens, lead, self.min_key):
            ends = self.index.setdefault(key, [])
            ends.append(doc << END_BITS | end)
            if len(ends) > MAX_ENDS_PER_KEY:
                del ends[0]
        while self.num_tokens > self.max_tokens:
            self._evict()

    def _evict(self) -> None:
        """Drop the least recently used document and its index entries."""
        doc, arr = self.docs.popitem(last=False)
        self.num_tokens -= len(arr)
        for key, _ in _keys(arr.tolist(), self._leads.pop(doc), self.min_key):
            ends = self.index.get(key)
            if ends is None:
                continue
            ends[:] = [e for e in ends if _split(e)[0] != doc]
            if not ends:
                del self.index[key]

    def entries(self) -> Iterator[tuple[int, int]]:
        """Every index entry as (doc id, end)."""
        for ends in self.index.values():
            for e in ends:
                yield _split(e)

    def occurrences(self, context: np.ndarray, max_match: int, min_key: int = KEY_LEN
                    ) -> list[tuple[int, np.ndarray, int]]:
        """(match length, document, end) of the cached occurrences of the context's last
        `KEY_LEN` tokens, most recent first, each extended backwards up to `max_match`; where
        there are none, of its last `KEY_LEN` − 1 tokens, and so on down to `min_key`."""
        ends = None
        for n in range(min(KEY_LEN, len(context)), max(min_key, self.min_key) - 1, -1):
            ends = self.index.get(tuple(context[-n:].tolist()))
            if ends:
                break
        if not ends:
            return []
        found = []
        for e in reversed(ends):
            doc, end = _split(e)
            arr = self.docs[doc]
            self.docs.move_to_end(doc)  # used: the last to be evicted
            found.append((_match_back(context, arr, end, max_match), arr, end))
        return found


def _split(entry: int) -> tuple[int, int]:
    """An index entry's (doc id, end)."""
    return entry >> END_BITS, entry & ((1 << END_BITS) - 1)


def _keys(tokens: list[int], lead: int, min_key: int) -> Iterator[tuple[tuple[int, ...], int]]:
    """A document's (key, end) pairs: every n-gram (n = `min_key`..`KEY_LEN`) that ends where
    an output token follows it (so not inside the lead)."""
    for end in range(max(min_key - 1, lead - 1), len(tokens) - 1):
        for n in range(min_key, min(KEY_LEN, end + 1) + 1):
            yield tuple(tokens[end - n + 1:end + 1]), end


def _match_back(context: np.ndarray, arr: np.ndarray, end: int, max_match: int) -> int:
    """How many trailing context tokens equal `arr[..end]` (at most `max_match`)."""
    n = min(max_match, len(context), end + 1)
    tail, there = context[len(context) - n:], arr[end + 1 - n:end + 1]
    differ = np.flatnonzero(tail[::-1] != there[::-1])
    return int(differ[0]) if differ.size else n


def _self_matches(arr: np.ndarray, max_match: int) -> tuple[int, np.ndarray]:
    """(n, ends): the longest n ≤ `max_match` such that the last n tokens also end at earlier
    positions, and those ends (ascending; every end has a token after it). (0, []) if none."""
    length = arr.shape[0]
    if length < 2:
        return 0, np.empty(0, dtype=np.int64)
    match = arr[:length - 1] == arr[length - 1]  # [length - 1] an occurrence ending at i
    best_n, best = 0, match
    for n in range(1, min(max_match, length - 1) + 1):
        if n > 1:  # [length - n] ends n - 1..length - 2
            match = match[1:] & (arr[:length - n] == arr[length - n])
        if not match.any():
            break
        best_n, best = n, match
    if best_n == 0:
        return 0, np.empty(0, dtype=np.int64)
    return best_n, np.flatnonzero(best) + best_n - 1


def vote(continuations: list[np.ndarray], max_draft: int, min_confidence: float
         ) -> tuple[list[int], list[float]]:
    """The voted draft over `continuations` (most recent first) and each position's share."""
    alive = [c[:max_draft].tolist() for c in continuations]  # lists: a vote reads each once
    tokens: list[int] = []
    confidence: list[float] = []
    reach = 1.0
    for i in range(max_draft):
        alive = [c for c in alive if len(c) > i]
        if not alive:
            break
        column = [c[i] for c in alive]
        token, top = column[0], column.count(column[0])
        contested = top < len(column)
        if contested:  # the most votes, ties to the most recent
            counts = Counter(column)
            top = max(counts.values())
            token = next(t for t in column if counts[t] == top)
        share = top / len(alive)
        reach *= share
        if reach < min_confidence:
            break
        tokens.append(token)
        confidence.append(share)
        if contested:
            alive = [c for c in alive if c[i] == token]
    return tokens, confidence


def escaped_view(tokenizer, prompt_ids: list[int]) -> list[int] | None:
    """The prompt's text as the body of a JSON string, tokenized: what a tool call quoting
    the prompt writes. None where escaping changes nothing or the prompt is too long."""
    if len(prompt_ids) > MAX_VIEW_TOKENS:
        return None
    text = tokenizer.decode(prompt_ids)
    escaped = json.dumps(text, ensure_ascii=False)[1:-1]
    if escaped == text:
        return None
    return tokenizer.encode(escaped, parse_special=False)


class SuffixDrafter(Drafter):
    """Per-sequence token buffers plus the shared `SuffixCache` (None: this request only).

    `candidate(seq)` is the voted draft for the sequence's current context; the engine's
    controller decides how much of it to verify. `finish(seq)` gives the sequence's output to
    the shared cache."""

    name = "suffix"

    def __init__(self, cache: SuffixCache | None = None, max_match: int = DEFAULT_MAX_MATCH,
                 max_draft: int = DEFAULT_MAX_DRAFT,
                 min_confidence: float = DEFAULT_MIN_CONFIDENCE, min_match: int = 1) -> None:
        for name, value in (("max_match", max_match), ("max_draft", max_draft),
                            ("min_match", min_match)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], got {min_confidence}")
        self.cache, self.max_match, self.max_draft = cache, max_match, max_draft
        self.min_confidence, self.min_match = min_confidence, min_match
        self._buffers: dict[int, TokenBuffer] = {}
        self._views: dict[int, SuffixCache] = {}  # seq id → its prompt's views

    @classmethod
    def build(cls, config, ctx: BuildContext) -> SuffixDrafter:
        """With the shared cache of earlier outputs where `suffix_cache_tokens` keeps any."""
        cache = SuffixCache(config.suffix_cache_tokens) if config.suffix_cache_tokens else None
        return cls(cache, max_draft=config.max_k)

    def join(self, seqs: list, tokenizer=None) -> None:
        """A request's sequences may copy its prompt escaped as a JSON string
        (`escaped_view`, with `tokenizer`)."""
        view = escaped_view(tokenizer, seqs[0].prompt_ids) if tokenizer is not None else None
        for seq in seqs if view else ():
            self.add_view(seq, view)

    def clear(self) -> None:
        if self.cache is not None:
            self.cache.clear()

    def add_view(self, seq, tokens: list[int]) -> None:
        """Another rendering of the sequence's prompt that its output may copy."""
        view = self._views.setdefault(seq.seq_id, SuffixCache(1 << 30, min_key=KEY_LEN))
        view.add(tokens)

    def candidate(self, seq, max_draft: int | None = None, extra: list[int] = ()) -> Candidate:
        """The voted draft following `seq.token_ids` and then `extra` (tokens the round
        drafts before it), at most `max_draft` tokens."""
        limit = self.max_draft if max_draft is None else min(max_draft, self.max_draft)
        if limit <= 0:
            return NO_CANDIDATE
        arr = self._buffers.setdefault(seq.seq_id, TokenBuffer()).sync(seq.token_ids)
        if extra:
            arr = np.concatenate([arr, np.asarray(extra, dtype=np.int64)])
        n, ends = _self_matches(arr, self.max_match)
        voters = [(n, arr, int(e)) for e in ends[::-1][:MAX_CANDIDATES]]
        view = self._views.get(seq.seq_id)
        viewed = view.occurrences(arr, self.max_match) if view is not None else []
        own = max([n] + [m for m, _, _ in viewed])
        # a match shorter than a whole key only where it beats the request's own text
        cached = [] if self.cache is None else self.cache.occurrences(
            arr, self.max_match, min_key=min(own + 1, KEY_LEN))
        best = max([own] + [m for m, _, _ in cached])
        if best < self.min_match:
            return NO_CANDIDATE
        voters = [v for v in voters + viewed if v[0] == best]
        from_cache = [v for v in cached if v[0] == best]
        pool = (voters + from_cache)[:MAX_CANDIDATES]
        continuations = [src[end + 1:end + 1 + limit] for _, src, end in pool]
        tokens, confidence = vote(continuations, limit, self.min_confidence)
        if not tokens:
            return NO_CANDIDATE
        return Candidate(tokens, confidence, best, bool(from_cache))

    def finish(self, seq, keep: bool = True) -> None:
        """The sequence left: its buffer goes, and (if `keep`) its output joins the cache."""
        self._buffers.pop(seq.seq_id, None)
        self._views.pop(seq.seq_id, None)
        if keep and self.cache is not None:
            lead = min(PROMPT_CONTEXT, seq.prompt_len)
            self.cache.add(seq.token_ids[seq.prompt_len - lead:], lead)
