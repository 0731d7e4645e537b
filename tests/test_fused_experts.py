"""Qwen3-MoE and Qwen3.5-MoE checkpoints whose experts are stored fused, as transformers holds
them and published Qwen3.5-MoE checkpoints store them (`mlp.experts.gate_up_proj` [E, 2I, H],
gate's rows then up's; `mlp.experts.down_proj` [E, H, I]; arch.Packed's "halves" layout):
written from tiny per-expert checkpoints (tests/support/tiny_families.fuse_experts), they
load on every path (float, int8/int4, one tensor-parallel rank's shard, the multimodal
layout) to exactly what the per-expert checkpoint loads, count the same sizes, run greedy
SD equal to AR, and a fused tensor of the wrong shape or an unexpected one is refused by name."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from support.drafts import draft_of
from support.tiny_families import PREFILL_IDS, fuse_experts, make_qwen3_5_moe, make_qwen3_moe, prefill_logits
from support.tiny_models import build_tokenizer, make_draft_like
from support.tiny_multimodal import make_multimodal

from ssdlocal.backends.torch.loader import load_model
from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.core.errors import ModelLoadError
from ssdlocal.core.events import DoneEvent
from ssdlocal.engine import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

FAMILIES = {"qwen3_moe": make_qwen3_moe, "qwen3_5_moe": make_qwen3_5_moe}
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "def fibonacci(n):\n    if n < 2:"]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """family -> {"experts": the checkpoint as transformers saves it (one tensor per expert),
    "fused": the same weights fused}; "multimodal" / "multimodal_fused": a
    Qwen3_5MoeForConditionalGeneration holding the qwen3_5_moe text model."""
    root = tmp_path_factory.mktemp("fused")
    build_tokenizer(root / "tok")
    out = {}
    for name, make in FAMILIES.items():
        experts = make(root / name, root / "tok")
        out[name] = {"experts": experts, "fused": fuse_experts(experts, root / f"{name}_fused")}
    saved = make_multimodal("qwen3_5_moe", root / "multimodal", root / "tok", out["qwen3_5_moe"]["experts"])
    out["multimodal"] = {"experts": saved, "fused": fuse_experts(saved, root / "multimodal_fused")}
    return out


def _names(path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_the_fused_checkpoints_hold_what_transformers_holds(dirs):
    """The test files hold the fused form only, named as transformers names its parameters
    (a published Qwen3.5-MoE: "model.language_model.layers.N.mlp.experts.gate_up_proj")."""
    from transformers import AutoModelForCausalLM

    for name in FAMILIES:
        stored = {n: None for n in _names(dirs[name]["fused"]) if ".experts." in n}
        assert stored and not any(re.search(r"\.experts\.\d+\.", n) for n in stored)
        model = AutoModelForCausalLM.from_pretrained(dirs[name]["experts"], dtype=torch.float32)
        held = {n for n, _ in model.named_parameters() if ".experts." in n}
        assert set(stored) == held, name
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in _names(dirs["multimodal"]["fused"])


@pytest.mark.parametrize("family", [*FAMILIES, "multimodal"])
def test_logits_equal_the_per_expert_checkpoint_bit_for_bit_and_transformers(dirs, family):
    import transformers

    experts, fused = dirs[family]["experts"], dirs[family]["fused"]
    got = prefill_logits(fused)
    assert torch.equal(got, prefill_logits(experts))
    architecture = transformers.AutoConfig.from_pretrained(fused).architectures[0]
    reference = getattr(transformers, architecture).from_pretrained(fused, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = reference(PREFILL_IDS).logits  # transformers reading the same fused file
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_loads_equal_the_per_expert_checkpoints(dirs, family, scheme):
    assert torch.equal(prefill_logits(dirs[family]["fused"], scheme), prefill_logits(dirs[family]["experts"], scheme))


@pytest.mark.parametrize("family", [*FAMILIES, "multimodal"])
def test_a_tensor_parallel_rank_holds_the_per_expert_checkpoints_shard(dirs, family):
    """Experts split by their width (gate/up by output features, down by input features),
    after the fused gate_up is cut into its halves."""
    from ssdlocal.core.config import ModelSpec
    from ssdlocal.parallel.shard_loader import load_shard

    for rank in (0, 1):
        got, want = (
            load_shard(ModelSpec(str(dirs[family][k]), dtype="float32"), "cpu", rank, 2, tokenizer=False).model
            for k in ("fused", "experts")
        )
        held, expected = got.state_dict(), want.state_dict()
        assert held.keys() == expected.keys()
        assert all(torch.equal(held[n], expected[n]) for n in expected), rank
        full = load_model(dirs[family]["fused"], "cpu", "float32").model.layers[0].mlp.experts
        assert held["layers.0.mlp.experts.gate_proj.weight"].shape[1] * 2 == full.gate_proj.weight.shape[1]


def test_two_ranks_and_sd_equal_ar_on_a_fused_target(dirs, tmp_path):
    fused = dirs["qwen3_5_moe"]["fused"]
    draft = make_draft_like(fused, tmp_path / "draft", noise=0.004, seed=31)
    target = ModelSpec(str(fused), dtype="float32")
    ar, sd = SpecConfig(mode=Mode.AR), SpecConfig(mode=Mode.SD, k=3, draft=draft_of(str(draft)))

    def tokens(engine, spec):
        done = [e for e in engine.generate(PROMPTS, GREEDY, spec=spec) if isinstance(e, DoneEvent)][0]
        assert done.stats.draft_losses == 0
        return [o.token_ids for o in done.outputs]

    with Engine(EngineConfig(target=target, spec=sd, pin_cpus=False, graphs="off")) as one:
        want = tokens(one, ar)
        assert tokens(one, sd) == want
    with Engine(EngineConfig(target=ModelSpec(str(dirs["qwen3_5_moe"]["experts"]), dtype="float32"))) as other:
        assert tokens(other, ar) == want
    with Engine(EngineConfig(target=target, target_devices=("cpu", "cpu"), pin_cpus=False)) as two:
        assert tokens(two, ar) == want


@pytest.mark.parametrize("family", [*FAMILIES, "multimodal"])
def test_sizes_count_the_fused_experts_as_the_per_expert_ones(dirs, family):
    from ssdlocal.weights.size import parameters, step_bytes, weight_bytes

    experts, fused = dirs[family]["experts"], dirs[family]["fused"]
    assert parameters(fused) == parameters(experts)
    assert parameters(fused).active < parameters(fused).total  # 2 of 8 experts per token
    for scheme in ("none", "int8", "int4"):
        assert weight_bytes(fused, scheme, "bfloat16") == weight_bytes(experts, scheme, "bfloat16"), scheme
    assert step_bytes(fused, "none", "bfloat16", 4) == step_bytes(experts, "none", "bfloat16", 4)


def _rewritten(src, dst, change) -> object:
    from safetensors.torch import load_file, save_file

    out = shutil.copytree(src, dst)
    state = load_file(out / "model.safetensors")
    change(state)
    save_file({n: t.contiguous() for n, t in state.items()}, out / "model.safetensors", metadata={"format": "pt"})
    return out


GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.update({GATE_UP: s[GATE_UP][:, 1:]}), f"{GATE_UP} of shape (8, 63, 64) has 63 output features"),
        (lambda s: s.update({GATE_UP: s[GATE_UP][0]}), f"{GATE_UP} of shape (64, 64) has 2 dimensions, not 3"),
    ],
    ids=["odd", "2-D"],
)
def test_a_fused_tensor_that_cannot_hold_the_experts_is_refused_by_name(dirs, tmp_path, change, message):
    from ssdlocal.core.config import ModelSpec
    from ssdlocal.parallel.shard_loader import load_shard
    from ssdlocal.weights.size import parameters

    broken = _rewritten(dirs["qwen3_moe"]["fused"], tmp_path / "broken", change)
    for scheme in ("none", "int8"):
        with pytest.raises(ModelLoadError, match=re.escape(message)):
            load_model(broken, "cpu", "float32", scheme)
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        load_shard(ModelSpec(str(broken), dtype="float32"), "cpu", 0, 2, tokenizer=False)
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        parameters(broken)


def test_fused_experts_of_another_width_or_an_unexpected_tensor_are_refused(dirs, tmp_path):
    """A gate_up whose halves are narrower than the config's experts (2 x 31 rows, not
    2 x 32) is refused as not matching the config; a tensor no model of ours holds is named."""
    narrow = _rewritten(
        dirs["qwen3_moe"]["fused"], tmp_path / "narrow", lambda s: s.update({GATE_UP: s[GATE_UP][:, 2:]})
    )
    for scheme in ("none", "int8"):
        with pytest.raises(ModelLoadError, match=r"does not match its config.json: .*mlp.experts.gate_proj"):
            load_model(narrow, "cpu", "float32", scheme)
    stray = "model.layers.0.mlp.experts.gate_up_proj_bias"
    extra = _rewritten(dirs["qwen3_moe"]["fused"], tmp_path / "extra", lambda s: s.update({stray: torch.zeros(8, 64)}))
    with pytest.raises(ModelLoadError, match=re.escape(f"unexpected ['{stray}']")):
        load_model(extra, "cpu", "float32")


def test_an_mtp_layer_with_fused_experts_loads_as_its_per_expert_form(dirs, tmp_path):
    """`--draft mtp` reads the MTP layer's experts fused too: the head holds exactly the
    per-expert checkpoint's weights, and drafts SD equal to AR."""
    from support.tiny_mtp import add_mtp

    from ssdlocal.backends import registry
    from ssdlocal.backends.torch.heads import load_head
    from ssdlocal.core.models import HeadDraft

    experts = shutil.copytree(dirs["qwen3_5_moe"]["experts"], tmp_path / "experts")
    add_mtp(experts, seed=51)
    fused = fuse_experts(experts, tmp_path / "fused")
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in _names(fused)
    heads = []
    for path in (experts, fused):
        runner = registry.backend_for("torch").make_runner(
            registry.load(ModelSpec(str(path), dtype="float32")), tree=False, graphs="off"
        )
        head = load_head("mtp", str(path), runner.head_inputs(), runner.vocab_size, runner.device)
        heads.append(head.head.state_dict())
    assert heads[0].keys() == heads[1].keys() and any(".experts." in n for n in heads[1])
    assert all(torch.equal(heads[0][n], heads[1][n]) for n in heads[0])
    spec = SpecConfig(mode=Mode.SD, k=3, draft=HeadDraft(str(fused), "mtp"))
    with Engine(EngineConfig(target=ModelSpec(str(fused), dtype="float32"), graphs="off")) as engine:
        ar, sd = (
            [e for e in engine.generate(PROMPTS, GREEDY, spec=s) if isinstance(e, DoneEvent)][0]
            for s in (SpecConfig(mode=Mode.AR), spec)
        )
    assert [o.token_ids for o in sd.outputs] == [o.token_ids for o in ar.outputs]
    assert sd.stats.acceptance_rate is not None
