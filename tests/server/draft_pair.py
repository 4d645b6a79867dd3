"""A tiny random target and a draft that agrees with it only part of the time (the target's own
weights plus a little Gaussian noise), served by a real `specserve serve` process: greedy
speculation then yields accepted, recovered and bonus tokens, not only accepted ones."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from tests import tiny
from tests.server.conftest import ServerProcess, start_server

DRAFT_NOISE = 0.004  # weight noise: the draft's greedy token matches the target's ~2 times in 3


def save_pair(root: Path, noise: float = DRAFT_NOISE, seed: int = 1) -> tuple[Path, Path]:
    """Writes `root/target` and `root/draft` (HF directories with the same tokenizer)."""
    target = tiny.build_hf_model("qwen2", seed=0)
    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise)
    return tiny.save_hf_dir(target, root / "target"), tiny.save_hf_dir(draft, root / "draft")


def start_pair_server(root: Path) -> ServerProcess:
    target, draft = save_pair(root)
    # conftest's server drafts with the target itself; a later --draft-model replaces that one
    return start_server(target, root / "server.log", "--draft-model", str(draft))


def rounds_of(origins: list[str]) -> list[list[str]]:
    """A completion's speculation rounds from its token origins: the first token is the
    prefill's; after it each round is its accepted drafts and one recovered / bonus / plain
    token (a round cut short by a stop ends with accepted drafts)."""
    rounds, current = [], []
    for origin in origins[1:]:
        current.append(origin)
        if origin != "accepted":
            rounds.append(current)
            current = []
    if current:
        rounds.append(current)
    return rounds
