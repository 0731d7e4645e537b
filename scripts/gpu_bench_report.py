"""Parts of scripts/gpu_bench.py: the end-to-end Engine run, the projections, the Markdown."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path


from ssdlocal.speculation.projection import sd_speedup
from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.core.events import DoneEvent
from ssdlocal.core.config import ModelDraft  # noqa: E402


def save_checkpoint(loaded, out: Path) -> Path:
    """A random in-memory model as an HF-style checkpoint (Qwen2 config, a small tokenizer)."""
    from safetensors.torch import save_file
    from support.tiny_models import build_tokenizer
    from transformers import Qwen2Config

    a = loaded.args
    out.mkdir(parents=True, exist_ok=True)
    Qwen2Config(
        vocab_size=a.vocab_size,
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_layers,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads,
        max_position_embeddings=a.max_position_embeddings,
        rms_norm_eps=a.rms_norm_eps,
        rope_theta=a.rope_theta,
        tie_word_embeddings=a.tie_word_embeddings,
        architectures=["Qwen2ForCausalLM"],
        eos_token_id=0,
    ).save_pretrained(out)
    state = {}
    for name, tensor in loaded.model.state_dict().items():
        if name == "lm_head.weight" and a.tie_word_embeddings:
            continue
        state[name if name.startswith("lm_head") else f"model.{name}"] = tensor.contiguous().cpu()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    build_tokenizer(out)
    return out


def end_to_end(names, device, dtype, quick: bool, random_model) -> dict:
    """AR, SD and SSD through the Engine on the first two shapes (draft, target), both on
    `device`, the SSD draft in its own process. Random weights: acceptance is near zero."""
    results = {}
    dtype_name = str(dtype).removeprefix("torch.")
    with tempfile.TemporaryDirectory(prefix="ssdlocal_gpu_bench_") as tmp:
        paths = {}
        for name in names:
            loaded = random_model(name, device, dtype)
            paths[name] = str(save_checkpoint(loaded, Path(tmp) / name))
            del loaded
        draft, target = paths[names[0]], paths[names[1]]
        dev = str(device)
        config = EngineConfig(
            ModelSpec(target, dev, dtype_name),
            SpecConfig(mode=Mode.SSD, k=4, draft=ModelDraft(ModelSpec(draft, dev, dtype_name))),
            pin_cpus=False,
        )
        params = SamplingParams(max_new_tokens=16 if quick else 64, ignore_eos=True)
        from ssdlocal.engine import Engine

        with Engine(config) as engine:
            for mode in (Mode.AR, Mode.SD, Mode.SSD):
                spec = SpecConfig(
                    mode=mode,
                    k=4,
                    draft=config.spec.draft,
                    fan_out=(1, 1, 1, 1, 2),
                    fan_out_miss=(1, 1, 1, 1, 2),
                    backup="jit",
                )
                for _ in range(2):  # the first run pays captures and allocations
                    done = [
                        e for e in engine.generate([list(range(1, 65))], params, spec=spec) if isinstance(e, DoneEvent)
                    ][0]
                s = done.stats
                rounds = max(1, s["rounds"])
                results[mode.value] = {
                    "tokens_per_s": s["tokens_per_s"],
                    "rounds": s["rounds"],
                    "verify_ms_per_round": s["verify_ms"] / rounds,
                    "draft_ms_per_round": s["draft_ms"] / rounds,
                    "draft_busy_ms_per_round": (s.get("draft_busy_ms") or 0.0) / rounds,
                    "acceptance_rate": s.get("acceptance_rate"),
                    "cache_hit_rate": s.get("cache_hit_rate"),
                }
                print(f"  end to end {mode.value}: {results[mode.value]}", flush=True)
    return {"target": names[1], "draft": names[0], "modes": results}


def projections(results: dict, rates_path: Path, k: int) -> dict:
    """Projected speedups over AR from measured GPU costs and CPU-measured rates."""
    if not rates_path.is_file():
        return {"label": f"no rates file {rates_path}: projections skipped", "rows": []}
    rates = json.loads(rates_path.read_text())
    models = {m["model"]: m for m in results["models"]}
    draft = results["models"][0]
    rows = []
    for name, sd_ms in results["sd_rounds"].items():
        t = models[name]
        t1, tk = t["T1_graphs_ms"], t[f"T{k + 1}_graphs_ms"]
        td = draft["T1_graphs_ms"]
        width = min((w for w in (8, 16, 32) if f"tree{w}_graphs_ms" in draft), default=1)
        t_prespec = td + k * draft.get(f"tree{width}_graphs_ms", td)  # one feed + K tree steps
        e_sd, p_hit = rates["mean_accepted_len_sd"], rates["cache_hit_rate"]
        e_hit, e_miss = rates["tokens_per_round_hit"], rates["tokens_per_round_miss"]
        sd = e_sd * t1 / (k * td + tk)
        ssd_tokens = p_hit * e_hit + (1 - p_hit) * e_miss
        ssd_time = p_hit * max(tk, t_prespec) + (1 - p_hit) * (tk + k * td)
        rows.append(
            {
                "target": name,
                "draft_target_ratio": td / t1,
                "sd_vs_ar_formula": sd_speedup(e_sd, k, td / t1),
                "sd_vs_ar": sd,
                "sd_vs_ar_measured_round": e_sd * t1 / sd_ms,
                "ssd_vs_ar_draft_own_gpu": ssd_tokens * t1 / ssd_time,
                "prespec_ms": t_prespec,
            }
        )
    label = (
        f"projection (not measured): rates from {rates.get('source', rates_path.name)}; "
        "GPU costs measured above; SSD assumes the draft on a GPU of its own"
    )
    return {"label": label, "rates": rates, "rows": rows}


def _f(value, fmt="{:.2f}") -> str:
    return "–" if value is None else fmt.format(value)


def write_markdown(results: dict, path: Path) -> None:
    k = results["k"]
    lines = [
        f"# ssdlocal GPU bench ({results['device']}, torch {results['torch']}, {results['dtype']})",
        "",
        f"Device copy bandwidth: {results['copy_bandwidth_gb_s']:.0f} GB/s. Random weights in real "
        "shapes; latencies are medians of one forward after a 512-token prompt (ms).",
        "",
        f"| model | weights GB | bandwidth limit | T=1 eager | T=1 graphs | T={k + 1} eager | "
        f"T={k + 1} graphs | T=1 graphs / limit | T={k + 1} / T=1 | eager / graphs (T=1) | AR tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in results["models"]:
        lim, g1, gk, e1 = m["bandwidth_limit_ms"], m["T1_graphs_ms"], m[f"T{k + 1}_graphs_ms"], m["T1_eager_ms"]
        lines.append(
            f"| {m['model']} | {m['weight_gb']:.2f} | {lim:.2f} | {e1:.2f} | {g1:.2f} | "
            f"{m[f'T{k + 1}_eager_ms']:.2f} | {gk:.2f} | {g1 / lim:.2f}x | {gk / g1:.2f}x | "
            f"{e1 / g1:.2f}x | {m['ar_tok_s']:.0f} |"
        )
    draft = results["models"][0]
    widths = [w for w in (1, 2, 4, 8, 16, 32) if f"tree{w}_graphs_ms" in draft]
    lines += [
        "",
        f"Draft ({draft['model']}) tree step by branch width (ms):",
        "",
        "| width | " + " | ".join(map(str, widths)) + " |",
        "|---" * (len(widths) + 1) + "|",
    ]
    for label in ("eager", "graphs"):
        lines.append(f"| {label} | " + " | ".join(f"{draft[f'tree{w}_{label}_ms']:.2f}" for w in widths) + " |")
    lines += ["", "SD round (K draft steps + K+1 verify + on-device verify + one host read), ms:", ""]
    lines += [f"- {name} + {draft['model']}: {ms:.2f}" for name, ms in results["sd_rounds"].items()]
    e2e = results["end_to_end"]
    lines += [
        "",
        f"End to end through the Engine ({e2e['target']} + {e2e['draft']}, random weights: "
        "acceptance near zero, so SD/SSD emit about one token per round; SSD shows the "
        "overlap machinery, its draft in a second process on the same GPU):",
        "",
        "| mode | tok/s | verify ms/round | draft ms/round | draft busy ms/round | accept | cache hit |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, r in e2e["modes"].items():
        lines.append(
            f"| {mode} | {_f(r['tokens_per_s'])} | {_f(r['verify_ms_per_round'])} | "
            f"{_f(r['draft_ms_per_round'])} | {_f(r['draft_busy_ms_per_round'])} | "
            f"{_f(r['acceptance_rate'], '{:.0%}')} | {_f(r['cache_hit_rate'], '{:.0%}')} |"
        )
    proj = results["projections"]
    lines += ["", f"**{proj['label']}**", ""]
    if proj["rows"]:
        lines += [
            "| target | draft/target | SD vs AR | SD vs AR (measured round) | SSD vs AR (draft on own GPU) |",
            "|---|---|---|---|---|",
        ]
        for r in proj["rows"]:
            lines.append(
                f"| {r['target']} | {r['draft_target_ratio']:.3f} | {r['sd_vs_ar']:.2f}x | "
                f"{r['sd_vs_ar_measured_round']:.2f}x | {r['ssd_vs_ar_draft_own_gpu']:.2f}x |"
            )
    lines += ["", f"Wall time {results.get('wall_s', 0):.0f} s.", ""]
    path.write_text("\n".join(lines))
