"""What each tensor-parallel rank holds, as the planner counts it: the tensors the architecture
table splits (column, row) divide over the ranks, the rest (embeddings, norms, lm_head, the
linears it keeps replicated: Qwen3.5's Gated DeltaNet layers) sit whole on every rank
(weights/size.py `whole_bytes`, a pair's `whole_b`, plan_placement's `target_whole_gb`).
Checked on the qwen3.5-27b pair against a hand count from its published config's shapes,
`ssdlocal devices` on 2 and 4 GPUs, and on a tiny checkpoint against what two ranks load."""

from __future__ import annotations

import json

import pytest
from support.cli import run_cli

from ssdlocal.placement.inventory import GPU, DeviceInventory
from ssdlocal.placement.planner import OVERHEAD


def machine(*sizes_gb: float) -> DeviceInventory:
    return DeviceInventory(
        tuple(GPU(i, f"GPU{i}", s, s - 0.5, True) for i, s in enumerate(sizes_gb)), 32, 256.0, 230.0, "nvlink"
    )


def _whole_by_hand(text: dict) -> int:
    """Parameters no rank splits in a Qwen3.5 text model of config `text` (its published
    config.json's text_config), counted from the shapes: embedding and untied lm_head, every
    norm, and the whole linear-attention layers (their projections, conv, norm, A_log, dt_bias)."""
    h, layers, v = text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]
    pattern = text["layer_types"]
    linear = layers * pattern.count("linear_attention") // len(pattern)
    full = layers - linear
    nk, nv = text["linear_num_key_heads"], text["linear_num_value_heads"]
    dk, dv = text["linear_key_head_dim"], text["linear_value_head_dim"]
    conv = 2 * nk * dk + nv * dv  # the q, k and v channels the conv runs over
    per_linear = conv * h + nv * dv * h + 2 * nv * h + h * nv * dv + conv * text["linear_conv_kernel_dim"] + dv + 2 * nv
    norms = h + 2 * h * layers + 2 * text["head_dim"] * full  # final, two per layer, q/k norms
    return 2 * v * h + norms + linear * per_linear


def test_the_pairs_whole_count_is_the_configs_and_the_tables():
    import torch
    from support.tiny_multimodal import PUBLISHED, published_config

    from ssdlocal.backends.torch.models import args_from_config, build
    from ssdlocal.weights.formats.archs import architecture
    from ssdlocal.weights.pairs import get_pair

    cfg = published_config("Qwen/Qwen3.5-27B")
    args = args_from_config(cfg)
    with torch.device("meta"):
        held = build(args).state_dict()
    split_dim = architecture(args.arch).split_dim
    whole = sum(t.numel() for n, t in held.items() if split_dim(n) is None)
    assert whole == _whole_by_hand(PUBLISHED["Qwen/Qwen3.5-27B"][1])
    assert get_pair("qwen3.5-27b").target.whole_b == round(whole / 1e9, 2)
    assert whole > 0.25 * sum(t.numel() for t in held.values())  # far from nothing


@pytest.mark.parametrize(("gpus", "tp"), [(2, 2), (4, 4)])
def test_devices_plans_each_rank_with_what_it_holds_whole(monkeypatch, capsys, gpus, tp):
    from support.tiny_multimodal import PUBLISHED

    from ssdlocal.weights.pairs import get_pair

    pair = get_pair("qwen3.5-27b")
    target_gb = pair.target.bf16_gb
    whole_gb = _whole_by_hand(PUBLISHED["Qwen/Qwen3.5-27B"][1]) * 2 / 1e9  # bf16
    kv_gb = max(1.0, 0.1 * target_gb)  # the planner's default KV share
    rank_gb = ((target_gb - whole_gb) * OVERHEAD + kv_gb) / tp + whole_gb * OVERHEAD
    even_gb = (target_gb * OVERHEAD + kv_gb) / tp  # what splitting everything would have said
    size = {2: 44.0, 4: 32.0}[gpus]  # a rank fits; the whole model on one GPU does not
    monkeypatch.setattr("ssdlocal.placement.inventory.detect", lambda: machine(*[size] * gpus))
    code, out, err = run_cli(monkeypatch, capsys, "devices", "--pair", "qwen3.5-27b", "--json")
    assert code == 0, err
    plan = json.loads(out)["plan"]
    assert plan["tensor_parallel"] == tp
    shards = [u["need_gb"] for u in plan["uses"] if u["role"] == "target (TP shard)"]
    assert len(shards) == tp and all(s == pytest.approx(rank_gb, abs=0.02) for s in shards)
    assert rank_gb - even_gb > 5.0  # the replicated DeltaNet layers, embedding and head: GBs per rank
    smaller = rank_gb - 2.0  # a GPU the even split would have called big enough
    assert even_gb < smaller - 0.5
    monkeypatch.setattr("ssdlocal.placement.inventory.detect", lambda: machine(*[smaller + 0.5] * gpus))
    code, out, err = run_cli(monkeypatch, capsys, "devices", "--pair", "qwen3.5-27b")
    assert code != 0 and "the target needs" in err


def test_whole_bytes_are_what_two_ranks_load_beyond_half(tmp_path):
    """On a tiny Qwen3.5 checkpoint: a rank of two holds the whole part plus half the rest,
    tensor by tensor as the shard loader gives it."""
    from support.tiny_families import make_qwen3_5
    from support.tiny_models import build_tokenizer

    from ssdlocal.core.config import ModelSpec
    from ssdlocal.parallel.shard_loader import load_shard
    from ssdlocal.weights.size import weight_bytes, whole_bytes

    build_tokenizer(tmp_path / "tok")
    target = make_qwen3_5(tmp_path / "qwen3_5", tmp_path / "tok")
    total, whole = weight_bytes(target, "none", "float32"), whole_bytes(target, "none", "float32")
    rank = load_shard(ModelSpec(str(target), dtype="float32"), "cpu", 0, 2, tokenizer=False).model
    held = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in rank.state_dict().values()}.values())
    assert held == whole + (total - whole) // 2
    assert 0 < whole < total


def test_a_pair_without_whole_b_plans_every_rank_with_its_token_embedding(monkeypatch, capsys):
    """A pair file that gives no `whole_b` still counts its token embedding (`embed_b`) on
    every rank: the table every rank holds whole, so an even split would undercount each."""
    from ssdlocal.weights.pairs import get_pair

    pair = get_pair("llama-3.1-70b")
    assert pair.target.whole_b is None and pair.target.embed_b
    embed_gb = pair.target.embed_b * 2  # bf16
    target_gb = pair.target.bf16_gb
    kv_gb = max(1.0, 0.1 * target_gb)
    rank_gb = ((target_gb - embed_gb) * OVERHEAD + kv_gb) / 2 + embed_gb * OVERHEAD
    monkeypatch.setattr("ssdlocal.placement.inventory.detect", lambda: machine(141.0, 141.0))  # two H200s
    code, out, err = run_cli(monkeypatch, capsys, "devices", "--pair", "llama-3.1-70b", "--json")
    assert code == 0, err
    plan = json.loads(out)["plan"]
    assert plan["tensor_parallel"] == 2
    shards = [u["need_gb"] for u in plan["uses"] if u["role"] == "target (TP shard)"]
    assert len(shards) == 2 and all(s == pytest.approx(rank_gb, abs=0.02) for s in shards)
