"""Peer systems on the same weights: transformers `generate` (plain and assisted) and,
when llama-cpp-python is installed and GGUF files are given, llama.cpp.

Every peer is timed like our engine: a streamer's `put` timestamps the first generated
token (TTFT), and tokens_per_s = tokens after the first chunk / time after it. Peers are
created by `make_peers`; one that cannot run here is returned in `skipped` with a reason.
Heavy libraries are imported lazily.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ssdlocal.bench.measure import Measurement
from ssdlocal.core.config import SamplingParams

log = logging.getLogger(__name__)

KNOWN_PEERS = ("hf", "hf-assisted", "llamacpp", "llamacpp-assisted")


class PeerSkipped(Exception):
    """A peer cannot run this batch / configuration; the message says why."""


@dataclass(frozen=True)
class PeerOptions:
    target: str  # checkpoint dir (transformers)
    draft: str | None
    dtype: str
    device: str
    k: int
    gguf_target: str | None = None
    gguf_draft: str | None = None
    n_ctx: int = 4096


class _FirstTokenClock:
    """Streamer for transformers `generate`: the first `put` is the prompt, the second the
    first generated chunk (its arrival time and size are recorded), `end` the finish."""

    def __init__(self) -> None:
        self.puts = 0
        self.t_first: float | None = None
        self.first_chunk = 0
        self.t_end: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.t_first = time.perf_counter()
            self.first_chunk = int(value.shape[-1]) if value.dim() > 1 else 1

    def end(self) -> None:
        self.t_end = time.perf_counter()


def _cut_at_eos(tokens: list[int], eos: frozenset[int], ignore_eos: bool) -> tuple[list[int], str]:
    if not ignore_eos:
        for i, t in enumerate(tokens):
            if t in eos:
                return tokens[: i + 1], "eos"
    return tokens, "length"


class HFPeer:
    """transformers `generate` on the same checkpoint; with `assistant` = assisted generation."""

    def __init__(self, name: str, opts: PeerOptions, eos_ids: frozenset[int], pad_id: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from ssdlocal.backends.registry import prepare_weights

        dtype = getattr(torch, opts.dtype)
        self.name = name
        self.torch = torch
        self.device = torch.device(opts.device)
        # a .gguf target (run quantized by us) is the float model of its cached conversion here
        target, draft = prepare_weights(opts.target), opts.draft and prepare_weights(opts.draft)
        self.model = (
            AutoModelForCausalLM.from_pretrained(target, dtype=dtype, trust_remote_code=False).to(self.device).eval()
        )
        self.assistant = None
        if name == "hf-assisted":
            self.assistant = (
                AutoModelForCausalLM.from_pretrained(draft, dtype=dtype, trust_remote_code=False).to(self.device).eval()
            )
            gc = self.assistant.generation_config
            gc.num_assistant_tokens = opts.k  # same lookahead K as our SD / SSD
            gc.num_assistant_tokens_schedule = "constant"
        self.eos_ids = eos_ids
        self.pad_id = pad_id

    def generate(self, batch: Sequence[Sequence[int]], params: SamplingParams, fresh: bool = True) -> Measurement:
        """`fresh` is moot: transformers `generate` keeps nothing between calls."""
        torch = self.torch
        if self.assistant is not None and len(batch) > 1:
            raise PeerSkipped("transformers assisted generation supports batch size 1 only")
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)  # [B, T], left-padded
        mask = torch.zeros(len(batch), width, dtype=torch.long)  # [B, T]
        for b, row in enumerate(batch):
            ids[b, width - len(row) :] = torch.tensor(list(row))
            mask[b, width - len(row) :] = 1
        config = copy.deepcopy(self.model.generation_config)
        config.update(
            max_new_tokens=params.max_new_tokens,
            do_sample=not params.greedy,
            temperature=params.temperature if not params.greedy else None,
            top_k=params.top_k if (params.top_k and not params.greedy) else None,
            top_p=params.top_p if (params.top_p < 1.0 and not params.greedy) else None,
            pad_token_id=self.pad_id,
            eos_token_id=None if params.ignore_eos else sorted(self.eos_ids),  # None: never stop early
        )
        kwargs = {"generation_config": config}
        if self.assistant is not None:
            kwargs["assistant_model"] = self.assistant
        clock = _FirstTokenClock()
        torch.manual_seed(params.seed)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                streamer=clock,
                **kwargs,
            )  # [B, T + new]
        t_end = clock.t_end or time.perf_counter()
        rows, finish = [], []
        for b in range(len(batch)):
            toks, why = _cut_at_eos(out[b, width:].tolist(), self.eos_ids, params.ignore_eos)
            rows.append(toks)
            finish.append(why)
        total = sum(map(len, rows))
        t_first = clock.t_first or t_end
        first = clock.first_chunk * len(batch) if self.assistant is not None else len(batch)
        return Measurement(
            system=self.name,
            token_ids=rows,
            finish=finish,
            ttft_s=t_first - t0,
            decode_s=t_end - t_first,
            decode_tokens=max(total - first, 0),
        )

    def close(self) -> None:
        self.model = self.assistant = None


class LlamaCppPeer:
    """llama-cpp-python on GGUF files; with a draft GGUF, its speculative `draft_model` hook
    is fed K greedy tokens from a second Llama (prefix reuse is llama.cpp's own)."""

    def __init__(self, name: str, opts: PeerOptions, eos_ids: frozenset[int]) -> None:
        from ssdlocal.backends.llamacpp.lib import high_level_llama

        draft = None
        if name == "llamacpp-assisted":
            draft = _make_gguf_draft(opts.gguf_draft, opts.k, opts.n_ctx)
        self.name = name
        self.llm = high_level_llama(  # probed first: refused where llama.cpp crashed here
            model_path=opts.gguf_target, n_ctx=opts.n_ctx, verbose=False, draft_model=draft
        )
        self.eos_ids = eos_ids

    def generate(self, batch: Sequence[Sequence[int]], params: SamplingParams, fresh: bool = True) -> Measurement:
        """`fresh`: forget the tokens the last call left in llama.cpp's cache; otherwise
        llama-cpp-python reuses their longest common prefix with this prompt (its own)."""
        if len(batch) > 1:
            raise PeerSkipped("the llama.cpp peer runs batch size 1 only")
        if fresh:
            self.llm.reset()
        cached = _common_prefix(self.llm.eval_tokens, batch[0]) if self.llm.n_tokens else 0
        stream = self.llm.generate(
            list(batch[0]),
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=0.0,
            temp=params.temperature,
            repeat_penalty=1.0,
            reset=True,
        )
        tokens: list[int] = []
        t0 = time.perf_counter()
        t_first = None
        finish = "length"
        for tok in stream:
            if t_first is None:
                t_first = time.perf_counter()
            tokens.append(int(tok))
            if not params.ignore_eos and tok in self.eos_ids:
                finish = "eos"
                break
            if len(tokens) >= params.max_new_tokens:
                break
        t_end = time.perf_counter()
        t_first = t_first or t_end
        return Measurement(
            self.name,
            [tokens],
            [finish],
            t_first - t0,
            t_end - t_first,
            max(len(tokens) - 1, 0),
            prompt_tokens=len(batch[0]),
            cached_tokens=min(cached, len(batch[0]) - 1),
        )

    def close(self) -> None:
        self.llm = None


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _make_gguf_draft(path: str, k: int, n_ctx: int):
    import numpy as np
    from llama_cpp.llama_speculative import LlamaDraftModel

    from ssdlocal.backends.llamacpp.lib import high_level_llama

    class GGUFDraft(LlamaDraftModel):
        def __init__(self) -> None:
            self.llm = high_level_llama(model_path=path, n_ctx=n_ctx, verbose=False)

        def __call__(self, input_ids, /, **kwargs):
            out = []
            for tok in self.llm.generate(list(map(int, input_ids)), temp=0.0, top_k=1, reset=True):
                out.append(int(tok))
                if len(out) >= k:
                    break
            return np.array(out, dtype=np.intc)

    return GGUFDraft()


def make_peers(
    names: Sequence[str], opts: PeerOptions, eos_ids: frozenset[int], pad_id: int
) -> tuple[list, dict[str, str]]:
    """Build the requested peers; return (peers, {name: reason} for those skipped)."""
    peers, skipped = [], {}
    for name in names:
        if name.startswith("hf"):
            if name == "hf-assisted" and not opts.draft:
                skipped[name] = "skipped: no draft checkpoint"
                continue
            peers.append(HFPeer(name, opts, eos_ids, pad_id))
            continue
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            skipped[name] = "skipped: llama-cpp-python not installed (pip install 'ssdlocal[llamacpp]')"
            continue
        if not opts.gguf_target or (name == "llamacpp-assisted" and not opts.gguf_draft):
            skipped[name] = "skipped: pass --gguf-target (and --gguf-draft for llamacpp-assisted)"
            continue
        try:
            peers.append(LlamaCppPeer(name, opts, eos_ids))
        except Exception as exc:  # noqa: BLE001 - an optional peer must not sink the benchmark
            log.warning("llama.cpp peer %s failed to load: %s", name, exc)
            skipped[name] = f"skipped: llama.cpp failed to load ({exc})"
    return peers, skipped
