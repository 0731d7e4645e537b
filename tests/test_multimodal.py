"""Multimodal checkpoints (transformers' *ForConditionalGeneration: Gemma 3, Gemma 4, Qwen3.5,
Qwen3.5-MoE, as their larger models are published) run their text model in the torch
backend (weights/formats/arch.py's Multimodal, models/fields.text_config): on tiny float32
checkpoints written with transformers' own classes (tests/support/tiny_multimodal.py), our
logits at every position equal the multimodal model's text-only forward, in both tensor
name layouts; greedy AR == SD == SSD == transformers' `generate`; a text field we do not
implement is refused by name; the image and audio towers are neither loaded nor counted;
int8/int4 and two tensor-parallel ranks give what the text-only checkpoint gives; Qwen3.5's
MTP layer and Gemma 4's assistant draft for a multimodal target."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from support.drafts import draft_of
from support.tiny_families import PREFILL_IDS, prefill_logits
from support.tiny_models import build_tokenizer, make_draft_like
from support.tiny_multimodal import MULTIMODAL, PUBLISHED, make_multimodal, other_layout, published_config

from ssdlocal.backends.torch.loader import load_model
from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.core.errors import UnsupportedArchitectureError
from ssdlocal.core.events import DoneEvent
from ssdlocal.core.models import HeadDraft
from ssdlocal.engine import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "def fibonacci(n):\n    if n < 2:"]
NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)
# transformers' Gemma3ForConditionalGeneration never soft-caps its logits (Multimodal.unread):
# its tiny text model leaves the cap unset, as the published 4B-27B configs do
TEXT_CHANGES = {"gemma3": {"final_logit_softcapping": None}}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """family -> {"text": the text-only checkpoint, "saved": the multimodal one as
    transformers saves it, "other": the same in the other name layout, "draft": a noisy copy
    of "saved"}."""
    root = tmp_path_factory.mktemp("multimodal")
    build_tokenizer(root / "tok")
    out = {}
    for name, (builder, _, _) in MULTIMODAL.items():
        text = builder(root / f"{name}_text", root / "tok", **TEXT_CHANGES.get(name, {}))
        saved = make_multimodal(name, root / name, root / "tok", text)
        out[name] = {
            "text": text,
            "saved": saved,
            "other": other_layout(saved, root / f"{name}_other"),
            "draft": make_draft_like(saved, root / f"{name}_draft", noise=0.004, seed=31),
        }
    return out


def _reference(path):
    import transformers

    architecture = json.loads((path / "config.json").read_text())["architectures"][0]
    return getattr(transformers, architecture).from_pretrained(path, dtype=torch.float32).eval()


def test_transformers_writes_the_layouts_published_checkpoints_hold(dirs):
    """What the tests load is what the hub holds: Gemma 3 under "language_model.model." with
    its towers at the top, Gemma 4 and Qwen3.5 under "model.language_model."."""
    from safetensors import safe_open

    for name, layout in [("gemma3", "language_model.model."), ("gemma4", "model.language_model.")]:
        with safe_open(str(dirs[name]["saved"] / "model.safetensors"), "pt") as f:
            assert any(k.startswith(layout + "layers.0.") for k in f.keys()), name  # noqa: SIM118
    for name in ("qwen3_5", "qwen3_5_moe"):
        with safe_open(str(dirs[name]["saved"] / "model.safetensors"), "pt") as f:
            names = list(f.keys())  # noqa: SIM118
        assert "lm_head.weight" in names and any(k.startswith("model.visual.") for k in names)


@pytest.mark.parametrize("layout", ["saved", "other"])
@pytest.mark.parametrize("family", MULTIMODAL)
def test_logits_equal_the_multimodal_models_text_forward(dirs, family, layout):
    """At every position of two rows: transformers' multimodal model on text alone, within
    the family tests' tolerance; and bit for bit what the text-only checkpoint gives."""
    with torch.inference_mode():
        want = _reference(dirs[family]["saved"])(input_ids=PREFILL_IDS).logits  # [B, T, V]
    ours = prefill_logits(dirs[family][layout])
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(ours, prefill_logits(dirs[family]["text"]))


def _tokens(engine: Engine, spec: SpecConfig) -> list[tuple[int, ...]]:
    done = [e for e in engine.generate(PROMPTS, GREEDY, spec=spec) if isinstance(e, DoneEvent)]
    assert done[0].stats.draft_losses == 0, (spec.mode, done[0].stats.draft_lost)
    return [o.token_ids for o in done[0].outputs]


@pytest.mark.parametrize("family", MULTIMODAL)
def test_greedy_equals_transformers_generate_and_every_mode_equals_ar(dirs, family):
    from transformers import AutoTokenizer

    target, draft = dirs[family]["saved"], dirs[family]["draft"]
    ref, tok = _reference(target), AutoTokenizer.from_pretrained(target)
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok(prompt).input_ids])
        out = ref.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
        expected.append(tuple(out[0, ids.shape[1] :].tolist()))
    modes = {
        "ar": SpecConfig(mode=Mode.AR),
        "sd": SpecConfig(mode=Mode.SD, k=3, draft=draft_of(str(draft))),
        "ssd": SpecConfig(mode=Mode.SSD, k=3, draft=draft_of(str(draft))),
    }
    spec = SpecConfig(mode=Mode.AR, k=3, draft=draft_of(str(draft)))
    config = EngineConfig(target=ModelSpec(str(target), dtype="float32"), spec=spec, pin_cpus=False, graphs="off")
    with Engine(config) as engine:
        for name, mode in modes.items():
            assert _tokens(engine, mode) == expected, name


REFUSED = [
    (
        "gemma3",
        {"final_logit_softcapping": 30.0},
        "gemma3 (Gemma3ForConditionalGeneration) with final_logit_softcapping=30.0",
    ),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "gemma3 with attn_logit_softcapping=50.0"),
    ("gemma4", {"use_bidirectional_attention": "all"}, "gemma4 with use_bidirectional_attention='all'"),
    (
        "gemma4",
        {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32},
        "gemma4 with enable_moe_block=True",
    ),
    ("qwen3_5", {"hidden_act": "gelu"}, "qwen3_5 with hidden_act='gelu'"),
]


@pytest.mark.parametrize(("family", "changes", "message"), REFUSED)
def test_a_text_field_we_do_not_implement_is_refused_by_name(dirs, tmp_path, family, changes, message):
    changed = shutil.copytree(dirs[family]["saved"], tmp_path / "changed")
    config = json.loads((changed / "config.json").read_text())
    config["text_config"].update(changes)
    (changed / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match=re.escape(message)):
        load_model(changed, "cpu", "float32")


def test_image_only_fields_leave_text_alone_and_a_stray_text_tensor_is_an_error(dirs, tmp_path):
    """Gemma 4's published `use_bidirectional_attention: "vision"` concerns image tokens only
    (text runs causal, in transformers too); a tensor under the language model's prefix that
    the text model has no place for is reported by name, as in a text-only checkpoint."""
    from safetensors.torch import load_file, save_file

    from ssdlocal.core.errors import ModelLoadError

    vision = shutil.copytree(dirs["gemma4"]["saved"], tmp_path / "vision")
    config = json.loads((vision / "config.json").read_text())
    config["text_config"]["use_bidirectional_attention"] = "vision"
    (vision / "config.json").write_text(json.dumps(config))
    assert torch.equal(prefill_logits(vision), prefill_logits(dirs["gemma4"]["saved"]))
    stray = shutil.copytree(dirs["qwen3_5"]["saved"], tmp_path / "stray")
    state = load_file(stray / "model.safetensors")
    state["model.language_model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)
    save_file(state, stray / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=re.escape("model.language_model.layers.0.mlp.extra_proj.weight")):
        load_model(stray, "cpu", "float32")


@pytest.mark.parametrize("family", MULTIMODAL)
def test_sizes_count_the_text_model_only(dirs, family):
    """The memory planner (weights/size.py) sees the text model: the text-only checkpoint's
    parameters, bytes per scheme, bytes per step and attention heads, though the multimodal
    file holds towers beside it."""
    from ssdlocal.weights.size import attention_heads, parameters, step_bytes, weight_bytes

    saved, text = dirs[family]["saved"], dirs[family]["text"]
    assert (saved / "model.safetensors").stat().st_size > (text / "model.safetensors").stat().st_size
    assert parameters(saved) == parameters(text)
    held = load_model(saved, "cpu", "float32").model.state_dict()  # Gemma 4's layer scalars are buffers
    assert parameters(saved).total == sum(t.numel() for t in {t.data_ptr(): t for t in held.values()}.values())
    for scheme in ("none", "int8", "int4"):
        assert weight_bytes(saved, scheme, "bfloat16") == weight_bytes(text, scheme, "bfloat16"), scheme
    assert step_bytes(saved, "none", "bfloat16", 4) == step_bytes(text, "none", "bfloat16", 4)
    assert attention_heads(saved) == attention_heads(text)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("family", ["gemma3", "qwen3_5_moe"])
def test_quantized_loads_equal_the_text_only_checkpoints(dirs, family, scheme):
    assert torch.equal(prefill_logits(dirs[family]["other"], scheme), prefill_logits(dirs[family]["text"], scheme))


def test_two_tensor_parallel_ranks_equal_one_device(dirs):
    target = dirs["gemma4"]["other"]
    specs = [SpecConfig(mode=Mode.AR)]
    with Engine(EngineConfig(target=ModelSpec(str(target), dtype="float32"), pin_cpus=False, graphs="off")) as one:
        want = _tokens(one, specs[0])
    config = EngineConfig(target=ModelSpec(str(target), dtype="float32"), target_devices=("cpu", "cpu"), pin_cpus=False)
    with Engine(config) as two:
        assert _tokens(two, specs[0]) == want


def test_the_mtp_layer_of_a_multimodal_qwen3_5_drafts_sd_equal_to_ar(dirs, tmp_path):
    """Published Qwen3.5 checkpoints keep the MTP layer at the top ("mtp.*") beside the
    language model: `--draft mtp` reads it from a multimodal target."""
    from safetensors.torch import load_file, save_file
    from support.tiny_mtp import add_mtp

    text = shutil.copytree(dirs["qwen3_5"]["text"], tmp_path / "text")
    mtp = add_mtp(text)  # as stored: "mtp.*"
    target = shutil.copytree(dirs["qwen3_5"]["saved"], tmp_path / "target")
    save_file(
        {**load_file(target / "model.safetensors"), **mtp}, target / "model.safetensors", metadata={"format": "pt"}
    )
    head = SpecConfig(mode=Mode.SD, k=3, draft=HeadDraft(str(target), "mtp"))
    with Engine(EngineConfig(target=ModelSpec(str(target), dtype="float32"), pin_cpus=False)) as engine:
        ar = _tokens(engine, SpecConfig(mode=Mode.AR))
        done = [e for e in engine.generate(PROMPTS, GREEDY, spec=head) if isinstance(e, DoneEvent)][0]
    assert [o.token_ids for o in done.outputs] == ar
    assert done.stats.acceptance_rate is not None


ASSISTANT_PAIR = """name = "tiny-gemma4-assistant"
source = "local"
family = "gemma4"
[target]
path = "{target}"
bf16_gb = 0.01
[draft]
head = "gemma4_assistant"
path = "{head}"
bf16_gb = 0.002
[torch]
allow_patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]
"""


def test_a_head_pair_of_a_multimodal_gemma4_and_its_assistant_drafts_sd_equal_to_ar(
    dirs, tmp_path, monkeypatch, capsys
):
    """A pair file like gemma-4-31b-assistant's (a multimodal target, its assistant as the
    draft head): the engine takes the head, greedy SD gives AR's tokens, `check` agrees."""
    from support.cli import run_cli
    from support.tiny_heads import make_gemma4_assistant

    from ssdlocal.cli.options import ModelOptions, SpecOptions
    from ssdlocal.cli.resolve import engine_config

    assistant = make_gemma4_assistant(tmp_path / "assistant", dirs["gemma4"]["text"])
    target = dirs["gemma4"]["saved"]
    pair_file = tmp_path / "tiny-gemma4-assistant.toml"
    pair_file.write_text(ASSISTANT_PAIR.format(target=target, head=assistant))
    monkeypatch.setenv("SSDLOCAL_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("SSDLOCAL_PAIRS_PATH", str(pair_file))
    config = engine_config(ModelOptions(pair="tiny-gemma4-assistant", dtype="float32"), SpecOptions())
    assert config.spec.draft == HeadDraft(str(assistant), "gemma4_assistant")
    head = SpecConfig(mode=Mode.SD, k=3, draft=config.spec.draft)
    with Engine(EngineConfig(target=ModelSpec(str(target), dtype="float32"), pin_cpus=False)) as engine:
        ar = _tokens(engine, SpecConfig(mode=Mode.AR))
        done = [e for e in engine.generate(PROMPTS, GREEDY, spec=head) if isinstance(e, DoneEvent)][0]
    assert [o.token_ids for o in done.outputs] == ar
    assert done.stats.acceptance_rate is not None
    args = ("--pair", "tiny-gemma4-assistant", "--dtype", "float32", "--max-new-tokens", "8")
    code, out, err = run_cli(monkeypatch, capsys, "check", *args)
    assert code == 0, err
    assert "SD reproduces AR" in out


def test_the_cli_generates_from_a_multimodal_checkpoint_with_its_chat_template(dirs, monkeypatch, capsys):
    """`ssdlocal generate --target DIR` on a multimodal checkpoint: the tokenizer and chat
    template come from its directory, the text model answers."""
    from support.cli import run_cli

    target = dirs["gemma3"]["saved"]
    code, out, err = run_cli(
        monkeypatch, capsys, "generate", "hello", "--target", str(target), "--dtype", "float32", "--max-new-tokens", "6"
    )
    assert code == 0, err
    assert out.strip()


@pytest.mark.parametrize("repo", PUBLISHED)
def test_published_configs_build_exactly_the_text_tensors_of_the_multimodal_model(repo):
    """The published configs (Gemma 3 27B, Gemma 4 31B and the E2B draft with its per-layer
    embeddings and shared KV, Qwen3.5 27B) read, and our model built from them on the meta
    device holds exactly the multimodal model's text tensors, name for name and shape for
    shape (the towers' and, tied, the head's left out)."""
    import transformers

    from ssdlocal.backends.torch.models import args_from_config, build
    from ssdlocal.weights.formats.archs import architecture

    cfg = published_config(repo)
    args = args_from_config(cfg)
    described = architecture(args.arch)
    with torch.device("meta"):
        ours = build(args)
        theirs = getattr(transformers, cfg.architectures[0])(cfg)
    held = {}
    for name, tensor in theirs.state_dict().items():
        if (key := described.from_checkpoint(name, args.tie_word_embeddings)) is not None:
            held[key] = tuple(tensor.shape)
    tied = {"lm_head.weight"} if args.tie_word_embeddings else set()
    assert {n: tuple(t.shape) for n, t in ours.state_dict().items() if n not in tied} == held
