"""`EngineConfig`: the engine's sizes and budgets, each declared once as an option (see
`specserve.options`), validated in `__post_init__` with a `ValueError` naming the field.

`max_model_len`: None takes the model's trained context, bounded by the KV budget (see
`LLM`): the budget limits how many sequences run at once, not how long one may be.
`max_num_batched_tokens`: target rows per step (decode and verify rows always run; prefill
chunks fill the rest). On a CPU a pass is compute-bound from a few rows on (the native kernels
take rows four at a time), so bigger chunks barely raise prefill throughput while every running
stream waits for the whole chunk. `kv_cache_memory`: bytes for the KV caches of the target and
the draft together (None: `default_kv_cache_memory()`). `kv_cache_dtype`: "auto" (float16 for
models on the native glue, the activations' dtype elsewhere), "float32", "float16" or
"bfloat16", for the target's and the draft's caches. `prefill_path`: see
`engine/prefill_choice.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.models.kv_cache import DEFAULT_BLOCK_SIZE, KV_CACHE_DTYPES, check_kv_cache_dtype
from specserve.engine.prefill_choice import PREFILL_PATHS
from specserve.options import option, parse_size
from specserve.sampling.params import require_bool, require_int


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_num_seqs: int = option(8, "requests decoded together")
    max_model_len: int | None = option(
        None, "context length (prompt + output); default: the model's trained context, bounded "
        "by what the KV cache budget holds for one sequence")
    max_num_batched_tokens: int = option(
        256, "token budget per engine step (prefill chunks + decode rows)")
    kv_cache_memory: int | None = option(
        None, "KV cache budget, e.g. 2GiB (default: from available RAM)", parse=parse_size)
    block_size: int = option(DEFAULT_BLOCK_SIZE, "tokens per KV block", cli=False)
    enable_prefix_caching: bool = option(
        True, "reuse the KV blocks of a prompt prefix already computed", flag="--prefix-caching")
    kv_cache_dtype: str = option("auto", "KV cache dtype (auto: float16 on the native kernels, "
                                 "else the activations' dtype)", choices=KV_CACHE_DTYPES)
    prefill_path: str = option(
        "auto", "where prompt rows' projections and attention run: auto (timed at start-up on "
        "this machine: oneDNN's bf16 matmul and flash attention where faster than the int4 "
        "kernels, with bf16 copies of those weights), onednn (forced), native (int4 only)",
        choices=PREFILL_PATHS)
    trace_steps: str | None = option(
        None, "append one JSON line per engine step to this file: batch, drafts per sequence "
        "and their source, tokens gained, seconds, the cost model's prediction (diagnosis)")

    def __post_init__(self) -> None:
        require_int("max_num_seqs", self.max_num_seqs, minimum=1)
        if self.max_model_len is not None:
            require_int("max_model_len", self.max_model_len, minimum=2)
        require_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1)
        if self.kv_cache_memory is not None:
            memory = require_int("kv_cache_memory", self.kv_cache_memory)
            if memory <= 0:
                raise ValueError(f"kv_cache_memory must be > 0 bytes (or None: from available "
                                 f"RAM), got {memory}")
        require_int("block_size", self.block_size, minimum=1)
        require_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.prefill_path not in PREFILL_PATHS:
            raise ValueError(f"prefill_path must be one of {list(PREFILL_PATHS)}, "
                             f"got {self.prefill_path!r}")
        if self.trace_steps is not None and (not isinstance(self.trace_steps, str)
                                             or not self.trace_steps):
            raise ValueError(f"trace_steps must be a file path, got {self.trace_steps!r}")
