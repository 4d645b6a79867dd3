"""Gated DeltaNet linear attention (Yang, Kautz, Hatamizadeh 2024, arXiv 2412.06464), as
Qwen3.5's linear layers compute it.

Per token t, per value head: q, k, v come from one projection through a causal depthwise
convolution (kernel K, then SiLU); q and k are L2-normalised, q scaled by 1/sqrt(d_k); with the
gate g_t = -exp(A_log) · softplus(a_t + dt_bias) and the step β_t = sigmoid(b_t), the state
S (`[d_k, d_v]`, kept transposed) is updated by the gated delta rule

    S ← exp(g_t) S;   S ← S + k_t (β_t (v_t − Sᵀk_t))ᵀ;   o_t = Sᵀ q_t,

and the output RMS-normed per head, times SiLU(z_t) (z a projection of its own), projected
back. Each key head serves num_v_heads / num_k_heads consecutive value heads. The recurrence
runs token by token in float32, step t of every sequence of the pass at once, with every
reduction over the last axis of a row, so a sequence's bits do not depend on what else is in
the pass; it starts from the states `recurrent_state.RecurrentStates` holds.
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
    """One token for a batch of sequences: state `[B, heads, dv, dk]` (Sᵀ: the reductions run
    over the last, contiguous axis, so a row's bits do not depend on B), q, k `[B, heads, dk]`,
    v `[B, heads, dv]`, decay, beta `[B, heads]` → (the new state, the output `[B, heads,
    dv]`)."""
    state = state * decay[..., None, None]
    memory = (state * k[..., None, :]).sum(dim=-1)  # [B, heads, dv]
    delta = (v - memory) * beta[..., None]  # [B, heads, dv]
    state = state + delta[..., :, None] * k[..., None, :]
    return state, (state * q[..., None, :]).sum(dim=-1)


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
                 ) -> tuple[torch.Tensor, list]:
        """`h` `[rows, hidden]` (the sequences' rows one after another, `lengths` of each),
        `states[i]` = (conv `[conv_dim, K - 1]`, ssm `[v_heads, dv, dk]`) before sequence i's
        first row → (the layer's output `[rows, hidden]`, per sequence (conv `[m, conv_dim,
        K - 1]`, ssm `[m, v_heads, dv, dk]`): its states after its last m = min(rows, history)
        rows; None for a sequence without rows)."""
        la = self.dims
        mixed = self.in_proj(h)  # [rows, conv_dim + value_dim + 2 v_heads]
        qkv, z, b, a = mixed.split([la.conv_dim, la.value_dim, la.num_v_heads, la.num_v_heads],
                                   dim=-1)
        seqs = [i for i, n in enumerate(lengths) if n]
        conv_in, conv_snaps = self._convolve(qkv, [lengths[i] for i in seqs],
                                             [states[i][0] for i in seqs], history)
        q, k, v = conv_in.split([la.key_dim, la.key_dim, la.value_dim], dim=-1)
        group, rows = la.num_v_heads // la.num_k_heads, h.shape[0]
        q = l2_normalize(q.reshape(rows, la.num_k_heads, la.k_head_dim))
        q = q.repeat_interleave(group, dim=1) * la.k_head_dim ** -0.5  # [rows, v_heads, dk]
        k = l2_normalize(k.reshape(rows, la.num_k_heads, la.k_head_dim))
        k = k.repeat_interleave(group, dim=1)  # [rows, v_heads, dk]
        v = v.reshape(rows, la.num_v_heads, la.v_head_dim)  # [rows, v_heads, dv]
        beta = b.sigmoid().to(STATE_DTYPE)  # [rows, v_heads]
        decay = (self.neg_a * F.softplus(a.to(STATE_DTYPE) + self.dt_bias)).exp()
        core, ssm_snaps = self._recur(q, k, v, decay, beta, [lengths[i] for i in seqs],
                                      [states[i][1] for i in seqs], history)
        kept: list = [None] * len(lengths)
        for j, i in enumerate(seqs):
            kept[i] = (conv_snaps[j], ssm_snaps[j])
        core = core.to(h.dtype)  # [rows, v_heads, dv]
        return self.out(self._gated_norm(core, z).reshape(rows, la.value_dim)), kept

    def _convolve(self, qkv: torch.Tensor, lengths: list[int], conv_states: list,
                  history: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The causal depthwise convolution (then SiLU) of every row, each sequence continuing
        its conv state → (`[rows, conv_dim]`, per sequence its last m conv states)."""
        k = self.dims.conv_kernel
        # each sequence's window: its K - 1 previous inputs, then its rows
        parts = [p for s, rows in zip(conv_states, qkv.split(lengths))
                 for p in (s.T, rows.to(STATE_DTYPE))]
        window = torch.cat(parts)  # [sum(n + K - 1), conv_dim]
        n = torch.tensor(lengths)  # [B]
        base = torch.cumsum(n + k - 1, 0) - (n + k - 1)  # [B] where each window starts
        seq = torch.repeat_interleave(torch.arange(len(lengths)), n)  # [rows]
        t = torch.arange(qkv.shape[0]) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
        start = base[seq] + t  # [rows]: the window row of each row's oldest tap
        taps = window[start[:, None] + torch.arange(k)].transpose(1, 2).contiguous()
        out = F.silu((taps * self.conv).sum(dim=-1))  # [rows, conv_dim]
        # rounded to the activations' dtype, as the reference computes the convolution
        out = out.to(qkv.dtype).to(STATE_DTYPE)
        m = torch.clamp(n, max=history)  # [B]
        last = t >= (n - m)[seq]  # [rows] rows whose conv state is kept
        kept = window[start[last][:, None] + 1 + torch.arange(k - 1)].transpose(1, 2)
        return out, list(kept.split(m.tolist()))  # [m, conv_dim, K - 1] each

    @staticmethod
    def _recur(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
               beta: torch.Tensor, lengths: list[int], ssm_states: list, history: int
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The gated delta rule over every sequence's rows, step t of all sequences at once
        → (the outputs `[rows, v_heads, dv]`, per sequence its last m states)."""
        offsets = [0]
        for n in lengths[:-1]:
            offsets.append(offsets[-1] + n)
        state = torch.stack(ssm_states)  # [B, v_heads, dv, dk]
        out = torch.empty_like(v)  # [rows, v_heads, dv]
        after: list[torch.Tensor] = []  # state after step t, [B, v_heads, dv, dk]
        for t in range(max(lengths)):
            live = [j for j, n in enumerate(lengths) if n > t]
            rows = torch.tensor([offsets[j] + t for j in live])
            if len(live) == len(lengths):
                state, out[rows] = delta_rule_step(state, q[rows], k[rows], v[rows],
                                                   decay[rows], beta[rows])
            else:
                index = torch.tensor(live)
                new, out[rows] = delta_rule_step(state[index], q[rows], k[rows], v[rows],
                                                 decay[rows], beta[rows])
                state = state.index_copy(0, index, new)
            after.append(state)
        snaps = [torch.stack([after[t][j] for t in range(n - min(n, history), n)])
                 for j, n in enumerate(lengths)]
        return out, snaps

    def _gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each value head (float32), times the weight, times SiLU(z)."""
        x = core.to(STATE_DTYPE)  # [rows, v_heads, dv]
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = self.norm * x.to(core.dtype)
        gate = F.silu(z.reshape(*core.shape).to(STATE_DTYPE))
        return (x * gate).to(core.dtype)  # [rows, v_heads, dv]
