"""Gated DeltaNet, the linear-attention layer of Qwen3.5, as transformers computes it: a short
causal convolution over the projected q/k/v, then the gated delta rule (a recurrent state
S [Dk, Dv] per value head, decayed by exp(g) and moved toward each token's value by beta),
read by the query, normed under a SiLU gate and projected out.

Which form runs is the model's `LinearContext` (set around a call, never read from a tensor,
so a captured step always takes the per-position form):
- per position (decode and verify steps, short feeds): the recurrent form, token by token;
  the state after EVERY position is written to the layer's ring (linear_states.py) at that
  position, so `advance(n)` picks a row's state by moving its length, with no copy.
- a long feed (`ctx.ends`: each row's end position): the chunked form (chunks of 64) from
  the state before the feed; tokens past a row's end leave its state alone (decay 0, beta 0)
  and only the state after its last token (with its last convolution inputs) is written.
- a tree step (`ctx.tree`): every query is a branch of one token; its state comes from the
  ring at the fork (first step) or from the tree buffers, and goes to the other buffer.

Shapes: B rows, T tokens, Hk key heads, Hv value heads (key head h serves Hv/Hk consecutive
value heads), Dk, Dv head widths, C = 2*Hk*Dk + Hv*Dv convolution channels, K the kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssdlocal.backends.torch.linear_states import LinearContext, LinearStates


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, ...]:
    """q/k [B, T, Hk, Dk], v [B, T, Hv, Dv], g/beta [B, T, Hv] -> float32 [B, Hv, T, ...]
    each, q and k repeated to the value heads and L2-normed."""
    r = v.shape[2] // k.shape[2]
    if r > 1:
        q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)  # [B, T, Hv, Dk]
    q, k, v, g, beta = (
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for x in (q, k, v, g, beta)
    )
    return l2norm(q), l2norm(k), v, g, beta


def recurrent_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """The gated delta rule token by token: q/k [B, H, T, Dk], v [B, H, T, Dv], g/beta
    [B, H, T] (float32, from `prepare`), state [B, H, Dk, Dv] -> (out [B, H, T, Dv], the
    state after each position [B, T, H, Dk, Dv])."""
    q = q / (q.shape[-1] ** 0.5)
    outs, states = [], []
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]  # [B, H, Dk, Dv]
        remembered = (state * k[:, :, t, :, None]).sum(dim=-2)  # [B, H, Dv]
        delta = (v[:, :, t] - remembered) * beta[:, :, t, None]  # [B, H, Dv]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]  # [B, H, Dk, Dv]
        outs.append((state * q[:, :, t, :, None]).sum(dim=-2))  # [B, H, Dv]
        states.append(state)
    return torch.stack(outs, dim=2), torch.stack(states, dim=1)


def chunk_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, chunk: int = 64
) -> tuple[Tensor, Tensor]:
    """The gated delta rule over chunks of `chunk` tokens (a triangular solve inside each,
    a scan across them): the same arguments as `recurrent_rule` -> (out [B, H, T, Dv], the
    state after the last position [B, H, Dk, Dv]). Equal to the recurrent form in float32
    up to rounding."""
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    q = q * Dk**-0.5
    pad = (chunk - T % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))  # [B, H, T', D]
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))  # [B, H, T']
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(B, H, -1, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))  # [B, H, N, c, D]
    g = g.reshape(B, H, -1, chunk).cumsum(dim=-1)  # [B, H, N, c]: decay from each chunk's start
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [B, H, N, c, c]
    system = (k_beta @ k.transpose(-1, -2)) * pairwise  # [B, H, N, c, c]
    inside = (q @ k.transpose(-1, -2)) * pairwise  # [B, H, N, c, c]
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)  # [B, H, N, c, Dv]
    k_decayed = torch.linalg.solve_triangular(
        system, k_beta * g.exp()[..., None], upper=False, unitriangular=True
    )  # [B, H, N, c, Dk]
    state = state.to(new_values)
    out = torch.zeros_like(new_values)
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    chunk_decay = g[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]
    for i in range(q.shape[2]):
        fresh = new_values[:, :, i] - k_decayed[:, :, i] @ state  # [B, H, c, Dv]
        out[:, :, i] = q[:, :, i] @ state + inside[:, :, i] @ fresh
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ fresh  # [B, H, Dk, Dv]
    return out.reshape(B, H, -1, Dv)[:, :, :T], state


class GatedRMSNorm(nn.Module):
    """RMS norm of each head's output in float32, scaled in the activation dtype, then times
    SiLU(gate) in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear attention (module names as its checkpoints': in_proj_qkv/z/b/a,
    conv1d, A_log, dt_bias, norm, out_proj). `states` and `index` (which linear layer it is)
    are set when the model installs its caches; `ctx` is the model's LinearContext."""

    def __init__(
        self, hidden: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int, kernel: int, eps: float
    ) -> None:
        super().__init__()
        self.key_heads, self.value_heads, self.key_dim, self.value_dim = key_heads, value_heads, key_dim, value_dim
        self.channels = 2 * key_heads * key_dim + value_heads * value_dim
        self.in_proj_qkv = nn.Linear(hidden, self.channels, bias=False)
        self.in_proj_z = nn.Linear(hidden, value_heads * value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, value_heads, bias=False)
        self.conv1d = nn.Conv1d(self.channels, self.channels, kernel, groups=self.channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(value_heads))
        self.A_log = nn.Parameter(torch.zeros(value_heads))
        self.norm = GatedRMSNorm(value_dim, eps)
        self.out_proj = nn.Linear(value_heads * value_dim, hidden, bias=False)
        self.kernel = kernel
        self.states: LinearStates | None = None  # set by the model's use_caches
        self.index = 0  # this layer's place among the model's linear layers
        self.ctx = LinearContext()  # replaced by the model's shared one

    def state_shape(self) -> tuple[int, int, int, int]:
        """(channels, value heads, key width, value width): what one row's state holds."""
        return self.channels, self.value_heads, self.key_dim, self.value_dim

    def forward(self, x: Tensor, slots: Tensor) -> Tensor:
        """x [B, T, hidden], slots [B, T] (the tokens' positions, except in a tree step)."""
        assert self.states is not None  # installed by use_caches (CausalLM.forward checks the setup)
        B, T, _ = x.shape
        mixed = self.in_proj_qkv(x)  # [B, T, C]
        z = self.in_proj_z(x).reshape(B, T, self.value_heads, self.value_dim)  # [B, T, Hv, Dv]
        beta = self.in_proj_b(x).sigmoid()  # [B, T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # [B, T, Hv] float32
        ctx, states = self.ctx, self.states
        if ctx.tree is not None:
            out = self._tree(mixed, g, beta, ctx)  # [B, T, Hv, Dv]
        elif ctx.ends is not None or T >= states.ring:  # a long feed (called without one: every token real)
            if ctx.ends is None:
                ctx = LinearContext(ends=slots[:, -1] + 1)
            out = self._long(mixed, g, beta, slots, ctx)
        else:
            window, state = states.read(self.index, slots[:, 0] - 1)  # [B, K-1, C], [B, Hv, Dk, Dv]
            q, k, v = self._qkv(self._conv(torch.cat([window, mixed], dim=1), T))
            out, after = recurrent_rule(*prepare(q, k, v, g, beta), state)  # [B, Hv, T, Dv], [B, T, Hv, Dk, Dv]
            states.write(self.index, slots, mixed, after, window)
            out = out.transpose(1, 2)  # [B, T, Hv, Dv]
        out = self.norm(out.to(x.dtype).reshape(-1, self.value_dim), z.reshape(-1, self.value_dim))  # [B*T*Hv, Dv]
        return self.out_proj(out.reshape(B, T, -1))  # [B, T, hidden]

    def _conv(self, inputs: Tensor, T: int) -> Tensor:
        """inputs [B, K-1+T, C] (the K-1 before the new tokens, then theirs) -> SiLU of the
        depthwise convolution at the T new tokens [B, T, C]."""
        weight = self.conv1d.weight  # [C, 1, K]
        out = F.conv1d(inputs.transpose(1, 2).to(weight.dtype), weight, None, groups=self.channels)  # [B, C, T]
        return F.silu(out[:, :, -T:]).to(inputs.dtype).transpose(1, 2)  # [B, T, C]

    def _qkv(self, mixed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, T, _ = mixed.shape
        kd = self.key_heads * self.key_dim
        q, k, v = torch.split(mixed, [kd, kd, self.value_heads * self.value_dim], dim=-1)
        return (
            q.reshape(B, T, self.key_heads, self.key_dim),
            k.reshape(B, T, self.key_heads, self.key_dim),
            v.reshape(B, T, self.value_heads, self.value_dim),
        )

    def _long(self, mixed: Tensor, g: Tensor, beta: Tensor, slots: Tensor, ctx: LinearContext) -> Tensor:
        """A long feed in the chunked form; row b's tokens end before position ends[b]. A
        feed read in chunks (CausalLM.prefill) passes each layer's state from one chunk to
        the next in `ctx.carry`; the ring gets only the state after each row's last token,
        written by the call that holds it (so an interrupted feed leaves the state the row
        started from, unless that slot is the last token's)."""
        assert self.states is not None and ctx.ends is not None
        ends, T = ctx.ends, mixed.shape[1]
        before = torch.minimum(slots[:, 0], ends) - 1  # [B]: the position whose state it starts from
        count = (ends - 1 - before).clamp(0, T)  # [B]: the row's tokens in this call
        live = torch.arange(T, device=mixed.device)[None, :] < count[:, None]  # [B, T]
        carried = ctx.carry.get(self.index)
        window, state = self.states.read(self.index, before) if carried is None else carried
        inputs = torch.cat([window, mixed], dim=1)  # [B, K-1+T, C]
        q, k, v = self._qkv(self._conv(inputs, T))
        g, beta = (
            g.masked_fill(~live[..., None], 0.0),
            beta.masked_fill(~live[..., None], 0.0),
        )  # past the end: no change
        out, final = chunk_rule(*prepare(q, k, v, g, beta), state)  # [B, Hv, T, Dv], [B, Hv, Dk, Dv]
        take = count[:, None] + torch.arange(self.kernel - 1, device=mixed.device)  # [B, K-1] into inputs
        last = inputs.gather(1, take[..., None].expand(-1, -1, inputs.shape[-1]))  # [B, K-1, C]
        ctx.carry[self.index] = last, final
        ending = (count > 0) & (slots[:, -1] + 1 >= ends)  # [B]: the row's last token is in this call
        self.states.write_final(self.index, torch.where(ending, before + count, -1), last, final)
        return out.transpose(1, 2)  # [B, T, Hv, Dv]

    def _tree(self, mixed: Tensor, g: Tensor, beta: Tensor, ctx: LinearContext) -> Tensor:
        """A tree step: query j of row b is one token of branch j; its convolution inputs and
        state come from the ring at the fork (the first step) or the tree buffers."""
        assert self.states is not None and ctx.positions is not None and ctx.tree is not None
        B, W, C = mixed.shape
        window, state = self.states.tree_read(self.index, ctx.tree, ctx.positions)  # [B, W, K-1, C], [B, W, Hv, Dk, Dv]
        inputs = torch.cat([window, mixed[:, :, None]], dim=2)  # [B, W, K, C]
        q, k, v = self._qkv(self._conv(inputs.reshape(B * W, self.kernel, C), 1))  # [B*W, 1, ...]
        gb, bb = g.reshape(B * W, 1, -1), beta.reshape(B * W, 1, -1)
        out, after = recurrent_rule(*prepare(q, k, v, gb, bb), state.reshape(B * W, *state.shape[2:]))
        self.states.tree_write(self.index, ctx.tree, inputs[:, :, 1:], after.reshape(state.shape))
        return out.reshape(B, W, self.value_heads, self.value_dim)  # [B, W, Hv, Dv]
