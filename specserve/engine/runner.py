"""A model, its paged KV pools and their block manager: runs batched passes over ragged rows."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from contextlib import contextmanager
from functools import partial
from typing import Callable, Hashable

import torch

from specserve.engine.block_manager import BlockManager, BlockTable
from specserve.models.kv_cache import DEFAULT_BLOCK_SIZE
from specserve.models.transformer import ForwardBatch


class ModelRunner:
    """`model` is a `Transformer` (or anything with `cfg.vocab_size`, `new_pool` and
    `forward(ForwardBatch, cache, last_n)`). It owns `num_blocks` blocks of KV cache, of
    `kv_dtype` (None: the model's default)."""

    def __init__(self, model, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 prefix_caching: bool = True, kv_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.cache = model.new_pool(num_blocks, block_size) if kv_dtype is None \
            else model.new_pool(num_blocks, block_size, dtype=kv_dtype)
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    # the block protocol the engine and the draft model use (see draft_model.PagedRunner)
    def new_table(self) -> BlockTable:
        return BlockTable()

    def reserve(self, table: BlockTable, num_tokens: int) -> bool:
        return self.blocks.reserve(table, num_tokens)

    def free(self, table: BlockTable) -> None:
        self.blocks.free(table)

    def match_prefix(self, table: BlockTable, tokens: list[int], max_tokens: int) -> int:
        return self.blocks.match_prefix(table, tokens, max_tokens)

    def register(self, table: BlockTable, tokens: list[int], num_committed: int) -> None:
        self.blocks.register(table, tokens, num_committed)

    def forward(self, rows: list[list[int]], starts: list[int], tables: list[BlockTable],
                last_n: list[int] | None = None) -> list[torch.Tensor]:
        """Feed `rows[i]` at positions `starts[i]...` of the sequence holding `tables[i]` (its
        blocks must reach those positions); returns float32 logits `[last_n[i] (default
        len(rows[i])), vocab]` per row."""
        batch = ForwardBatch.paged(rows, starts, [t.blocks for t in tables])
        with torch.inference_mode():
            return self.model.forward(batch, self.cache, last_n)

    def time_passes(self, ks: list[int], prefix_len: int = 256, repeats: int = 5) -> dict[int, float]:
        """Median seconds of a pass over k + 1 rows after a cached prefix of `prefix_len`
        tokens, for each k in `ks` (k = 0 is a decode step). The ks are timed in turn, round
        after round, so a machine that drifts meanwhile skews them alike."""
        with self.pass_timer(prefix_len) as time_pass:
            return median_round_robin({k: partial(time_pass, k) for k in ks}, repeats)

    @contextmanager
    def pass_timer(self, prefix_len: int, max_rows: int = 64):
        """A function k → seconds of one pass over k + 1 random rows after a cached random
        prefix of `prefix_len` tokens (each pass rewrites the same positions; the first pass
        of each k is an untimed warm-up). Holds the blocks of one sequence of `prefix_len +
        max_rows` positions while open."""
        vocab = self.model.cfg.vocab_size
        g = torch.Generator().manual_seed(0)
        prefix = torch.randint(0, vocab, (prefix_len,), generator=g).tolist()
        table = BlockTable()
        if not self.reserve(table, prefix_len + max_rows):
            raise RuntimeError("the KV cache has no room for a timing pass")
        rows: dict[int, list[list[int]]] = {}

        def time_pass(k: int) -> float:
            if k not in rows:
                rows[k] = [torch.randint(0, vocab, (k + 1,), generator=g).tolist()]
                self.forward(rows[k], [prefix_len], [table])  # warm-up
            start = time.perf_counter()
            self.forward(rows[k], [prefix_len], [table])
            return time.perf_counter() - start

        try:
            self.forward([prefix], [0], [table], [1])
            yield time_pass
        finally:
            self.free(table)


DEFAULT_KV_FRACTION = 0.4  # of the memory available when the engine starts
DEFAULT_KV_CAP = 4 << 30  # bytes: 52k positions of the default 1.5B + 0.5B pair


def default_kv_cache_memory(meminfo: Path = Path("/proc/meminfo")) -> int:
    """The default KV budget: 40% of MemAvailable, at most 4 GiB (2 GiB when it cannot be
    read). The pools are mapped lazily, so a budget costs resident memory only as blocks fill
    (held, or kept by the prefix cache)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                return min(int(available * DEFAULT_KV_FRACTION), DEFAULT_KV_CAP)
    except (OSError, ValueError, IndexError):
        pass
    return 2 << 30


def build_runners(target, draft, kv_cache_memory: int | None, block_size: int,
                  min_tokens: int, prefix_caching: bool = True, kv_cache_dtype: str = "auto"
                  ) -> tuple[ModelRunner, ModelRunner | None]:
    """The target's runner and the draft's (None without a draft model), with the same
    number of blocks each, as many as `kv_cache_memory` bytes hold for both (None: the
    default from available RAM) in the dtype `kv_cache_dtype` gives each model (see
    `Transformer.kv_cache_dtype`). The budget must hold at least one sequence of `min_tokens`
    positions (max_model_len plus a round's drafts)."""
    memory = kv_cache_memory if kv_cache_memory is not None else default_kv_cache_memory()
    target_dtype = target.kv_cache_dtype(kv_cache_dtype)
    draft_dtype = draft.kv_cache_dtype(kv_cache_dtype) if draft else None
    per_token = target.kv_bytes_per_token(target_dtype) + (
        draft.kv_bytes_per_token(draft_dtype) if draft else 0)
    num_blocks = memory // (per_token * block_size)
    needed = -(-min_tokens // block_size)
    if num_blocks < needed:
        if kv_cache_memory is not None:
            raise ValueError(f"kv_cache_memory of {kv_cache_memory} bytes holds {num_blocks} "
                             f"blocks of {block_size} positions; one max_model_len sequence "
                             f"needs {needed} ({needed * block_size * per_token} bytes)")
        num_blocks = needed  # a machine short of memory still serves one sequence
    runner = ModelRunner(target, num_blocks, block_size, prefix_caching, target_dtype)
    draft_runner = ModelRunner(draft, num_blocks, block_size, prefix_caching,
                               draft_dtype) if draft else None
    return runner, draft_runner


def median_round_robin(timers: dict[Hashable, Callable[[], float]], repeats: int
                       ) -> dict[Hashable, float]:
    """Median of `repeats` calls of each timer (a function returning seconds), called in turn
    round after round, so a machine that drifts meanwhile skews them alike."""
    samples: dict[Hashable, list[float]] = {key: [] for key in timers}
    for _ in range(repeats):
        for key, timer in timers.items():
            samples[key].append(timer())
    return {key: statistics.median(v) for key, v in samples.items()}
