"""Tensors a checkpoint stores packed (ssdlocal/backends/torch/packed.py): MXFP4 blocks
dequantize as transformers' own helper and the format's definition say, and a gpt-oss
checkpoint with MXFP4 experts, as OpenAI publishes them, loads on every path (float,
int8, one rank's shard) to what transformers computes from the same file; sizes count
the weights the blocks hold; a file missing half of a weight is refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from support.tiny_families import make_gpt_oss, pack_mxfp4, write_mxfp4
from support.tiny_models import build_tokenizer

from ssdlocal.backends.torch.loader import load_model
from ssdlocal.backends.torch.models import causal_mask
from ssdlocal.backends.torch.packed import FP4_VALUES, dequantize_mxfp4
from ssdlocal.core.errors import ModelLoadError

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(float, MXFP4) directories of one tiny gpt-oss."""
    root = tmp_path_factory.mktemp("packed")
    build_tokenizer(root / "tokenizer")
    dense = make_gpt_oss(root / "float", root / "tokenizer")
    return dense, write_mxfp4(dense, root / "mxfp4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mxfp4_dequantizes_as_transformers_and_the_format_say(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    codes = torch.arange(256, dtype=torch.uint8).reshape(1, 16, 16)  # every byte: every (low, high) pair
    blocks = codes[:, :, None, :].repeat(3, 1, 2, 1)  # [E=3, out=16, G=2, 16]
    scales = torch.tensor([117, 127, 134], dtype=torch.uint8)[:, None, None].repeat(1, 16, 2)  # 2^-10, 1, 2^7
    got = dequantize_mxfp4(blocks, scales, dtype)  # [3, 16, 64]
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)  # transformers: [E, in, out]
    assert got.dtype == dtype and torch.equal(got, want)
    byte = 0x2B  # low nibble 0xB (-1.5) first, then 0x2 (1.0); scale 2^7
    row, col = divmod(byte, 16)
    assert got[2, row, 2 * col].item() == -1.5 * 2**7 and got[2, row, 2 * col + 1].item() == 1.0 * 2**7
    assert sorted(set(got[1].flatten().tolist())) == sorted(set(FP4_VALUES))


def test_the_test_packer_round_trips_values_it_can_hold():
    values = torch.tensor(FP4_VALUES)[torch.randint(0, 16, (4, 64), generator=torch.Generator().manual_seed(0))]
    values[:, 0], values[:, 32] = 6.0, -4.0  # every block's largest value fixes its scale at 2^0
    blocks, scales = pack_mxfp4(values * 0.25)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), values * 0.25)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    T = ids.shape[1]
    pos = torch.arange(T)[None].expand(ids.shape[0], T)
    with torch.inference_mode():
        model.setup_cache(ids.shape[0], 64, torch.float32, "cpu")
        return model(ids, pos, pos, causal_mask(pos, T))  # [B, T, V]


IDS = torch.tensor([list(range(100, 120)), list(range(7, 27))])  # [2, 20]: past the window of 8


def test_an_mxfp4_checkpoint_gives_transformers_logits(checkpoints):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    _, mxfp4 = checkpoints
    reference = AutoModelForCausalLM.from_pretrained(
        mxfp4, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    ).eval()
    with torch.inference_mode():
        want = reference(IDS).logits  # [2, 20, V]
    torch.testing.assert_close(_logits(load_model(mxfp4, "cpu", "float32").model, IDS), want, rtol=1e-4, atol=1e-4)
    half = load_model(mxfp4, "cpu", "bfloat16").model  # experts dequantized to the load dtype
    assert half.layers[0].mlp.experts.gate_proj.weight.dtype == torch.bfloat16


def test_mxfp4_experts_quantize_shard_and_count_as_the_weights_they_hold(checkpoints, tmp_path):
    from ssdlocal.backends.torch.quant_experts import QuantStacked
    from ssdlocal.core.config import ModelSpec
    from ssdlocal.parallel.shard_loader import load_shard
    from ssdlocal.weights.size import parameters, weight_bytes

    dense, mxfp4 = checkpoints
    whole = load_model(mxfp4, "cpu", "float32").model
    int8 = load_model(mxfp4, "cpu", "float32", "int8").model
    experts = int8.layers[1].mlp.experts
    assert isinstance(experts.gate_proj, QuantStacked) and experts.down_proj.bias is not None
    want = whole.layers[1].mlp.experts.gate_proj.weight
    assert (experts.gate_proj.dequantized() - want).abs().max() <= want.abs().max() / 127
    ranks = [load_shard(ModelSpec(str(mxfp4), dtype="float32"), "cpu", r, 2, tokenizer=False).model for r in (0, 1)]
    for name in ("gate_proj", "up_proj", "down_proj"):
        parts = [getattr(r.layers[2].mlp.experts, name).weight for r in ranks]
        full = getattr(whole.layers[2].mlp.experts, name).weight  # [E, out, in]
        assert torch.equal(torch.cat(parts, dim=2 if name == "down_proj" else 1), full), name
    assert torch.equal(torch.cat([r.layers[0].self_attn.sinks for r in ranks]), whole.layers[0].self_attn.sinks)
    assert parameters(mxfp4) == parameters(dense)  # two values per byte, scales none
    assert parameters(mxfp4).total == sum(p.numel() for p in whole.parameters())
    for scheme in ("none", "int8", "int4"):
        assert weight_bytes(mxfp4, scheme, "bfloat16") == weight_bytes(dense, scheme, "bfloat16")


def test_blocks_without_their_scales_are_refused(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    _, mxfp4 = checkpoints
    broken = shutil.copytree(mxfp4, tmp_path / "broken")
    state = load_file(broken / "model.safetensors")
    del state[next(n for n in state if n.endswith("down_proj_scales"))]
    save_file(state, broken / "model.safetensors", metadata={"format": "pt"})
    for scheme in ("none", "int8"):
        with pytest.raises(ModelLoadError, match="MXFP4 blocks of .*down_proj.weight without their scales"):
            load_model(broken, "cpu", "float32", scheme)


def test_another_quantization_method_is_refused_by_name(checkpoints, tmp_path):
    from ssdlocal.core.errors import UnsupportedArchitectureError

    _, mxfp4 = checkpoints
    other = shutil.copytree(mxfp4, tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="gpt_oss with quantization_config.quant_method='fp8'"):
        load_model(other, "cpu", "float32")
