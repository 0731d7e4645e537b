"""The exact joint distribution of a call's first three tokens, for the sampling tests.

`ExactJoint` computes p(t1) p(t2 | t1) p(t3 | t1, t2) from the target's logits with
transformers (an independent implementation of the same checkpoint), each conditional
warped by `logits_to_probs` exactly as the engine warps p; `sample_outputs` draws N
samples of a prompt in one batch. N, K, PROMPT, T1 and FAN are the settings the sampling
tests share (test_engine_sampling.py says why these values).
"""

from __future__ import annotations

import numpy as np
import torch

from ssdlocal.core.config import SamplingParams, SpecConfig
from ssdlocal.core.events import DoneEvent, RoundEvent
from ssdlocal.core.sampling import logits_to_probs

N = 2500
K = 2
PROMPT = "The quick brown fox"
T1 = SamplingParams(temperature=1.0, max_new_tokens=3, ignore_eos=True)
FAN = (5, 2, 1)  # F_0..F_K: many candidates after a first-draft rejection


class ExactJoint:
    """Exact distribution of (t1, t2, t3) for one set of sampling params, as categories.

    `allowed(generated, vocab)` (optional): a bool [V] mask of the tokens allowed after the
    generated tokens `generated` (a grammar); the target's logits outside it are -inf
    before the params warp them, as the engine's constrained rows do."""

    def __init__(self, target_dir, prompt_ids: list[int], params: SamplingParams, n: int, allowed=None):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()

        @torch.no_grad()
        def next_probs(generated: list[list[int]]) -> torch.Tensor:  # -> [P, V]
            ids = torch.tensor([prompt_ids + g for g in generated], dtype=torch.long)  # [P, L] (all the same length)
            logits = model(input_ids=ids).logits[:, -1].float()  # [P, V]
            if allowed is not None:
                masks = torch.stack([allowed(g, logits.shape[-1]) for g in generated])  # [P, V]
                logits = logits.masked_fill(~masks, float("-inf"))
            return logits_to_probs(logits, params).double()

        threshold = 1.0 / n
        p1 = next_probs([[]])[0]  # [V]
        firsts = [t for t in range(p1.numel()) if p1[t] >= threshold]
        p2 = next_probs([[t] for t in firsts])  # [F, V]
        pairs: list[tuple[int, int]] = []
        pair_probs: list[float] = []
        for i, t1 in enumerate(firsts):
            for t2 in range(p2.shape[1]):
                joint = float(p1[t1] * p2[i, t2])
                if joint >= threshold:
                    pairs.append((t1, t2))
                    pair_probs.append(joint)
        p3 = next_probs([list(pair) for pair in pairs])  # [P, V]
        self.vocab = p3.shape[1]
        self.pair_index = {pair: i for i, pair in enumerate(pairs)}
        triple = torch.tensor(pair_probs, dtype=torch.float64).unsqueeze(1) * p3  # [P, V]
        flat = triple.reshape(-1).numpy()
        other = max(0.0, 1.0 - float(flat.sum()))
        self.probs = np.append(flat, other)  # categories: pair_i * V + t3, then "other"
        self.other = len(pairs) * self.vocab

    def categories(self, outputs) -> np.ndarray:
        out = np.empty(len(outputs), dtype=np.int64)
        for j, o in enumerate(outputs):
            t1, t2, t3 = o.token_ids
            i = self.pair_index.get((t1, t2))
            out[j] = self.other if i is None else i * self.vocab + t3
        return out


def sample_outputs(engine, spec: SpecConfig, params: SamplingParams):
    """N independent samples: one batch of the prompt repeated N times."""
    rounds, done = [], None
    for ev in engine.generate([PROMPT] * N, params, spec=spec):
        if isinstance(ev, RoundEvent):
            rounds.append(ev)
        elif isinstance(ev, DoneEvent):
            done = ev
    assert done is not None and len(done.outputs) == N
    assert all(len(o.token_ids) == 3 for o in done.outputs)
    return done, rounds
