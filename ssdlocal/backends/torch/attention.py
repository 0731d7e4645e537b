"""Which fused attention kernel each step runs, and the mask in the form that kernel takes.

torch's SDPA picks its kernel from what the call allows: flash takes no mask; the
memory-efficient kernel takes an additive mask but not grouped-query attention
(`enable_gqa`); with a boolean mask and GQA on CUDA only the math kernel is left, which
repeats K/V to every head and works in float32 over the whole span. So on CUDA a masked
step (decode, verify, SSD tree) folds the G = H / Hkv query heads that share one kv head
into the query length — q [B, H, T, D] -> [B, Hkv, G*T, D], mask row g*T + t = mask row t —
and runs the memory-efficient kernel with an additive mask built once per forward: no
K/V copy, and G*T query rows per kv head fill the kernel's tiles better than T.
That kernel's grid is (batch x kv heads x query tiles) with no split over the keys, so
a step with few query rows per kv head (decode, a K+1 verify) at batch 1 launches a
handful of blocks on a GPU of a hundred processors, and at long spans attention then
costs more than reading the weights. Such a step over a long span ("batched-matmul": at
most MATMUL_ROWS query rows per kv head, at least MATMUL_SPAN slots) runs as two batched
matmuls instead, which spread over the keys: scores [B*Hkv, G*T, S] in float32 (a GEMM
tiled over S), the mask, a float32 softmax, then probabilities x values (split over S by
the library's GEMM). Chosen per step from the host-known shape, so captured graphs
hold one path per span bucket; exact against the folded kernel in float32.
The fresh causal prefill (no mask) keeps flash with native GQA. A later chunk of a
prompt on CUDA ("lower-right") needs no mask either: its C queries sit at the end of the
S slots they attend, so it is causal aligned to the lower right (torch's `causal_lower_right`
bias, which runs flash with native GQA in bf16/fp16, or the memory-efficient kernel's own
causal mode), one call per group of rows that start at the same position; in float32
(no flash) one call per query group too, since with GQA torch would materialise the mask
and run the math kernel. On the CPU, torch's flash kernel takes boolean masks and GQA as
they are. Knows nothing about models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

KERNELS = ("flash-causal", "efficient-folded", "batched-matmul", "cpu-flash", "lower-right")
MATMUL_ROWS = 64  # query rows per kv head (G*T) up to which a masked CUDA step may run as batched matmuls
MATMUL_SPAN = 2048  # slots from which it does (shorter spans keep the one fused kernel)


def attention_kernel(device_type: str, masked: bool, rows: int = 1, span: int = 0) -> str:
    """The kernel a step uses: "flash-causal" (CUDA, no mask: a fresh prefill),
    "efficient-folded" (CUDA with a mask: GQA folded into the queries), "batched-matmul" (CUDA
    with a mask, at most MATMUL_ROWS query rows per kv head (`rows` = G*T) over at least
    MATMUL_SPAN slots (`span`): batched matmuls spread over the keys), "cpu-flash" (torch's
    CPU kernel: boolean masks and GQA as they are)."""
    if device_type != "cuda":
        return "cpu-flash"
    if not masked:
        return "flash-causal"
    return "batched-matmul" if rows <= MATMUL_ROWS and span >= MATMUL_SPAN else "efficient-folded"


def chunk_kernel(device_type: str) -> str:
    """The kernel a later chunk of a long prompt uses: "lower-right" on CUDA (no mask),
    "cpu-flash" elsewhere (a boolean mask)."""
    return "lower-right" if device_type == "cuda" else "cpu-flash"


@dataclass(frozen=True)
class AttentionMask:
    """Which cache slots each query sees, prepared once per forward for every layer.

    kernel: one of KERNELS ("flash-causal" never has a mask object: it is None).
    tensor: "cpu-flash": bool [B, 1, T, S]; "efficient-folded": additive [B, 1, G*T, S]
        in the activation dtype (0 where visible, -inf elsewhere); "batched-matmul": bool
        [B, 1, 1, T, S], True where hidden; "lower-right": None.
    span: S, the slots attended.
    spans: "lower-right" only: per row, the slots its queries end at (query t of row b
        sees slots [0, spans[b] - T + t]); rows are attended in runs of equal spans.
    """

    kernel: str
    tensor: Tensor | None
    span: int
    spans: tuple[int, ...] = ()
    groups: int = 1  # query heads per kv head ("efficient-folded" repeats each row this often)

    @classmethod
    def lower_right(cls, spans: tuple[int, ...]) -> AttentionMask:
        """A prompt chunk whose T queries of row b are the newest tokens of slots
        [0, spans[b]) (host ints: nothing is read back from the device)."""
        return cls("lower-right", None, max(spans), tuple(spans))

    def visible(self) -> Tensor:
        """Which slots each query sees, bool [B, 1, T, S], whatever the kernel's form."""
        if self.kernel == "cpu-flash":
            assert self.tensor is not None
            return self.tensor
        if self.kernel == "efficient-folded":
            assert self.tensor is not None
            T = self.tensor.shape[2] // self.groups
            return torch.isfinite(self.tensor[:, :, :T])  # rows g*T + t: group 0's are the queries'
        if self.kernel == "batched-matmul":
            assert self.tensor is not None
            return ~self.tensor[:, :, 0]  # [B, 1, T, S] from "hidden" [B, 1, 1, T, S]
        raise ValueError(f"a {self.kernel} mask holds no tensor")  # callers of sink attention build masks

    @classmethod
    def build(cls, mask: Tensor, groups: int, dtype: torch.dtype) -> AttentionMask:
        """mask [B, T, S] bool (query t of row b sees slot s) for a model whose query heads
        come in `groups` per kv head, computing in `dtype`."""
        B, T, S = mask.shape
        kernel = attention_kernel(mask.device.type, masked=True, rows=groups * T, span=S)
        if kernel == "cpu-flash":
            return cls(kernel, mask[:, None], S)  # [B, 1, T, S]
        if kernel == "batched-matmul":
            return cls(kernel, ~mask[:, None, None], S)  # [B, 1, 1, T, S], once for every layer
        rows = mask[:, None].expand(B, groups, T, S).reshape(B, 1, groups * T, S)  # [B, 1, G*T, S]
        bias = torch.zeros(rows.shape, dtype=dtype, device=mask.device)  # [B, 1, G*T, S]
        return cls(kernel, bias.masked_fill_(~rows, float("-inf")), S, groups=groups)


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    keys: Tensor,
    values: Tensor,
    mask: AttentionMask | None,
    scale: float | None = None,
) -> Tensor:
    """q [B, H, T, D]; k/v [B, Hkv, T, D] (the new tokens, used when mask is None);
    keys/values [B, Hkv, S, D] (the cache's first S slots) -> [B, H, T, D]. `scale`: the
    softmax scale (None: 1/sqrt(D))."""
    gqa = q.shape[1] != k.shape[1]
    if mask is None:  # a fresh prefill: causal over the new tokens, no dense mask
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)  # [B, H, T, D]
    if mask.kernel == "cpu-flash":
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.tensor, enable_gqa=gqa, scale=scale)
    if mask.kernel == "lower-right":
        return lower_right_attention(q, keys, values, mask.spans, scale)
    if mask.kernel == "batched-matmul":
        return matmul_attention(q, keys, values, mask.tensor, scale)
    return folded_attention(q, keys, values, mask.tensor, scale)


def sink_attention(
    q: Tensor, kv: tuple[Tensor, Tensor], mask: AttentionMask | None, sinks: Tensor, scale: float | None
) -> Tensor:
    """Attention whose softmax denominator has one more term per head, exp(sinks[h]):
    q [B, H, T, D]; kv: keys/values [B, Hkv, S, D] (the new tokens' [B, Hkv, T, D] for a fresh
    prefill); the mask's visible slots (or causal over the new tokens) -> [B, H, T, D]. Written
    out in float32 as the reference computes it (scores, the sink column, max-shifted softmax)."""
    keys, values = kv
    if mask is None:
        T = q.shape[2]
        visible = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()[None, None]  # [1, 1, T, T]
    else:
        visible = mask.visible()  # [B, 1, T, S]
    groups = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)  # [B, H, S, D]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale  # [B, H, T, S]
    scores = scores.masked_fill(~visible, float("-inf"))  # [B, H, T, S]
    sink = sinks.reshape(1, -1, 1, 1).to(scores.dtype).expand(*scores.shape[:3], 1)  # [B, H, T, 1]
    logits = torch.cat([scores, sink], dim=-1)  # [B, H, T, S+1]
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]  # [B, H, T, S]: the sink dropped
    return torch.matmul(probs.to(values.dtype), values)  # [B, H, T, D]


def lower_right_attention(
    q: Tensor, keys: Tensor, values: Tensor, spans: tuple[int, ...], scale: float | None = None
) -> Tensor:
    """q [B, H, T, D]; keys/values [B, Hkv, S, D]; query t of row b sees slots
    [0, spans[b] - T + t] -> [B, H, T, D]. One kernel call per run of rows with equal spans."""
    from torch.nn.attention.bias import causal_lower_right

    B, H, T, D = q.shape
    kv_heads = keys.shape[1]
    # Flash (bf16/fp16) takes GQA; in float32 only the memory-efficient kernel runs a lower-right
    # causal step unmasked, and it takes no GQA: one call per query group then.
    grouped = q.dtype == torch.float32 and H != kv_heads
    outs, a = [], 0
    while a < B:
        b = a + 1
        while b < B and spans[b] == spans[a]:
            b += 1
        S = spans[a]
        bias = causal_lower_right(T, S)
        rows_keys, rows_values = keys[a:b, :, :S], values[a:b, :, :S]  # [b - a, Hkv, S, D]
        if grouped:
            by_group = q[a:b].view(b - a, kv_heads, H // kv_heads, T, D)  # head h = kv * G + g
            parts = [
                F.scaled_dot_product_attention(by_group[:, :, g], rows_keys, rows_values, attn_mask=bias, scale=scale)
                for g in range(H // kv_heads)
            ]  # G x [b - a, Hkv, T, D]
            outs.append(torch.stack(parts, dim=2).view(b - a, H, T, D))
        else:
            outs.append(
                F.scaled_dot_product_attention(
                    q[a:b], rows_keys, rows_values, attn_mask=bias, enable_gqa=H != kv_heads, scale=scale
                )
            )  # [b - a, H, T, D]
        a = b
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def folded_attention(q: Tensor, keys: Tensor, values: Tensor, bias: Tensor, scale: float | None = None) -> Tensor:
    """Grouped-query attention as plain multi-head attention over Hkv heads of G*T queries.

    q [B, H, T, D], keys/values [B, Hkv, S, D], bias [B, 1, G*T, S] additive -> [B, H, T, D].
    Query head h belongs to kv head h // G (the grouping `enable_gqa` uses)."""
    B, H, T, D = q.shape
    kv_heads = keys.shape[1]
    folded = q.reshape(B, kv_heads, (H // kv_heads) * T, D)  # [B, Hkv, G*T, D]
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=bias, scale=scale)  # [B, Hkv, G*T, D]
    return out.reshape(B, H, T, D)


def matmul_attention(q: Tensor, keys: Tensor, values: Tensor, hidden: Tensor, scale: float | None = None) -> Tensor:
    """Grouped-query attention for few query rows over many keys, as two batched matmuls.

    q [B, H, T, D], keys/values [B, Hkv, S, D] (views of the cache: no copy), hidden
    [B, 1, 1, T, S] bool (True: the slot is not visible to that query) -> [B, H, T, D].
    Scores are float32 (the matmul's own output type on CUDA: K is never copied or
    widened); the softmax is float32; the probabilities meet V in V's dtype. `scale`: the
    softmax scale (None: 1/sqrt(D))."""
    B, H, T, D = q.shape
    kv_heads, S = keys.shape[1], keys.shape[2]
    G = H // kv_heads
    q3 = q.reshape(B * kv_heads, G * T, D)  # [B*Hkv, G*T, D]: head h = kv * G + g
    k3 = keys.reshape(B * kv_heads, S, D)  # [B*Hkv, S, D], a view: a (row, head)'s slots are consecutive
    if q.is_cuda and q.dtype != torch.float32:
        scores = torch.bmm(q3, k3.transpose(1, 2), out_dtype=torch.float32)  # [B*Hkv, G*T, S]
    else:
        scores = torch.bmm(q3, k3.transpose(1, 2)).float()  # [B*Hkv, G*T, S]
    scores = (
        scores.view(B, kv_heads, G, T, S).mul_(D**-0.5 if scale is None else scale).masked_fill_(hidden, float("-inf"))
    )
    probs = torch.softmax(scores, dim=-1).to(values.dtype)  # [B, Hkv, G, T, S]
    out = torch.bmm(probs.view(B * kv_heads, G * T, S), values.reshape(B * kv_heads, S, D))  # [B*Hkv, G*T, D]
    return out.view(B, H, T, D)
