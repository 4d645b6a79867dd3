"""The default speculation, decided here once: for `LLM(...)` (`for_llm`) and for the commands
`generate` and `serve` (`decide`, said in one log line by `of_args`).

`LLM(...)` speculates by default only for the default target named by its alias (as in vLLM,
speculation for another model is asked for). The commands decide for the model given: the
default draft drafts for a target whose vocabulary is its own token for token (`hybrid`:
suffix drafting and the draft model, chosen per round); otherwise, or where the draft is not
downloaded, suffix drafting alone (`suffix`, model-free). Only the two tokenizers are read
for the decision, never the weights.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from specserve.hub.registry import DEFAULT_DRAFT, DEFAULT_TARGET
from specserve.hub.resolver import resolve_model
from specserve.models import tokenizer as tok
from specserve.models.tokenizer import Tokenizer, check_same_vocabulary


COST_AWARE = -1  # num_speculative_tokens: the cost-aware policy chooses k each round
log = logging.getLogger("specserve.server")


def hybrid_speculation(draft: str = DEFAULT_DRAFT) -> dict:
    """Hybrid speculation with `draft`, cost-aware k: the default pair's."""
    return {"method": "hybrid", "model": draft, "num_speculative_tokens": COST_AWARE}


def for_llm(model: object) -> dict | None:
    """`LLM(...)`'s speculation when `speculative_config` is not given: the default pair's for
    the default target named by its alias, none for any other model. An explicit
    `speculative_config=None` is plain decoding."""
    return hybrid_speculation() if isinstance(model, str) and model == DEFAULT_TARGET else None


def of_args(args: argparse.Namespace) -> dict:
    """A command's speculation when no flag names a method: `decide` for `--model`, said in
    one log line."""
    config, reason = decide(args.model, DEFAULT_DRAFT)
    log.info("specserve: %s", reason)
    return config


def decide(target: str | Path, draft: str = DEFAULT_DRAFT) -> tuple[dict, str]:
    """(speculative config, one-line reason) for serving `target` with no speculation flag."""
    with_draft = hybrid_speculation(draft)
    if str(target) == DEFAULT_TARGET:
        return with_draft, (f"speculation: hybrid, suffix drafting and draft model {draft} "
                            "(the default pair), cost-aware")
    suffix = {"method": "suffix", "num_speculative_tokens": COST_AWARE}
    try:
        draft_path = resolve_model(draft)
    except FileNotFoundError:
        return suffix, (f"speculation: suffix drafting (model-free), cost-aware; the default "
                        f"draft {draft} is not downloaded")
    target_path = resolve_model(str(target))
    if _same_vocabulary(read_tokenizer(target_path), read_tokenizer(draft_path)):
        return with_draft, (f"speculation: hybrid, suffix drafting and draft model {draft}, "
                            f"cost-aware (its vocabulary is {Path(target).name}'s)")
    return suffix, (f"speculation: suffix drafting (model-free), cost-aware; the default draft "
                    f"{draft} has another vocabulary than {Path(target).name}")


def read_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer of a GGUF file (from its header) or a Hugging Face directory."""
    if path.is_dir():
        from specserve.weights.hf_loader import read_config
        from specserve.weights.loader import eos_ids

        _, raw = read_config(path)
        return tok.from_hf_dir(path, eos_ids(path, raw))
    from specserve.weights.gguf_loader import open_gguf, read_metadata

    return tok.from_gguf_metadata(read_metadata(open_gguf(path)))


def _same_vocabulary(target: Tokenizer, draft: Tokenizer) -> bool:
    try:
        check_same_vocabulary(target, draft)
    except ValueError:
        return False
    return True
