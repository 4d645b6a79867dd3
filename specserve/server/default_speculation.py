"""The speculation `specserve serve` uses when no flag names one: the named model is served.

The default draft (`DEFAULT_DRAFT`) belongs to the default target. It drafts for another target
only where its vocabulary is the target's token for token (`check_same_vocabulary` in
`specserve/llm.py`): then speculation is `hybrid` (suffix drafting and the draft model, chosen
per round by the controller); otherwise, or where the draft is not in the model cache, it is
suffix drafting alone (`suffix`, model-free), which serves any vocabulary. Only the two
tokenizers are read for the decision (GGUF headers or `tokenizer.json`), never the weights, so
it costs the same with one engine or with replicas. `decide` returns the config and one line
saying what was chosen and why.
"""

from __future__ import annotations

from pathlib import Path

from specserve.config import COST_AWARE, hybrid_speculation
from specserve.hub.registry import DEFAULT_DRAFT, DEFAULT_TARGET
from specserve.hub.resolver import resolve_model
from specserve.models import tokenizer as tok
from specserve.models.tokenizer import Tokenizer


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
    from specserve.llm import check_same_vocabulary

    try:
        check_same_vocabulary(target, draft)
    except ValueError:
        return False
    return True
