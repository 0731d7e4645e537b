"""GGUF files of a mixture-of-experts family through the torch backend: a tiny Qwen3-MoE
checkpoint written as `qwen3moe` GGUFs the way llama.cpp's converter writes them (experts
stacked [E, out, in], ggml dims [in, out, E]; support/tiny_gguf.py) in F32, Q8_0 and a
Q4_K_M-like mix.

- the float conversion of the F32 file gives the same logits as the source safetensors,
  bit for bit, and of every type the experts one by one exactly as gguf's own decoder;
- the int8 / int4 conversion quantizes each expert as a Linear: the loaded model equals the
  source model holding its de-quantized weights, each expert within the scheme's bound of
  gguf's decoding (Q4_K exactly), and the engine's AR == SD in traced graphs on it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ssdlocal.backends.torch.loader import load_model
from ssdlocal.backends.torch.models import causal_mask
from ssdlocal.backends.torch.quant import QuantLinear
from ssdlocal.backends.torch.quant_apply import QuantEmbedding
from ssdlocal.backends.torch.quant_experts import QuantStacked

gguf = pytest.importorskip("gguf")
from support import tiny_gguf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

IDS = torch.tensor([[5, 17, 200, 3, 99, 12, 40, 41, 42, 43, 100, 7]])
EXPERTS, WIDTH, HIDDEN = 8, 256, 256


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path_factory.getbasetemp() / "moe-cache"))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """{"source": checkpoint directory, mix: GGUF file} for f32, q8_0 and q4_k_m."""
    root = tmp_path_factory.mktemp("gguf-moe")
    source = tiny_gguf.make_moe_checkpoint(root / "source", seed=4, hidden=HIDDEN, width=WIDTH, experts=EXPERTS)
    files = {mix: tiny_gguf.write_moe_gguf(root / f"moe-{mix}.gguf", source, mix) for mix in ("f32", "q8_0", "q4_k_m")}
    return {"source": source, **files}


def _logits(model) -> torch.Tensor:
    t = IDS.shape[1]
    pos = torch.arange(t)[None]
    model.setup_cache(1, t, torch.float32, "cpu")
    with torch.inference_mode():
        return model(IDS, pos, pos, causal_mask(pos, t))  # [1, T, V]


def _gguf_experts(path) -> dict[str, np.ndarray]:
    """our stacked module -> gguf's own de-quantization [E, out, in] of its GGUF tensor."""
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        if "_exps." in t.name:
            layer, proj = t.name.split(".")[1], t.name.split(".")[2].removeprefix("ffn_").removesuffix("_exps")
            shape = tuple(int(d) for d in reversed(t.shape))  # ggml [in, out, E] -> [E, out, in]
            out[f"layers.{layer}.mlp.experts.{proj}_proj"] = gguf.quants.dequantize(t.data, t.tensor_type).reshape(
                shape
            )
    return out


def test_float_conversion_equals_the_source_checkpoint(moe):
    from safetensors import safe_open

    from ssdlocal.weights.formats.convert import ensure_converted

    out = ensure_converted(moe["f32"], dtype="float32")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())  # noqa: SIM118 - a reader, not a dict
    per_expert = {f"model.layers.{i}.mlp.experts.{e}.down_proj.weight" for i in range(2) for e in range(EXPERTS)}
    assert per_expert <= names and not any(n.endswith("experts.down_proj.weight") for n in names)
    assert "model.layers.1.mlp.gate.weight" in names  # the router
    config = json.loads((out / "config.json").read_text())
    assert config["moe_intermediate_size"] == WIDTH != config["intermediate_size"]  # from expert_feed_forward_length
    assert (config.get("num_experts") or config.get("num_local_experts")) == EXPERTS
    assert config["num_experts_per_tok"] == 2 and config["architectures"] == ["Qwen3MoeForCausalLM"]
    ours = load_model(out, "cpu", "float32")
    assert ours.args.moe_intermediate_size == WIDTH and ours.args.sparse_layers == (0, 1)
    assert torch.equal(_logits(ours.model), _logits(load_model(moe["source"], "cpu", "float32").model))


@pytest.mark.parametrize("mix", ["q8_0", "q4_k_m"])
def test_float_conversion_takes_each_expert_as_gguf_decodes_it(moe, mix):
    """Any ggml type: expert e of the stacked tensor is rows [e*out, (e+1)*out) of the file's
    [E*out, in] matrix (Q8_0; Q4_K for gate/up and Q6_K for down in the K-quant mix)."""
    from safetensors import safe_open

    from ssdlocal.weights.formats.convert import ensure_converted

    out = ensure_converted(moe[mix], dtype="float32")
    want = _gguf_experts(moe[mix])
    assert len(want) == 2 * 3
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for module, stacked in want.items():
            for e in range(EXPERTS):
                expert = module.replace(".experts.", f".experts.{e}.")
                np.testing.assert_array_equal(f.get_tensor(f"model.{expert}.weight").numpy(), stacked[e], module)


@pytest.mark.parametrize(("mix", "scheme"), [("q8_0", "int8"), ("q4_k_m", "int4")])
def test_quantized_gguf_equals_its_dequantized_reference(moe, mix, scheme):
    quant = load_model(moe[mix], "cpu", "float32", scheme)
    assert quant.quantization == scheme and quant.path.parent.name == "quantized"
    reference = load_model(moe["source"], "cpu", "float32").model
    want = _gguf_experts(moe[mix])
    kinds = set()
    with torch.no_grad():
        for name, module in quant.model.named_modules():
            if isinstance(module, QuantStacked):
                got = module.dequantized()  # [E, out, in]
                target = want[name]
                if scheme == "int8":  # one scale per row of each expert
                    bound = np.abs(target).max(-1, keepdims=True) / 254 + 1e-6
                elif name.endswith(("gate_proj", "up_proj")):  # Q4_K: the same values in another layout
                    bound = 1e-5 * np.abs(target).max()
                else:  # Q6_K re-quantized: half a step of each group's range
                    g = target.reshape(*target.shape[:2], -1, 32)
                    bound = np.repeat((g.max(-1) - g.min(-1)) / 30, 32, axis=-1) + 1e-6
                assert (np.abs(got.numpy() - target) <= bound).all(), name
                reference.get_submodule(name).weight.copy_(got)
                kinds.add("experts")
            elif isinstance(module, QuantLinear):
                reference.get_submodule(name).weight.copy_(module.dequantize_rows(torch.arange(module.out_features)))
                kinds.add("linear")
            elif isinstance(module, QuantEmbedding):
                reference.embed_tokens.weight.copy_(module(torch.arange(module.num_embeddings)))
                kinds.add("embedding")
    assert kinds == {"experts", "linear", "embedding"}
    torch.testing.assert_close(_logits(quant.model), _logits(reference), rtol=1e-4, atol=1e-4)


def test_the_engine_runs_a_quantized_moe_gguf_target_exactly_in_traced_graphs(moe):
    from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, NgramDraft, SamplingParams, SpecConfig
    from ssdlocal.core.events import DoneEvent
    from ssdlocal.engine import Engine

    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    prompts = ["the the the def", "he the"]
    answers = {}
    spec = SpecConfig(mode=Mode.AR, k=3, draft=NgramDraft())
    target = ModelSpec(str(moe["q4_k_m"]), dtype="float32", quantization="auto")
    for graphs in ("off", "trace"):
        with Engine(EngineConfig(target=target, spec=spec, graphs=graphs, pin_cpus=False)) as engine:
            for mode in (Mode.AR, Mode.SD):
                done = [
                    e
                    for e in engine.generate(prompts, params, spec=SpecConfig(mode=mode, k=3, draft=NgramDraft()))
                    if isinstance(e, DoneEvent)
                ][0]
                answers[graphs, mode] = [o.token_ids for o in done.outputs]
                if graphs == "trace":
                    stats = done.stats["graphs"]["target"]
                    assert stats["replays"] > 0 and stats["refused"] == stats["dropped"] == 0, stats
    assert len(set(map(str, answers.values()))) == 1, answers


@pytest.mark.parametrize("source", ["source", "q4_k_m"])
def test_a_step_reads_the_experts_its_tokens_touch(moe, source):
    """weights/size.step_bytes from headers (a checkpoint or a GGUF's int4 layout): every
    weight but the untied embedding's table, and of the experts the share a step of N tokens
    touches (core.reads); what `bench --project` divides by (bench/report.weight_reads)."""
    from ssdlocal.core.config import EngineConfig, ModelDraft, ModelSpec, SpecConfig
    from ssdlocal.bench.report import weight_reads
    from ssdlocal.core.reads import experts_touched
    from ssdlocal.weights.size import step_bytes, weight_bytes

    path, scheme = moe[source], "none" if source == "source" else "int4"
    model = load_model(path, "cpu", "float32", scheme).model
    sizes = {n: b.numel() * b.element_size() for n, b in [*model.named_parameters(), *model.named_buffers()]}
    experts = sum(v for n, v in sizes.items() if ".experts." in n)
    embedding = sum(v for n, v in sizes.items() if n.startswith("embed_tokens."))
    assert weight_bytes(path, scheme, "float32") == pytest.approx(sum(sizes.values()), rel=0.01)
    for tokens in (1, 5, 64):
        want = sum(sizes.values()) - embedding - experts + experts * experts_touched(EXPERTS, 2, tokens)
        assert step_bytes(path, scheme, "float32", tokens) == pytest.approx(want, rel=0.01), tokens
    one, five = (step_bytes(path, scheme, "float32", n) for n in (1, 5))
    assert five > one
    config = EngineConfig(
        target=ModelSpec(str(path), dtype="float32", quantization=scheme),
        spec=SpecConfig(k=4, draft=ModelDraft(ModelSpec(str(moe["source"]), dtype="float32"))),
    )
    ratio, verify = weight_reads(config, 4)
    assert verify == pytest.approx(five / one) and ratio == pytest.approx(
        step_bytes(moe["source"], "none", "float32") / one
    )
