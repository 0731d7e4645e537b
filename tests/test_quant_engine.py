"""Quantized targets end to end: greedy SD and SSD equal AR on the same quantized target
(fp32 activations, int8 and int4, Llama / Qwen2 / Qwen3, the SSD worker loading a
quantized draft), a tensor-parallel quantized target equals TP=1, SD and SSD samples
follow the quantized target's exact distribution (chi-square), and the CLI options.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from support.cli import assert_clean_error, run_cli

from ssdlocal.core.config import (
    EngineConfig,
    Mode,
    ModelSpec,
    SamplingParams,
    SpecConfig,
)
from ssdlocal.core.errors import UsageError
from ssdlocal.core.events import DoneEvent
from ssdlocal.engine import Engine
from support.drafts import draft_of
from ssdlocal.core.config import ModelDraft, NgramDraft

PROMPTS = ["hello world, def foo(x):", "Once upon a time there was a little model that"]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
DRAFTS = {"llama": "draft_llama", "qwen2": "draft_qwen2", "qwen3": "draft_llama"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


def tokens(engine: Engine, spec: SpecConfig, prompts=PROMPTS, params=GREEDY):
    done = [e for e in engine.generate(prompts, params, spec=spec) if isinstance(e, DoneEvent)]
    return [o.token_ids for o in done[0].outputs], done[0].stats


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_sd_and_ssd_equal_ar_on_quantized_target(tiny_dir, arch, scheme):
    target, draft = str(tiny_dir[arch]), str(tiny_dir[DRAFTS[arch]])
    cfg = EngineConfig(
        target=ModelSpec(target, quantization=scheme, dtype="float32"),
        spec=SpecConfig(
            mode=Mode.SSD, k=3, draft=ModelDraft(ModelSpec(draft, quantization=scheme, dtype="float32"))
        ),  # the SSD worker loads it quantized
        pin_cpus=False,
    )
    with Engine(cfg) as eng:
        assert eng.target.quantization == scheme
        ar, _ = tokens(eng, SpecConfig(mode=Mode.AR))
        sd, sd_stats = tokens(eng, SpecConfig(mode=Mode.SD, k=3, draft=cfg.spec.draft))
        ssd, ssd_stats = tokens(
            eng, SpecConfig(mode=Mode.SSD, k=3, draft=cfg.spec.draft, fan_out=(2, 2, 1, 2), fan_out_miss=(2, 2, 1, 2))
        )
        ngram, _ = tokens(eng, SpecConfig(mode=Mode.SD, k=3, draft=NgramDraft()))
    assert sd == ar and ssd == ar and ngram == ar
    assert ssd_stats["rounds"] > 0
    if arch != "qwen3":  # a noisy copy of the target (qwen3 borrows the unrelated llama draft)
        assert sd_stats["acceptance_rate"] > 0.1


def test_quantized_target_float_draft_and_unquantized_target_differ(tiny_dir):
    """--draft-quantization none: a float draft proposes for an int4 target; the int4
    target's own tokens (AR) are what SD reproduces, and they are not the float ones."""
    target, draft = str(tiny_dir["llama"]), str(tiny_dir["draft_llama"])
    long = replace(GREEDY, max_new_tokens=40)
    outs = {}
    for scheme in ("none", "int4"):
        cfg = EngineConfig(
            target=ModelSpec(target, quantization=scheme, dtype="float32"),
            spec=SpecConfig(mode=Mode.SD, k=3, draft=ModelDraft(ModelSpec(draft, dtype="float32"))),
            pin_cpus=False,
        )
        with Engine(cfg) as eng:
            ar, _ = tokens(eng, SpecConfig(mode=Mode.AR), params=long)
            sd, _ = tokens(eng, SpecConfig(mode=Mode.SD, k=3, draft=draft_of(draft)), params=long)
        assert sd == ar
        outs[scheme] = ar
    assert outs["none"] != outs["int4"]  # 4-bit weights change some greedy choices here


@pytest.mark.parametrize("scheme", ["int8", "int4", "gguf"])
def test_tp2_quantized_equals_tp1(tiny_dir, tmp_path, monkeypatch, scheme):
    """Safetensors quantized while loading, and a Q4_K_M GGUF's cached int4 checkpoint
    (quantized embedding, int4 column slices of o_proj/down_proj read from the cache)."""
    path, quantization = str(tiny_dir["qwen2"]), scheme
    if scheme == "gguf":
        from support import tiny_gguf

        monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path / "cache"))  # read by the ranks too
        model = tiny_gguf.make_hf_model("qwen2", seed=4, tie=True)
        path, quantization = str(tiny_gguf.write_gguf(tmp_path / "t.gguf", model, "qwen2", "q4_k_m")), "auto"

    def cfg(devices):
        return EngineConfig(
            target=ModelSpec(path, quantization=quantization, dtype="float32"), pin_cpus=False, target_devices=devices
        )

    with Engine(cfg(())) as one:
        want, _ = tokens(one, SpecConfig(mode=Mode.AR))
    with Engine(cfg(("cpu", "cpu"))) as two:
        shard = two.runner.model.shard
        assert type(shard.layers[0].self_attn.o_proj).__name__ == "QuantLinear"
        assert shard.layers[0].self_attn.o_proj.reduce  # row-parallel: partial sums all-reduced
        got, _ = tokens(two, SpecConfig(mode=Mode.AR))
    assert got == want


# --------------------------------------------------------------------------- sampling


@pytest.fixture(scope="module")
def quantized_models(tiny_dir, tmp_path_factory):
    """(target dir, draft dir, reference dir): the low-entropy pair (tiny_models), and a
    float copy holding the int4 target's dequantized weights."""
    from support.quant import dequantized_copy
    from support.tiny_models import make_low_entropy_pair

    from ssdlocal.backends.torch.loader import load_model

    target, draft = make_low_entropy_pair(tiny_dir["llama"], tmp_path_factory.mktemp("quant-lowent"))
    quant = load_model(target, "cpu", "float32", "int4")
    reference = dequantized_copy(target, tmp_path_factory.mktemp("deq") / "ref", quant)
    return target, draft, reference


@pytest.fixture(scope="module")
def sampling_engine(quantized_models):
    target, draft, _ = quantized_models
    cfg = EngineConfig(
        target=ModelSpec(str(target), quantization="int4", dtype="float32"),
        spec=SpecConfig(mode=Mode.SD, k=2, draft=ModelDraft(ModelSpec(str(draft), dtype="float32"))),
        pin_cpus=False,
    )
    with Engine(cfg) as eng:
        yield eng


@pytest.mark.parametrize("mode", ["ssd"])  # SSD: cache hits, and SD (jit backup) on misses
def test_sampling_matches_quantized_target_distribution(sampling_engine, quantized_models, mode):
    from support import exact as ts
    from support.stats import assert_distribution

    _, draft, reference = quantized_models
    params = replace(ts.T1, seed=7 if mode == "sd" else 8)
    prompt_ids = sampling_engine.encode(ts.PROMPT, chat=False)
    joint = ts.ExactJoint(reference, prompt_ids, params, ts.N)
    if mode == "sd":
        spec = SpecConfig(mode=Mode.SD, k=ts.K, draft=sampling_engine.config.spec.draft)
    else:
        spec = SpecConfig(
            mode=Mode.SSD,
            k=ts.K,
            draft=sampling_engine.config.spec.draft,
            fan_out=ts.FAN,
            fan_out_miss=ts.FAN,
            backup="jit",
        )
    done, _ = ts.sample_outputs(sampling_engine, spec, params)
    assert 0.2 < done.stats["acceptance_rate"] < 0.95
    assert_distribution(joint.categories(done.outputs), joint.probs, what=f"int4 {mode}")


# --------------------------------------------------------------------------- options


def test_model_spec_quantization_rules():
    assert ModelSpec("x", dtype="float32").quantization == "none"
    with pytest.raises(UsageError, match="quantization"):
        ModelSpec("x", quantization="int3", dtype="float32")
    with pytest.raises(UsageError, match="torch backend"):
        ModelSpec("x.gguf", backend="llamacpp", quantization="int4", dtype="float32")
    assert ModelSpec("x.gguf", backend="llamacpp", quantization="auto", dtype="float32").quantization == "auto"


def test_cli_generate_quantized(tiny_dir, monkeypatch, capsys):
    import json

    args = [
        "generate",
        "hello",
        "--target",
        tiny_dir["llama"],
        "--mode",
        "ar",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "6",
        "--json",
    ]
    code, out, err = run_cli(monkeypatch, capsys, *args, "--quantization", "int4")
    assert code == 0, err
    assert len(json.loads(out)["outputs"][0]["token_ids"]) == 6
    code, _, err = run_cli(monkeypatch, capsys, *args, "--quantization", "int5")
    assert_clean_error(code, err, 2, "int5", "none, int8, int4, auto")


def test_cli_resolves_draft_quantization(tiny_dir):
    from ssdlocal.cli.resolve import ModelOptions, SpecOptions, engine_config

    models = ModelOptions(target=str(tiny_dir["llama"]), draft=str(tiny_dir["draft_llama"]), quantization="int4")
    cfg = engine_config(models, SpecOptions(mode="sd"))
    assert cfg.target.quantization == cfg.draft_model.quantization == "int4"
    cfg = engine_config(replace(models, draft_quantization="int8"), SpecOptions(mode="sd"))
    assert (cfg.target.quantization, cfg.draft_model.quantization) == ("int4", "int8")
    assert ModelOptions(quantization="int4", draft_backend="llamacpp").quantizations(("torch", "llamacpp")) == (
        "int4",
        "auto",
    )


def test_pairs_and_planner_size_quantized_weights(monkeypatch, capsys, tiny_dir):
    import json

    from ssdlocal.weights.size import checkpoint_gb
    from ssdlocal.weights.pairs import get_pair

    offline = get_pair("qwen2.5-coder-1.5b-offline")
    assert offline.schemes("auto") == ("int4", "int4") and get_pair("qwen2.5-7b").schemes("auto") == ("none",) * 2
    bf16_t, _ = offline.memory_gb("torch", "none")
    int4_t, _ = offline.memory_gb("torch", "auto")
    int8_t, _ = offline.memory_gb("torch", "int8")
    # 1.54B parameters at 0.625 bytes + the GGUF's 0.23B embedding, still quantized (<= int8)
    assert bf16_t == 3.1 and int4_t == pytest.approx(1.54 * 0.625 + 0.23 * 1, abs=0.01) and int4_t < int8_t < bf16_t
    assert get_pair("qwen2.5-7b").memory_gb("torch", "int4")[0] == pytest.approx(7.6 * 0.625 + 0.55 * 2, abs=0.01)
    code, out, err = run_cli(monkeypatch, capsys, "pairs", "--json", "--quantization", "int4")
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["llama-3.1-70b"]["quantization"] == "int4"
    assert rows["llama-3.1-70b"]["target_gb"] < 0.35 * get_pair("llama-3.1-70b").target.bf16_gb
    code, _, err = run_cli(monkeypatch, capsys, "devices", "--quantization", "int9")
    assert_clean_error(code, err, 2, "int9")
    path = tiny_dir["qwen2"]
    assert checkpoint_gb(path, "float32", "int4") < 0.5 * checkpoint_gb(path, "float32")  # tied: fp32 embedding
    assert checkpoint_gb(path, "float32", "auto") == checkpoint_gb(path, "float32")


def test_check_and_bench_on_quantized_target(monkeypatch, capsys, tiny_dir, tmp_path):
    import json

    pair = ["--target", tiny_dir["qwen2"], "--draft", tiny_dir["draft_qwen2"], "--max-new-tokens", "10"]
    code, out, err = run_cli(monkeypatch, capsys, "check", *pair, "--k", "3", "--quantization", "int4", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["identical"] is True and [r["mode"] for r in report["runs"]] == ["ar", "sd", "ssd"]
    code, _, err = run_cli(
        monkeypatch,
        capsys,
        "bench",
        *pair,
        "--dtype",
        "float32",
        "--no-chat",
        "--no-pin",
        "--limit",
        "1",
        "--modes",
        "ar,sd",
        "--quantization",
        "int8",
        "--draft-quantization",
        "none",
        "--out",
        tmp_path,
    )
    assert code == 0, err
    settings = json.loads((tmp_path / "results.json").read_text())["settings"]
    assert (settings["quantization"], settings["draft_quantization"]) == ("int8", "none")
    assert "weights int8" in (tmp_path / "results.md").read_text()


def test_pull_prepares_the_quantized_cache(monkeypatch, capsys, tmp_path):
    """`pull` of the offline (GGUF) pair builds what `generate --quantization auto` loads."""
    from support import tiny_gguf

    from ssdlocal.weights import assets

    model = tiny_gguf.make_hf_model("qwen2", seed=5, tie=True)
    files = {
        name: tiny_gguf.write_gguf(tmp_path / f"{name}.gguf", model, "qwen2", "q4_k_m")
        for name in (assets.DEFAULT_TARGET, assets.DEFAULT_DRAFT)
    }
    monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(assets, "fetch_gguf", lambda name, progress=None, cache=None: files[name])
    monkeypatch.setattr(assets, "ensure_default_pair", lambda *a, **k: pytest.fail("bf16 conversion"))
    code, out, err = run_cli(monkeypatch, capsys, "pull", "qwen2.5-coder-1.5b-offline")
    assert code == 0, err
    root = tmp_path / "cache" / "quantized"
    for role, name in (("target", assets.DEFAULT_TARGET), ("draft", assets.DEFAULT_DRAFT)):
        (built,) = [d for d in root.glob(f"{name}-int4-bfloat16-*") if d.is_dir()]
        assert f"{role}: {built}" in out and (built / "quantization.json").is_file()
