"""Acceptance of a Gemma 4 MTP assistant in ssdlocal against transformers' own assisted
generation, on the same tiny float32 models.

Builds the test suite's tiny Gemma 4 target whose greedy choice depends mostly on the
newest token and an assistant whose readout is fitted to it
(tests/support/tiny_heads.py: make_gemma4_predictable, make_gemma4_assistant), then per
prompt, batch 1, greedy, K drafts per round: ssdlocal's SD with `--draft <assistant>`,
transformers' `generate(..., assistant_model=...)` as it ships, and transformers' with the
candidate generator handed only the verified positions' keys (tests/support/hf_assisted.py
says why they differ after a rejection). It prints whether the tokens are equal (they
must be: all three are greedy decoding of the target) and each run's acceptance rate
(accepted drafts / drafted) and tokens per round. Counted over the rounds all
three ran in full: the last rounds, which each shortens to the tokens left its own way,
are left out.
Usage: python scripts/gemma4_assistant_accept.py [--k 3] [--tokens 48]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
from support.hf_assisted import hf_assisted  # noqa: E402
from support.tiny_heads import make_gemma4_assistant, make_gemma4_predictable  # noqa: E402
from support.tiny_models import build_tokenizer  # noqa: E402

from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig  # noqa: E402
from ssdlocal.core.events import DoneEvent, RoundEvent  # noqa: E402
from ssdlocal.core.models import HeadDraft  # noqa: E402
from ssdlocal.engine import Engine  # noqa: E402

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    if n < 2:",
    "hello",
    "Once upon a time, in a land far away,",
    "import numpy as np\nx = np.arange(10)",
]


def summary(accepted: list[int], k: int) -> tuple[float, float]:
    """(accepted drafts / drafted, tokens per round) over whole rounds."""
    return sum(accepted) / (k * len(accepted)), sum(a + 1 for a in accepted) / len(accepted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", action="store_true", help="print every run's accepted drafts per round")
    args = parser.parse_args()
    from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_tokenizer(root / "tokenizer")
        target_dir = make_gemma4_predictable(root / "target", root / "tokenizer")
        assistant_dir = make_gemma4_assistant(root / "assistant", target_dir, steps=120)
        target = Gemma4ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        assistant = Gemma4AssistantForCausalLM.from_pretrained(assistant_dir, dtype=torch.float32).eval()
        params = SamplingParams(temperature=0.0, max_new_tokens=args.tokens, ignore_eos=True)
        spec = SpecConfig(mode=Mode.SD, k=args.k, draft=HeadDraft(str(assistant_dir), "gemma4_assistant"))
        totals: dict[str, list[int]] = {"ssdlocal": [], "transformers": [], "transformers, verified keys": []}
        print(f"K = {args.k}, {args.tokens} new tokens per prompt, batch 1, greedy, float32")
        with Engine(EngineConfig(target=ModelSpec(str(target_dir), dtype="float32"))) as engine:
            for prompt in PROMPTS:
                events = list(engine.generate([prompt], params, spec=spec))
                ours = list(next(e for e in events if isinstance(e, DoneEvent)).outputs[0].token_ids)
                ar = list(
                    next(
                        e
                        for e in engine.generate([prompt], params, spec=SpecConfig(mode=Mode.AR))
                        if isinstance(e, DoneEvent)
                    )
                    .outputs[0]
                    .token_ids
                )
                rounds = [e.n_accepted[0] for e in events if isinstance(e, RoundEvent)]
                ids = list(engine.encode(prompt, chat=False))
                stock = hf_assisted(target, assistant, ids, args.k, args.tokens)
                fixed = hf_assisted(target, assistant, ids, args.k, args.tokens, fixed=True)
                equal = ours == ar == stock.tokens == fixed.tokens
                runs = {
                    "ssdlocal": rounds,
                    "transformers": stock.accepted,
                    "transformers, verified keys": fixed.accepted,
                }
                line, whole_rounds = [], min(map(len, runs.values())) - 1
                for name, accepted in runs.items():
                    whole = accepted[:whole_rounds]
                    totals[name] += whole
                    rate, per_round = summary(whole, args.k)
                    line.append(f"{name} {rate:.3f} / {per_round:.2f}")
                if args.rounds:
                    print(runs)
                print(f"{prompt[:24]!r:28} tokens equal (ours, AR, both transformers): {equal}; " + "; ".join(line))
        print("all prompts (acceptance rate / tokens per round):")
        for name, accepted in totals.items():
            rate, per_round = summary(accepted, args.k)
            print(f"  {name:28} {rate:.3f} / {per_round:.2f} over {len(accepted)} rounds")


if __name__ == "__main__":
    main()
