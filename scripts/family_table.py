"""The exactness table of every family on tiny random float32 checkpoints written with
transformers' own classes (the tests' tests/support/tiny_families.py), one row per family:

- logits: max |ours - transformers| over every position of two 12-token prompts, one
  masked forward and token by token through the cache;
- AR, SD (a noisy copy of the target as draft), SD with n-gram proposals, SSD: greedy
  tokens equal to transformers' generate (2 prompts x 24 tokens) with no draft loss (a
  draft that fails hands its rows to plain steps), eager and traced;
- traced: target graphs captured / replayed / run eagerly in an AR call, and host waits
  per round;
- TP=2: two tensor-parallel ranks in traced graphs equal one device (AR and SD);
- int8/int4: max |logits - the dequantized reference's| (the weights quantized, then
  dequantized into a float model).

Usage: PYTHONPATH=tests python scripts/family_table.py [--families gemma3,gpt_oss] [--no-tp]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.drafts import draft_of  # noqa: E402
from support.tiny_families import FAMILIES  # noqa: E402
from support.tiny_models import build_tokenizer, make_draft_like  # noqa: E402

from ssdlocal.backends.torch.loader import load_model  # noqa: E402
from ssdlocal.backends.torch.models import causal_mask  # noqa: E402
from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, NgramDraft, SamplingParams, SpecConfig  # noqa: E402
from ssdlocal.core.events import DoneEvent  # noqa: E402
from ssdlocal.engine import Engine  # noqa: E402

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "def fibonacci(n):\n    if n < 2:"]
NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)


def logits_diff(target: Path) -> float:
    """Max |ours - transformers| at every position, whole and step by step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target)
    ours = load_model(target, "cpu", "float32").model
    ids = torch.tensor([tok(p).input_ids[:12] for p in PROMPTS])
    B, T = ids.shape
    pos = torch.arange(T)[None].repeat(B, 1)
    with torch.inference_mode():
        want = ref(ids).logits
        ours.setup_cache(B, 64, torch.float32, "cpu")
        whole = ours(ids, pos, pos, causal_mask(pos, T))
        ours.setup_cache(B, 64, torch.float32, "cpu")
        steps = torch.cat(
            [
                ours(ids[:, t : t + 1], pos[:, t : t + 1], pos[:, t : t + 1], causal_mask(pos[:, t : t + 1], T))
                for t in range(T)
            ],
            1,
        )
    return max((whole - want).abs().max().item(), (steps - want).abs().max().item())


def quantized_diff(target: Path, scheme: str) -> float:
    """Max |quantized logits - the dequantized reference's| (one 12-token forward): the
    reference is the float model with every quantized weight replaced by its dequantized
    values (experts and linears)."""
    from ssdlocal.backends.torch.quant import QuantLinear
    from ssdlocal.backends.torch.quant_experts import QuantStacked

    quant = load_model(target, "cpu", "float32", scheme).model
    reference = load_model(target, "cpu", "float32").model
    if reference.args.tie_word_embeddings:  # the quantized lm_head has codes of its own
        reference.lm_head.weight = torch.nn.Parameter(reference.lm_head.weight.clone())
    with torch.no_grad():
        for name, module in quant.named_modules():
            if isinstance(module, QuantStacked):
                reference.get_submodule(name).weight.copy_(module.dequantized())
            elif isinstance(module, QuantLinear):
                reference.get_submodule(name).weight.copy_(module.dequantize_rows(torch.arange(module.out_features)))
    ids = torch.tensor([[5, 17, 33, 2, 90, 41, 7, 12, 64, 3, 28, 51]])
    pos = torch.arange(12)[None]
    out = []
    with torch.inference_mode():
        for m in (quant, reference):
            m.setup_cache(1, 64, torch.float32, "cpu")
            out.append(m(ids, pos, pos, causal_mask(pos, 12)))
    return (out[0] - out[1]).abs().max().item()


def expected(target: Path) -> list[tuple[int, ...]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target)
    outs = []
    for p in PROMPTS:
        ids = torch.tensor([tok(p).input_ids])
        out = ref.generate(ids, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
        outs.append(tuple(out[0, ids.shape[1] :].tolist()))
    return outs


def run(engine: Engine, spec: SpecConfig) -> DoneEvent:
    return [e for e in engine.generate(PROMPTS, GREEDY, spec=spec) if isinstance(e, DoneEvent)][0]


def same(done: DoneEvent, want: list[tuple[int, ...]]) -> bool:
    """The call's tokens equal `want` and its draft never failed (rows that go on with
    plain steps after a draft loss give AR's tokens: equal, but the mode did not run)."""
    return done.stats.draft_losses == 0 and [o.token_ids for o in done.outputs] == want


def engine(target: Path, draft: Path, graphs: str, **kw) -> Engine:
    return Engine(
        EngineConfig(
            target=ModelSpec(str(target), dtype="float32"),
            spec=SpecConfig(mode=Mode.SD, k=3, draft=draft_of(str(draft))),
            graphs=graphs,
            **kw,
        )
    )


def row(name: str, target: Path, draft: Path, tp: bool) -> str:
    want = expected(target)
    modes = {
        "AR": SpecConfig(mode=Mode.AR),
        "SD": SpecConfig(mode=Mode.SD, k=3, draft=draft_of(str(draft))),
        "SD n-gram": SpecConfig(mode=Mode.SD, k=3, draft=NgramDraft()),
        "SSD": SpecConfig(mode=Mode.SSD, k=3, draft=draft_of(str(draft))),
    }
    cells = []
    for graphs in ("off", "trace"):
        with engine(target, draft, graphs) as e:
            equal = [m for m, spec in modes.items() if same(run(e, spec), want)]
            cells.append("all" if len(equal) == len(modes) else f"only {', '.join(equal) or 'none'}")
            if graphs == "trace":
                done = run(e, modes["AR"])
                g, w = done.stats["graphs"]["target"], done.stats["host_waits"]["target"]
                traced = f"{g['captured']}/{g['replays']}/{g['eager']}, {w['waits_per_round']:.2f}"
    tp_cell = "-"
    if tp:
        os.environ["SSDLOCAL_GRAPHS"] = "trace"
        try:
            with engine(target, draft, "auto", target_devices=("cpu", "cpu")) as two:
                ok = all(same(run(two, modes[m]), want) for m in ("AR", "SD"))
            tp_cell = "equal" if ok else "DIFFERS"
        finally:
            del os.environ["SSDLOCAL_GRAPHS"]
    quant = " / ".join(f"{quantized_diff(target, s):.1e}" for s in ("int8", "int4"))
    return f"| {name} | {logits_diff(target):.1e} | {cells[0]} | {cells[1]} | {traced} | {tp_cell} | {quant} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--no-tp", action="store_true")
    opts = ap.parse_args()
    torch.set_num_threads(1)
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in Path("/proc/cpuinfo").read_text()]
    print(f"# {platform.machine()}, flags {' '.join(flags)}, float32, greedy, {len(PROMPTS)} prompts x {NEW} tokens")
    print(
        "| family | logits max abs diff vs transformers | AR/SD/SD-ngram/SSD == transformers (eager) | same, traced | traced AR: graphs captured/replayed/eager, host waits per round | TP=2 traced == one device | int8 / int4 vs dequantized |"
    )
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tok = root / "tokenizer"
        build_tokenizer(tok)
        for name in opts.families.split(","):
            make, _ = FAMILIES[name]
            target = make(root / name, tok)
            draft = make_draft_like(target, root / f"draft_{name}", noise=0.004, seed=31)
            print(row(name, target, draft, not opts.no_tp), flush=True)


if __name__ == "__main__":
    main()
