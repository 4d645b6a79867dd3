"""A model, its paged KV pools and their block manager: runs batched passes over ragged rows."""

from __future__ import annotations

from pathlib import Path

import torch

from specserve.engine.block_manager import BlockManager, BlockTable
from specserve.models.hybrid import pick_logits
from specserve.models.kv_cache import DEFAULT_BLOCK_SIZE
from specserve.models.prefill import NATIVE, PrefillChoice, PrefillPath
from specserve.models.transformer import ForwardBatch


class ModelRunner:
    """`model` is a `Transformer` (or anything with `cfg.vocab_size`, `new_pool` and
    `forward(ForwardBatch, cache, last_n)`) and its KV pools of `num_blocks` blocks of
    `kv_dtype` (None: the model's default). It runs passes over the blocks it is given: who
    holds which block is the business of a `BlockManager` (the scheduler's for the target,
    the draft-model drafter's for the draft)."""

    def __init__(self, model, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 kv_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.num_blocks, self.block_size = num_blocks, block_size
        self.cache = model.new_pool(num_blocks, block_size) if kv_dtype is None \
            else model.new_pool(num_blocks, block_size, dtype=kv_dtype)
        self.head = None  # a head of its own for the model's passes (a restricted draft head)
        self.prefill: PrefillChoice = NATIVE  # what its prompt rows run on (`use_prefill`)
        self._path: PrefillPath | None = None  # the path's dense weights

    def use_prefill(self, choice: PrefillChoice) -> None:
        """Send the prompt rows of this runner's passes through `choice`
        (`models/prefill.py`), making the dense weights it names."""
        self._path = PrefillPath.build(choice, self.model.layers, self.model.dense_weights) \
            if choice.active else None
        self.prefill = choice

    @property
    def prefill_bytes(self) -> int:
        """Bytes of the prefill path's dense weights."""
        return self._path.nbytes if self._path is not None else 0

    def _pass_args(self, batch: ForwardBatch) -> dict:
        """The model's optional pass arguments: its own head, the prefill path for prompt rows
        (only named where set: models without a prefill path take no such argument)."""
        args = {} if self.head is None else {"head": self.head}
        if self._path is not None and batch.prefill:
            args["prefill"] = self._path
        return args

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes in this runner's pools (keys and values, every layer)."""
        return self.cache.block_bytes

    @property
    def recurrent(self) -> bool:
        """Whether the model keeps per-sequence recurrent state besides its KV blocks."""
        return bool(getattr(self.model, "recurrent", False))

    def block_manager(self, prefix_caching: bool = True) -> BlockManager:
        """A new block manager for this runner's pools (its owner keeps it). For a model with
        recurrent state, prefix caching is off (KV blocks cannot restore that state) and a
        freed table frees the sequence's state."""
        if not self.recurrent:
            return BlockManager(self.num_blocks, self.block_size, prefix_caching)
        return BlockManager(self.num_blocks, self.block_size, False, self.cache.release)

    def forward(self, rows: list[list[int]], starts: list[int], tables: list[BlockTable],
                last_n: list[int] | None = None, prefill: list[int] | None = None
                ) -> list[torch.Tensor]:
        """Feed `rows[i]` at positions `starts[i]...` of the sequence holding `tables[i]` (its
        blocks must reach those positions), the first `prefill[i]` of them prompt rows (the
        model's prefill path takes them; default none); returns float32 logits `[last_n[i]
        (default len(rows[i])), vocab]` per row."""
        batch = ForwardBatch.paged(rows, starts, [t.blocks for t in tables], tables, prefill)
        with torch.inference_mode():
            return self.model.forward(batch, self.cache, last_n, **self._pass_args(batch))

    def forward_hidden(self, rows: list[list[int]], starts: list[int], tables: list[BlockTable],
                       last_n: list[int] | None = None, prefill: list[int] | None = None
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """As `forward`, and the final normalised hidden states `[len(rows[i]), hidden]` of
        every row (what a model's own multi-token-prediction head drafts from)."""
        batch = ForwardBatch.paged(rows, starts, [t.blocks for t in tables], tables, prefill)
        with torch.inference_mode():
            path = self._pass_args(batch).get("prefill")
            hidden = self.model.hidden_states(batch, self.cache) if path is None \
                else self.model.hidden_states(batch, self.cache, path)  # [total rows, hidden]
            logits = pick_logits(self.model, hidden, batch.lengths, last_n, self.head)
        return logits, list(hidden.split(batch.lengths))


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


def kv_positions(target, draft, kv_cache_memory: int | None, block_size: int,
                 kv_cache_dtype: str = "auto") -> int:
    """Positions the KV budget holds for the target and the draft together (None: the default
    from available RAM), counted in whole blocks: the longest sequence it could hold alone."""
    memory = kv_cache_memory if kv_cache_memory is not None else default_kv_cache_memory()
    per_token = target.kv_bytes_per_token(target.kv_cache_dtype(kv_cache_dtype)) + (
        draft.kv_bytes_per_token(draft.kv_cache_dtype(kv_cache_dtype)) if draft else 0)
    return memory // (per_token * block_size) * block_size


def build_runners(target, draft, kv_cache_memory: int | None, block_size: int,
                  min_tokens: int, kv_cache_dtype: str = "auto"
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
    runner = ModelRunner(target, num_blocks, block_size, target_dtype)
    draft_runner = ModelRunner(draft, num_blocks, block_size, draft_dtype) if draft else None
    return runner, draft_runner
