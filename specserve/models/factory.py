"""The runtime model of a configuration: `Transformer` for the classic decoders, `HybridModel`
for Qwen3.5 (with its multi-token-prediction head, where the checkpoint has one) and Gemma 4."""

from __future__ import annotations

import torch

from specserve.models.config import HYBRID_ARCHITECTURES, ModelConfig
from specserve.models.hybrid import HybridModel
from specserve.models.mtp_head import MTPHead
from specserve.models.transformer import Transformer


def build_model(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> Transformer | HybridModel:
    """The decoder of `cfg` over `weights` (Hugging Face names)."""
    if cfg.architecture in HYBRID_ARCHITECTURES:
        return HybridModel(cfg, weights, mtp=MTPHead(cfg, weights) if cfg.mtp_layers else None)
    return Transformer(cfg, weights)
