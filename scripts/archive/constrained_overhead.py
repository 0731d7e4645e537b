"""What a grammar costs the engine, per mode, on the same prompt and (for `anything`) the same tokens.

    python scripts/archive/constrained_overhead.py --tokens 48 --repeats 3

Loads the built-in pair from ~/.cache/ssdlocal/gguf (torch backend, the GGUFs' own int4)
once and runs, interleaved, greedy: AR, SD (the 0.5B draft, K=4 pinned, drafts masked by the
grammar; with --unmasked-drafts also not masked, as SSD's worker drafts) and n-gram SD (K=4),
each with no grammar, with `anything` (a grammar that allows
every text: the same tokens as no grammar, so the difference is the machinery: matcher walks,
masks, applying them) and with a JSON schema (the answer changes: JSON only). Prints, per mode
and grammar: decode tok/s (wall), process CPU ms per token (all threads; steadier than wall
time on a shared machine), the grammar's own ms per token (engine stats), acceptance, and
the ratios to no grammar and of SD to AR.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


GGUF = Path("~/.cache/ssdlocal/gguf").expanduser()
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "birth_year": {"type": "integer"},
        "city": {"type": "string"},
        "occupations": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "birth_year", "city", "occupations"],
    "additionalProperties": False,
}
ASK = (
    "Extract the person from: 'Ada Lovelace, born 1815 in London, was a mathematician and writer.' "
    "Reply with JSON only, with the keys name, birth_year, city and occupations (a list)."
)


def main() -> int:
    from ssdlocal.core.config import EngineConfig, Mode, ModelDraft, ModelSpec, NgramDraft, SamplingParams, SpecConfig
    from ssdlocal.core.events import DoneEvent, TokensEvent
    from ssdlocal.engine import Engine
    from ssdlocal.grammar.compiler import GrammarCompiler

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(GGUF / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"))
    ap.add_argument("--draft", default=str(GGUF / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (1 is steadier on a shared machine)")
    ap.add_argument(
        "--unmasked-drafts",
        action="store_true",
        help="also SD with the draft model not masked by the grammar (what SSD's worker does)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    draft = ModelDraft(ModelSpec(args.draft, quantization="auto"), suffix=None)
    config = EngineConfig(ModelSpec(args.target, quantization="auto"), SpecConfig(mode=Mode.SD, k=4, draft=draft))
    specs = {
        "ar": SpecConfig(mode=Mode.AR),
        "sd": SpecConfig(mode=Mode.SD, k=4, draft=draft),
        "ngram": SpecConfig(mode=Mode.SD, k=4, draft=NgramDraft()),
    }
    if args.unmasked_drafts:
        specs["sd_unmasked_drafts"] = specs["sd"]
    rows: dict[tuple[str, str], list[dict]] = {}
    with Engine(config) as engine:
        compiler = GrammarCompiler(engine.tokenizer, engine.target.args.vocab_size, engine.eos_ids)
        grammars = {"none": None, "anything": compiler.regex(r"(.|\n)*"), "json_schema": compiler.json_schema(PERSON)}
        prompt = engine.encode(ASK, chat=True)
        params = SamplingParams(max_new_tokens=args.tokens)
        for _ in range(args.repeats):
            for mode, spec in specs.items():
                for name, grammar in grammars.items():
                    cpu0, done = None, None
                    _mask_drafts(mode != "sd_unmasked_drafts")
                    for ev in engine.generate([prompt], params, spec=spec, grammars=[grammar]):
                        if isinstance(ev, TokensEvent) and cpu0 is None:
                            cpu0 = time.process_time()  # decode starts after the first token
                        elif isinstance(ev, DoneEvent):
                            done, cpu1 = ev, time.process_time()
                    s = done.stats
                    rows.setdefault((mode, name), []).append(
                        {
                            "tokens_per_s": s["tokens_per_s"],
                            "cpu_ms_per_token": (cpu1 - cpu0) * 1e3 / s["decode_tokens"],
                            "grammar_ms_per_token": s.get("mask_ms_per_token") or 0.0,
                            "acceptance_rate": s.get("acceptance_rate"),
                            "tokens": done.outputs[0].token_ids,
                        }
                    )
                    print(mode, name, round(s["tokens_per_s"], 2), flush=True)
    table = {}
    for (mode, name), runs in rows.items():
        med = lambda k: statistics.median(r[k] for r in runs) if runs[0][k] is not None else None  # noqa: E731
        table[f"{mode}/{name}"] = {
            k: med(k) for k in ("tokens_per_s", "cpu_ms_per_token", "grammar_ms_per_token", "acceptance_rate")
        }
        table[f"{mode}/{name}"]["same_tokens_as_none"] = runs[0]["tokens"] == rows[(mode, "none")][0]["tokens"]
    for mode in specs:
        for name in grammars:
            entry, base = table[f"{mode}/{name}"], table[f"{mode}/none"]
            entry["tok_s_vs_none"] = entry["tokens_per_s"] / base["tokens_per_s"]
            entry["cpu_vs_none"] = entry["cpu_ms_per_token"] / base["cpu_ms_per_token"]
            entry["vs_ar_same_grammar"] = entry["tokens_per_s"] / table[f"ar/{name}"]["tokens_per_s"]
    text = json.dumps(table, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def _mask_drafts(on: bool) -> None:
    """SD's draft model masked by the grammar (the default), or not (as SSD's worker drafts)."""
    from ssdlocal.draft import sync

    if not hasattr(sync.ModelDrafter, "_original_init"):
        sync.ModelDrafter._original_init = sync.ModelDrafter.__init__
    original = sync.ModelDrafter._original_init

    def init(self, *a, guides=None, **kw):
        original(self, *a, guides=guides if on else None, **kw)

    sync.ModelDrafter.__init__ = init


if __name__ == "__main__":
    sys.exit(main())
