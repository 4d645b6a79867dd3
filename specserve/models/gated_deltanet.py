"""Gated DeltaNet linear attention (Yang, Kautz, Hatamizadeh 2024, arXiv 2412.06464), as
Qwen3.5's linear layers compute it.

Per token t, per value head: q, k, v come from one projection through a causal depthwise
convolution (kernel K, then SiLU); q and k are L2-normalised, q scaled by 1/sqrt(d_k); with the
gate g_t = -exp(A_log) · softplus(a_t + dt_bias) and the step β_t = sigmoid(b_t), the state
S (`[d_k, d_v]`) is updated by the gated delta rule

    S ← exp(g_t) S;   S ← S + k_t (β_t (v_t − Sᵀk_t))ᵀ;   o_t = Sᵀ q_t,

and the output RMS-normed per head, times SiLU(z_t) (z a projection of its own), projected
back. Each key head serves num_v_heads / num_k_heads consecutive value heads. The recurrence
runs token by token in float32 on each sequence alone (its result does not depend on what
else is in the pass), from the states `recurrent_state.RecurrentStates` holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.models.config import ModelConfig
from specserve.models.layer import Linear
from specserve.models.recurrent_state import STATE_DTYPE

L2_EPS = 1e-6


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def delta_rule_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    decay: torch.Tensor, beta: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: state `[heads, dk, dv]`, q, k `[heads, dk]`, v `[heads, dv]`, decay, beta
    `[heads]` → (the new state, the output `[heads, dv]`)."""
    state = state * decay[:, None, None]
    memory = (state * k[:, :, None]).sum(dim=-2)  # [heads, dv]
    delta = (v - memory) * beta[:, None]  # [heads, dv]
    state = state + k[:, :, None] * delta[:, None, :]
    return state, (state * q[:, :, None]).sum(dim=-2)


class GatedDeltaNet:
    """Layer `prefix` of a Qwen3.5 checkpoint (Hugging Face names under `linear_attn.`)."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str) -> None:
        def get(name: str) -> torch.Tensor:
            return w[f"{prefix}.linear_attn.{name}"]

        self.dims = la = cfg.linear_attention
        self.eps = cfg.rms_norm_eps
        # one projection for q/k/v (the convolution's input), z, b and a
        self.in_proj = Linear(torch.cat([get("in_proj_qkv.weight"), get("in_proj_z.weight"),
                                         get("in_proj_b.weight"), get("in_proj_a.weight")]))
        self.conv = get("conv1d.weight").reshape(la.conv_dim, la.conv_kernel).to(STATE_DTYPE)
        self.neg_a = -get("A_log").to(STATE_DTYPE).exp()  # [v_heads]
        self.dt_bias = get("dt_bias").to(STATE_DTYPE)  # [v_heads]
        self.norm = get("norm.weight")  # [v_head_dim]
        self.out = Linear(get("out_proj.weight"))

    def __call__(self, h: torch.Tensor, lengths: list[int], states: list, history: int
                 ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """`h` `[rows, hidden]` (the sequences' rows one after another, `lengths` of each),
        `states[i]` = (conv, ssm) before sequence i's first row → (the layer's output `[rows,
        hidden]`, per sequence (conv `[m, conv_dim, K - 1]`, ssm `[m, v_heads, dk, dv]`): the
        states after its last m = min(rows, history) rows)."""
        la = self.dims
        mixed = self.in_proj(h)  # [rows, conv_dim + value_dim + 2 v_heads]
        qkv, z, b, a = mixed.split([la.conv_dim, la.value_dim, la.num_v_heads, la.num_v_heads],
                                   dim=-1)
        beta = b.sigmoid().to(STATE_DTYPE)  # [rows, v_heads]
        gate = self.neg_a * F.softplus(a.to(STATE_DTYPE) + self.dt_bias)  # [rows, v_heads]
        outs, kept, lo = [], [], 0
        for n, (conv_state, ssm_state) in zip(lengths, states):
            hi = lo + n
            if n == 0:
                kept.append(None)
                continue
            o, snaps = self._sequence(qkv[lo:hi], beta[lo:hi], gate[lo:hi], conv_state,
                                      ssm_state, history)
            outs.append(o)
            kept.append(snaps)
            lo = hi
        core = torch.cat(outs).to(h.dtype)  # [rows, v_heads, dv]
        return self.out(self._gated_norm(core, z).reshape(h.shape[0], la.value_dim)), kept

    def _sequence(self, qkv: torch.Tensor, beta: torch.Tensor, gate: torch.Tensor,
                  conv_state: torch.Tensor, ssm_state: torch.Tensor, history: int):
        """One sequence's T rows: convolution, then the recurrence token by token."""
        la = self.dims
        rows, k = qkv.shape[0], la.conv_kernel
        window = torch.cat([conv_state.T, qkv.to(STATE_DTYPE)])  # [K - 1 + T, conv_dim]
        taps = torch.stack([window[j:j + rows] for j in range(k)], dim=-1)  # [T, conv_dim, K]
        # rounded to the activations' dtype, as the reference computes the convolution
        mixed = F.silu((taps * self.conv).sum(dim=-1)).to(qkv.dtype).to(STATE_DTYPE)
        q, kk, v = mixed.split([la.key_dim, la.key_dim, la.value_dim], dim=-1)
        group = la.num_v_heads // la.num_k_heads
        q = l2_normalize(q.reshape(rows, la.num_k_heads, la.k_head_dim))
        q = q.repeat_interleave(group, dim=1) * la.k_head_dim ** -0.5  # [T, v_heads, dk]
        kk = l2_normalize(kk.reshape(rows, la.num_k_heads, la.k_head_dim))
        kk = kk.repeat_interleave(group, dim=1)  # [T, v_heads, dk]
        v = v.reshape(rows, la.num_v_heads, la.v_head_dim)  # [T, v_heads, dv]
        decay = gate.exp()  # [T, v_heads]
        m = min(rows, history)
        out, ssm = torch.empty_like(v), []  # [T, v_heads, dv]
        for t in range(rows):
            ssm_state, out[t] = delta_rule_step(ssm_state, q[t], kk[t], v[t], decay[t], beta[t])
            if t >= rows - m:
                ssm.append(ssm_state)
        conv = torch.stack([window[t + 1:t + k].T for t in range(rows - m, rows)])
        return out, (conv, torch.stack(ssm))  # [m, conv_dim, K - 1], [m, v_heads, dk, dv]

    def _gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each value head (float32), times the weight, times SiLU(z)."""
        la = self.dims
        x = core.to(STATE_DTYPE)  # [rows, v_heads, dv]
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = self.norm * x.to(core.dtype)
        gate = F.silu(z.reshape(*core.shape).to(STATE_DTYPE))
        return (x * gate).to(core.dtype)  # [rows, v_heads, dv]
