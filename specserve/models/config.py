"""Architecture hyper-parameters of the decoders: `llama` (Mistral-style files too), `qwen2`,
`qwen3`, `gemma3`, and the hybrid decoders `qwen35` (Qwen3.5: Gated DeltaNet layers beside gated
full attention) and `gemma4` (Gemma 4, text).

`ModelConfig` checks every field's type and range, so a malformed `config.json` or GGUF
header is reported by field name instead of failing deep inside the model's construction.
The fields past `attention_bias` describe what sets the newer architectures apart (their
defaults are the `llama`/`qwen2` decoder); `arch_traits` gives the fixed ones per architecture,
the loaders fill the rest from the file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specserve.models.hybrid_config import GlobalAttention, LinearAttention, check_hybrid
from specserve.models.rope import RopeScaling

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "qwen35", "gemma4")
HYBRID_ARCHITECTURES = ("qwen35", "gemma4")  # run by `hybrid.HybridModel`
HIDDEN_ACTS = ("silu", "gelu_tanh")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the decoder needs to know; filled from GGUF metadata or a `config.json`."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool  # qwen2 carries q/k/v biases
    rope_scaling: RopeScaling | None = None  # of the full-attention layers
    qk_norm: bool = False  # qwen3, gemma3: RMSNorm of each query and key head before rope
    sandwich_norms: bool = False  # gemma3: norms after attention and MLP, and before the MLP
    hidden_act: str = "silu"  # the MLP's gate activation: "silu" | "gelu_tanh"
    embed_scale: float = 1.0  # gemma3: embeddings × sqrt(hidden), rounded to the weights' dtype
    attn_scale: float | None = None  # query scale; None: 1 / sqrt(head_dim)
    sliding_window: int | None = None  # positions a sliding layer attends to (its own included)
    sliding_layers: tuple[int, ...] = ()  # the layers that attend through the window
    rope_local_theta: float | None = None  # rope base of the sliding layers; None: rope_theta
    final_logit_softcap: float | None = None  # logits = cap · tanh(logits / cap)
    # the hybrid decoders (`hybrid_config.py` says what each field means)
    linear_layers: tuple[int, ...] = ()  # qwen35: the Gated DeltaNet layers
    linear_attention: LinearAttention | None = None  # qwen35: their dimensions
    rotary_dim: int | None = None  # qwen35: leading dims of a head the rotary embedding turns
    attn_output_gate: bool = False  # qwen35: q_proj also gives a gate; output × sigmoid(gate)
    value_norm: bool = False  # gemma4: an RMSNorm without weight on each value head
    global_attention: GlobalAttention | None = None  # gemma4: the full-attention layers' own
    kv_shared_layers: int = 0  # gemma4: the last N layers reuse earlier layers' keys and values
    per_layer_input: int = 0  # gemma4: width of the per-layer token embeddings (0: none)
    mtp_layers: int = 0  # qwen35: multi-token-prediction layers the checkpoint carries

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})"
            )
        for name in ("attn_scale", "rope_local_theta", "final_logit_softcap", "embed_scale"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 < value < float("inf")):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; "
                             f"supported: {', '.join(HIDDEN_ACTS)}")
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                   or window < 1):
            raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
        check_hybrid(self)
        if self.sliding_layers and window is None:
            raise ValueError("sliding_layers need a sliding_window")
        bad = [i for i in self.sliding_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"sliding_layers: layer {bad[0]} outside 0..{self.num_layers - 1}")


def arch_traits(arch: str, hidden_size: int) -> dict:
    """The `ModelConfig` fields fixed by the architecture (not read from the file)."""
    if arch == "qwen3":
        return {"qk_norm": True}
    if arch == "qwen35":
        return {"qk_norm": True, "attn_output_gate": True}
    if arch in ("gemma3", "gemma4"):
        traits = {"qk_norm": True, "sandwich_norms": True, "hidden_act": "gelu_tanh",
                  "embed_scale": math.sqrt(hidden_size)}
        return traits | ({"value_norm": True, "attn_scale": 1.0} if arch == "gemma4" else {})
    return {}
