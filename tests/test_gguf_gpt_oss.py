"""gpt-oss GGUF files (llama.cpp's "gpt-oss") through the torch backend.

- the config llama.cpp reads from the file (weights/formats/gguf_config.py): the rotary
  table (YaRN with llama.cpp's whole-dimension correction range), the head size, which
  layers slide, the experts' width; the keys llama.cpp reads otherwise than a checkpoint's
  config would be refused by name;
- MXFP4 experts de-quantized at load: a known block, and the converter's repacking of a
  published checkpoint's MXFP4 experts (its code is copied below, `repack_mxfp4`) loads as
  the same weights as the checkpoint itself;
- (marker `llamacpp`) a tiny random GGUF (support/tiny_gguf_families.py: four layers,
  sliding window 8, YaRN, sinks, four experts with biases) gives llama.cpp's logits at every
  position and its greedy tokens, AR and SD.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from support.gguf_compare import llamacpp_greedy, llamacpp_logits, torch_logits  # noqa: E402
from support.tiny_gguf_families import WINDOW, write_family_gguf  # noqa: E402

from ssdlocal.core.errors import UnsupportedArchitectureError  # noqa: E402
from ssdlocal.weights.formats.gguf import GGUFHeader  # noqa: E402
from ssdlocal.weights.formats.gguf_config import llamacpp_fields  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

IDS = [5, 17, 200, 3, 99, 12, 40, 41, 42, 43, 100, 7, 8, 9, 10, 11, 12, 13, 14, 15, 60, 61, 62, 63]
F32_CLOSE = 1e-4  # float32 both ways (measured <= 5e-6)


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path_factory.getbasetemp() / "gpt-oss-cache"))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpt-oss")
    return {
        "f32": write_family_gguf(root / "gpt-oss.gguf", "gpt-oss"),
        "draft": write_family_gguf(root / "gpt-oss-draft.gguf", "gpt-oss", jitter=0.05),
        "mxfp4": write_family_gguf(root / "gpt-oss-mxfp4.gguf", "gpt-oss", experts="mxfp4"),
        "mxfp4-values": write_family_gguf(root / "gpt-oss-mxfp4-values.gguf", "gpt-oss", experts="mxfp4-values"),
    }


def _meta(**keys: object) -> GGUFHeader:
    base = {
        "block_count": 4,
        "context_length": 512,
        "attention.key_length": 16,
        "attention.value_length": 16,
        "rope.freq_base": 150000.0,
        "rope.scaling.type": "yarn",
        "rope.scaling.factor": 32.0,
        "rope.scaling.original_context_length": 4096,
    }
    base.update(keys)
    meta = {"general.architecture": "gpt-oss", **{f"gpt-oss.{k}": v for k, v in base.items() if v is not None}}
    return GGUFHeader(Path("unread.gguf"), meta, ())


def test_the_config_is_what_llamacpp_reads():
    got = llamacpp_fields(_meta())
    assert got["head_dim"] == 16
    assert got["rope_parameters"] == {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": True,  # ggml rounds YaRN's correction range to whole dimensions
    }
    assert got["layer_types"] == ["sliding_attention", "full_attention"] * 2  # llama.cpp's default: 2
    assert llamacpp_fields(_meta(**{"attention.sliding_window_pattern": 0}))["layer_types"] == ["sliding_attention"] * 4
    flags = [False, True, True, False]
    assert llamacpp_fields(_meta(**{"attention.sliding_window_pattern": flags}))["layer_types"] == [
        "sliding_attention" if f else "full_attention" for f in flags
    ]
    for plain in ({"rope.scaling.type": None, "rope.scaling.factor": None}, {"rope.scaling.type": "none"}):
        assert llamacpp_fields(_meta(**plain))["rope_parameters"] == {"rope_type": "default", "rope_theta": 150000.0}
    assert llamacpp_fields(_meta(**{"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}))["rope_parameters"] == {
        "rope_type": "linear",
        "rope_theta": 150000.0,
        "factor": 2.0,
    }
    unstated = _meta(**{"attention.key_length": None, "attention.value_length": None})
    unstated.metadata.update({"gpt-oss.embedding_length": 2880, "gpt-oss.attention.head_count": 64})
    assert llamacpp_fields(unstated)["head_dim"] == 45  # llama.cpp's default: embedding / heads
    assert llamacpp_fields(GGUFHeader(Path("q.gguf"), {"general.architecture": "qwen3moe"}, ())) == {}


@pytest.mark.parametrize(
    ("keys", "named"),
    [
        ({"rope.scaling.yarn_beta_fast": 16.0}, "rope.scaling.yarn_beta_fast=16.0"),
        ({"rope.scaling.yarn_log_multiplier": 0.1}, "rope.scaling.yarn_log_multiplier=0.1"),
        ({"rope.scaling.attn_factor": 2.0}, "rope.scaling.attn_factor=2.0"),
        ({"rope.freq_base_swa": 10000.0}, "rope.freq_base_swa=10000.0"),
        ({"rope.dimension_count": 8}, "rope.dimension_count=8"),
        ({"attention.value_length": 32}, "attention.value_length=32"),
        ({"rope.scaling.type": "longrope"}, "rope.scaling.type='longrope'"),
        ({"attention.sliding_window_pattern": [True, False]}, "2 sliding_window_pattern flags for 4 layers"),
    ],
)
def test_a_key_llamacpp_reads_otherwise_is_refused_by_name(keys, named):
    with pytest.raises(UnsupportedArchitectureError, match=named.replace("(", r"\(").replace(")", r"\)")):
        llamacpp_fields(_meta(**keys))


# ------------------------------------------------------------------ MXFP4

FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def test_an_mxfp4_block_decodes_as_ggml_defines_it(tmp_path):
    """One ggml MXFP4 block (17 bytes: the E8M0 exponent, then 16 bytes whose low nibbles are
    values 0-15 and high nibbles values 16-31) in a GGUF tensor, read by our loader."""
    from ssdlocal.weights.formats.gguf import GGUFHeader, dequantize_rows

    codes = np.arange(32, dtype=np.uint8) % 16  # values 0..15 twice
    rows = []
    for exponent in (127, 130, 120):  # scales 1, 8, 1/128
        qs = codes[:16] | (codes[16:][::-1] << 4)  # high nibbles: the codes backwards
        rows.append(np.concatenate([[exponent], qs]).astype(np.uint8))
    w = gguf.GGUFWriter(str(tmp_path / "b.gguf"), "gpt-oss")
    w.add_tensor("blk.0.ffn_down_exps.weight", np.stack(rows), raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    header = GGUFHeader.read(tmp_path / "b.gguf")
    (info,) = header.tensors
    assert info.shape == (3, 32) and info.type_name == "MXFP4"
    got = dequantize_rows(header.path, info, 0, 3)
    for row, scale in zip(got, (1.0, 8.0, 1 / 128), strict=True):
        np.testing.assert_array_equal(row, np.concatenate([FP4[codes[:16]], FP4[codes[16:][::-1]]]) * scale)


def repack_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """llama.cpp's converter (conversion/gpt_oss.py, GptOssModel.transform_nibble_layout and
    repack_mxfp4), copied: a checkpoint's MXFP4 blocks [E, out, G, 16] (values interleaved:
    low nibble, high nibble) and scales [E, out, G] -> ggml MXFP4 rows [E, out, G * 17]."""
    t = blocks
    t = ((t & 0x0F) << 4) | ((t & 0xF0) >> 4)
    blk_a, blk_b = t.chunk(2, dim=-1)
    blk_a = torch.stack(((blk_a & 0xF0).view(-1, 1), (blk_a << 4).view(-1, 1)), dim=2).view(t.shape)
    blk_b = torch.stack(((blk_b >> 4).view(-1, 1), (blk_b & 0x0F).view(-1, 1)), dim=2).view(t.shape)
    out = blk_a | blk_b
    out = ((out & 0xF0) >> 4) | ((out & 0x0F) << 4)
    data = torch.concat((scales.unsqueeze(-1), out), dim=-1)
    return data.view(data.shape[0], data.shape[1], data.shape[2] * data.shape[3]).numpy()


def test_mxfp4_experts_from_llamacpps_converter_are_the_checkpoints_weights(tmp_path):
    """A published checkpoint's MXFP4 down_proj (blocks, scales), repacked as llama.cpp's
    converter does, converts to exactly the weights our checkpoint loader unpacks from it."""
    from safetensors import safe_open

    from ssdlocal.backends.torch.packed import dequantize_mxfp4
    from ssdlocal.weights.formats.convert import ensure_converted

    path = write_family_gguf(tmp_path / "m.gguf", "gpt-oss")
    gen = torch.Generator().manual_seed(0)
    experts, hidden, width = 4, 64, 32
    blocks = torch.randint(0, 256, (experts, hidden, width // 32, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(120, 131, (experts, hidden, width // 32), dtype=torch.uint8, generator=gen)
    want = dequantize_mxfp4(blocks, scales, torch.float32)  # [E, hidden, width]: our checkpoint loader's
    reader = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "r.gguf"), "gpt-oss")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        value = field.contents()
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_key_value(field.name, value, kind, sub_type=field.types[-1])
        else:
            w.add_key_value(field.name, value, kind)
    for t in reader.tensors:
        if t.name == "blk.1.ffn_down_exps.weight":
            w.add_tensor(t.name, repack_mxfp4(blocks, scales), raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            w.add_tensor(t.name, np.array(t.data).reshape([int(d) for d in reversed(t.shape)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = ensure_converted(tmp_path / "r.gguf", dtype="float32")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        got = torch.stack([f.get_tensor(f"model.layers.1.mlp.experts.{e}.down_proj.weight") for e in range(experts)])
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["f32", "mxfp4"])
def test_the_int8_path_reads_every_tensor_as_the_float_conversion(files, kind):
    """The int8 converter (backends/torch/gguf_quant.py) walks the same names: each
    quantized weight within half an int8 step of the float conversion's (MXFP4 experts
    de-quantized first), every other tensor (sinks, router, biases, norms) equal."""
    from ssdlocal.backends.torch.loader import load_model
    from ssdlocal.backends.torch.quant import QuantLinear
    from ssdlocal.backends.torch.quant_apply import QuantEmbedding
    from ssdlocal.backends.torch.quant_experts import QuantStacked
    from ssdlocal.weights.formats.convert import ensure_converted

    quant = load_model(files[kind], "cpu", "float32", "int8").model
    dense = load_model(ensure_converted(files[kind], dtype="float32"), "cpu", "float32").model
    quantized, kinds = set(), set()
    with torch.no_grad():
        for name, module in quant.named_modules():
            if isinstance(module, QuantStacked):
                got, kinds = module.dequantized(), kinds | {"experts"}
            elif isinstance(module, QuantLinear):
                got, kinds = module.dequantize_rows(torch.arange(module.out_features)), kinds | {"linear"}
            elif isinstance(module, QuantEmbedding):
                got, kinds = module(torch.arange(module.num_embeddings)), kinds | {"embedding"}
            else:
                continue
            want = dense.get_submodule(name).weight
            step = want.abs().amax(-1, keepdim=True) / 127
            assert ((got - want).abs() <= step / 2 + 1e-6).all(), name
            quantized.add(f"{name}.weight")
    assert kinds == {"experts", "linear", "embedding"}
    rest = {n: t for n, t in quant.state_dict().items() if n in dict(dense.state_dict()) and n not in quantized}
    assert any(n.endswith("self_attn.sinks") for n in rest) and any(n.endswith("mlp.router.bias") for n in rest)
    for n, t in rest.items():
        assert torch.equal(t, dense.state_dict()[n]), n


# ------------------------------------------------------------------ against llama.cpp


@pytest.mark.llamacpp
@pytest.mark.parametrize("kind", ["f32", "mxfp4"])
def test_logits_at_every_position_are_llamacpps(files, kind, record_property):
    """24 tokens (three sliding windows) through four layers with sinks and YaRN: every
    position's logits are llama.cpp's. MXFP4 experts: llama.cpp's CPU kernel rounds the
    activations to Q8_0 before it multiplies MXFP4 weights (ggml's vec_dot type for it), so
    the reference is llama.cpp on the file holding the same expert values in float32."""
    assert len(IDS) > 2 * WINDOW
    want = llamacpp_logits(files["mxfp4-values" if kind == "mxfp4" else kind], IDS)
    got = torch_logits(files[kind], IDS)
    diff = float(np.abs(got - want).max())
    record_property("max_logit_diff", diff)
    assert diff <= F32_CLOSE
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.llamacpp
def test_greedy_tokens_are_llamacpps_in_ar_and_sd(files):
    """llama.cpp's own greedy decoding (one token per call, 48 steps) equals the engine's
    AR and SD (a jittered sibling as the draft) on the torch backend, the files converted in
    float32 (the torch loader's own conversion of a GGUF is bfloat16)."""
    from ssdlocal.core.config import EngineConfig, Mode, ModelDraft, ModelSpec, SamplingParams, SpecConfig
    from ssdlocal.core.events import DoneEvent
    from ssdlocal.engine import Engine
    from ssdlocal.weights.formats.convert import ensure_converted

    steps, prompt = 48, IDS[:6]
    want = llamacpp_greedy(files["f32"], prompt, steps)
    params = SamplingParams(temperature=0.0, max_new_tokens=steps, ignore_eos=True)
    converted = {k: str(ensure_converted(files[k], dtype="float32")) for k in ("f32", "draft")}
    draft = ModelDraft(ModelSpec(converted["draft"], backend="torch", dtype="float32"), suffix=None)
    target = ModelSpec(converted["f32"], backend="torch", dtype="float32")
    got = {}
    with Engine(EngineConfig(target=target, spec=SpecConfig(mode=Mode.SD, k=3, draft=draft), pin_cpus=False)) as eng:
        for mode in (Mode.AR, Mode.SD):
            events = eng.generate([prompt], params, spec=SpecConfig(mode=mode, k=3, draft=draft))
            done = [e for e in events if isinstance(e, DoneEvent)][0]
            got[mode] = list(done.outputs[0].token_ids)
            accepted = done.stats["acceptance_rate"]
    assert got[Mode.AR] == want
    assert got[Mode.SD] == want
    assert 0 < accepted < 1  # SD's drafts were taken and rejected
