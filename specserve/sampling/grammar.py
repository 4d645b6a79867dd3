"""Structured outputs enforced token by token, on llguidance.

`GrammarCompiler` (one per model vocabulary) compiles a `StructuredOutputsParams` into a
`Grammar` (immutable, cached, shared by sequences and threads); each sequence walks it with
its own `GrammarMatcher` (one thread at a time). A grammar someone still holds (a prepared
request, a running one) is found again for its spec even once the LRU cache has let it go, so
the grammar a request was prepared with is the one it runs with, never compiled a second time.

A mask is bool [vocab_size], True where a token is legal now:
- EOS (the tokenizer's `eos_token_ids`) is legal exactly where the output may end (the only
  legal tokens where it must end), and nowhere else; control tokens, unused vocabulary slots
  and ids past the tokenizer are never legal (`token_bytes`);
- where the next bytes are forced, only their canonical tokenization is legal (llguidance's
  forcing): a model cannot spell forced text with unusual tokens.
`accept(t)` succeeds exactly where the mask allows t. After EOS is accepted the matcher is
terminated: only EOS is legal (so a mask is never empty), and rolling the EOS back resumes.

Speculative decoding: `masks(drafts)` gives the masks at the verify positions (the state
after each legal prefix of the drafts) and leaves the state as it was; the engine then
`accept`s the accepted tokens. `forced(limit)` gives the tokens the grammar alone
determines next: drafts that the masked target always accepts.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict

import numpy as np
import torch
from llguidance import LLMatcher, LLParserLimits, LLTokenizer, TokenizerWrapper

from specserve.models.tokenizer import Tokenizer
from specserve.sampling.grammar_source import grammar_text
from specserve.sampling.structured import StructuredOutputsParams
from specserve.sampling.token_bytes import token_bytes

MAX_ERROR_CHARS = 400
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[.*?\])")


class GrammarError(ValueError):
    """A grammar cannot go on (it exceeded llguidance's per-step limits, or no token can
    continue the output): the request must end with this error."""


class GrammarCompiler:
    """Compiles structured-output specs for one vocabulary. `vocab_size` is the model's logits
    width (at least the tokenizer's vocabulary). Building it reads every token's bytes and
    builds llguidance's token trie, which takes long for a large vocabulary: build it off a
    request's clock. Thread-safe."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 64):
        table = token_bytes(tokenizer, vocab_size)
        eos = sorted(i for i in tokenizer.eos_token_ids if i < vocab_size)
        if not eos:
            raise ValueError("the tokenizer has no EOS token: a constrained output could not end")
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        tokenizer.prepare()  # forced text is tokenized with special tokens read as text
        self._vocabulary = LLTokenizer(TokenizerWrapper(_Vocabulary(tokenizer, table, eos[0])),
                                       n_vocab=vocab_size, eos_token=eos)
        self._eos_only = _packed_of(eos, vocab_size)  # [words]
        self._limits = LLParserLimits(verbose_errors=False)
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._live: weakref.WeakValueDictionary[str, Grammar] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self.compiled = 0  # grammars built (cache misses)

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        """The compiled grammar of `spec`: the same object for the same `spec.key()` while it
        stays in the LRU cache or anyone holds it. ValueError naming the field where `spec`
        cannot be enforced: a schema keyword the engine does not support, an invalid or too
        large regex, a grammar over llguidance's limits."""
        key = spec.key()
        with self._lock:
            if (grammar := self._cache.get(key) or self._live.get(key)) is not None:
                self._keep(key, grammar)
                return grammar
        grammar = self._build(spec)
        with self._lock:
            self.compiled += 1
            grammar = self._cache.get(key) or self._live.setdefault(key, grammar)
            self._keep(key, grammar)
        return grammar

    def _keep(self, key: str, grammar: Grammar) -> None:
        """Make `grammar` the cache's most recent entry (under the lock)."""
        self._cache[key] = grammar
        self._cache.move_to_end(key)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def _build(self, spec: StructuredOutputsParams) -> Grammar:
        field = f"structured_outputs.{spec.kind}"
        try:
            text = grammar_text(spec)
        except ValueError as e:
            message = str(e)
            raise ValueError(message if message.startswith(field) else f"{field}: {message}") \
                from None
        template = LLMatcher(self._vocabulary, text, log_level=0, limits=self._limits)
        if not template.is_error():
            template.compute_bitmask()  # the first mask: its lexer states are built now
        if template.is_error():
            error = template.get_error()
            if (keys := _UNIMPLEMENTED.search(error)) is not None:
                raise ValueError(f"{field} uses JSON Schema keywords the engine cannot enforce: "
                                 f"{', '.join(json.loads(keys.group(1)))}")
            raise ValueError(f"{field} cannot be enforced: {_error_text(error)}")
        return Grammar(template, self.vocab_size, self._eos_only)


class LazyGrammarCompiler:
    """A `GrammarCompiler` built on first use (or ahead of it by `warm()`, e.g. on a thread
    of a server's), since building one for a large vocabulary takes seconds. Thread-safe."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._args = (tokenizer, vocab_size)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def warm(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(*self._args)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        return (self._compiler or self.warm()).compile(spec)


class Grammar:
    """A compiled grammar: immutable, shared by the sequences that use it, thread-safe."""

    def __init__(self, template: LLMatcher, vocab_size: int, eos_only: np.ndarray):
        self._template = template
        self._vocab_size = vocab_size
        self._eos_only = eos_only
        self._lock = threading.Lock()

    def matcher(self) -> GrammarMatcher:
        """A matcher at the start of the output."""
        with self._lock:
            copy = self._template.deep_copy()
        return GrammarMatcher(copy, self._vocab_size, self._eos_only)


class GrammarMatcher:
    """One sequence's place in a grammar; used from one thread at a time."""

    def __init__(self, matcher: LLMatcher, vocab_size: int, eos_only: np.ndarray):
        self._m = matcher
        self._vocab_size = vocab_size
        self._eos_only = eos_only  # [words] read-only: the mask once terminated
        self._eos = frozenset(np.flatnonzero(_unpack(eos_only[None], vocab_size)[0]).tolist())
        self._eos_steps = 0  # EOS tokens accepted (the first terminates)
        self._packed: np.ndarray | None = None  # [words] the current state's mask, once computed

    @property
    def is_terminated(self) -> bool:
        """EOS was accepted."""
        return self._eos_steps > 0

    @property
    def can_terminate(self) -> bool:
        """EOS is legal now (the output so far is complete)."""
        return self.is_terminated or self._m.is_accepting()

    def allowed(self) -> torch.Tensor:
        """bool [vocab_size]: the tokens legal now."""
        return torch.from_numpy(_unpack(self._mask()[None], self._vocab_size)[0])

    def accept(self, token: int) -> bool:
        """Advance by `token`; False, and the state unchanged, where it is not legal."""
        if not 0 <= token < self._vocab_size or not _has(self._mask(), token):
            return False
        if token in self._eos:
            self._eos_steps += 1
        else:
            consumed = self._m.try_consume_tokens([token])
            assert consumed == 1, self._m.get_error()
        self._packed = None
        return True

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens (any n up to the number accepted)."""
        if n <= 0:
            return
        undo_eos = min(n, self._eos_steps)
        self._eos_steps -= undo_eos
        if n > undo_eos and not self._m.rollback(n - undo_eos):
            raise ValueError(f"cannot roll back {n} tokens: {_error_text(self._m.get_error())}")
        self._packed = None

    def masks(self, drafts: list[int]) -> tuple[torch.Tensor, int]:
        """(bool [m, vocab_size], legal): row i is the mask after `drafts[:i]`; `legal` is the
        number of leading drafts that are legal and m = legal + 1. The state is unchanged."""
        start = self._mask()
        rows = np.empty((len(drafts) + 1, start.size), np.uint32)  # [k + 1, words]
        rows[0] = start
        legal = 0
        for token in drafts:
            if not self.accept(token):
                break
            legal += 1
            rows[legal] = self._mask()
        self.rollback(legal)
        self._packed = start
        return torch.from_numpy(_unpack(rows[:legal + 1], self._vocab_size)), legal

    def legal_prefix(self, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar accepts in sequence; the state unchanged."""
        start, legal = self._packed, 0
        for token in tokens:
            if not self.accept(token):
                break
            legal += 1
        self.rollback(legal)
        self._packed = start
        return legal

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar alone determines next, the state unchanged: the
        canonical tokens of forced text (llguidance's fast-forward tokens) and tokens that are
        the only legal one (EOS included, which ends the list)."""
        start, out = self._packed, []
        while len(out) < limit and not self.is_terminated:
            ahead = self._m.compute_ff_tokens()[:limit - len(out)]
            if ahead:
                taken = self._m.try_consume_tokens(ahead)
                out += ahead[:taken]
                self._packed = None
                if taken == len(ahead):
                    continue
            only = _single(self._mask())
            if only is None or not self.accept(only):
                break
            out.append(only)
        self.rollback(len(out))
        self._packed = start
        return out

    def _mask(self) -> np.ndarray:
        """[words] uint32: the current state's packed mask (bit t of word t // 32: token t)."""
        if self._packed is None:
            if self.is_terminated:
                self._packed = self._eos_only
            else:
                self._packed = self._compute()
        return self._packed

    def _compute(self) -> np.ndarray:
        packed = np.zeros(self._eos_only.size, np.uint32)  # [words]
        self._m.unsafe_compute_mask_ptr(packed.ctypes.data, packed.nbytes)
        if self._m.is_error():
            raise GrammarError(f"structured output cannot go on: "
                               f"{_error_text(self._m.get_error())}")
        if not packed.any():
            raise GrammarError("structured output cannot go on: no token can continue it")
        return packed


class _Vocabulary:
    """What llguidance's `TokenizerWrapper` reads: each token's bytes (b"" for the ids never
    emitted, which it takes as special), and the encoder that tokenizes forced text."""

    def __init__(self, tokenizer: Tokenizer, table: list[bytes | None], eos: int):
        self.tokens = [b if b is not None else b"" for b in table]
        self.special_token_ids = [i for i, b in enumerate(table) if b is None]
        self.eos_token_id = eos
        self.bos_token_id = tokenizer.bos_token_id
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text only")  # tells TokenizerWrapper to pass str, not bytes
        ids = self._tokenizer.encode(text, parse_special=False)
        bos = self._tokenizer.bos_token_id
        return ids[1:] if self._tokenizer.add_bos and ids[:1] == [bos] else ids


def _packed_of(ids: list[int], vocab_size: int) -> np.ndarray:
    packed = np.zeros((vocab_size + 31) // 32, np.uint32)  # [words]
    for i in ids:
        packed[i >> 5] |= np.uint32(1 << (i & 31))
    return packed


def _has(packed: np.ndarray, token: int) -> bool:
    return bool((int(packed[token >> 5]) >> (token & 31)) & 1)


def _single(packed: np.ndarray) -> int | None:
    """The only token a mask allows, or None."""
    words = np.flatnonzero(packed)
    if words.size != 1:
        return None
    word = int(packed[words[0]])
    return int(words[0]) * 32 + word.bit_length() - 1 if word & (word - 1) == 0 else None


def _unpack(rows: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool [m, vocab_size] of packed masks [m, words]."""
    little = rows.astype("<u4", copy=False).view(np.uint8)  # [m, 4 * words]
    return np.unpackbits(little, axis=1, count=vocab_size, bitorder="little").view(np.bool_)


def _error_text(message: str) -> str:
    message = message.replace("\n<non-verbose/>", "").strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + "..."
