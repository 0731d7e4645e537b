"""Every model family beyond the llama family, against transformers' own implementation on
tiny float32 checkpoints written with its classes (tests/support/tiny_families.py): logits
at every position of a batch (one forward, then token by token through the cache), greedy
generation equal to transformers' `generate`, and in our engine AR == SD (a draft model of
the same family, n-gram) == SSD, eager and in traced graphs, and on two tensor-parallel
ranks. Quantized families are held to their dequantized reference in test_quant_families."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from support.drafts import draft_of
from support.tiny_families import FAMILIES
from support.tiny_models import build_tokenizer, make_draft_like

from ssdlocal.backends.torch.loader import load_model
from ssdlocal.backends.torch.models import causal_mask
from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, NgramDraft, SamplingParams, SpecConfig
from ssdlocal.core.events import DoneEvent, SeatedEvent, TokensEvent
from ssdlocal.engine import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "def fibonacci(n):\n    if n < 2:"]
NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)
PROMPT_IDS = tuple(range(100, 120))  # 20 tokens: past a sliding window of 8


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """name -> (target, draft: a noisy copy) directories of every family."""
    root = tmp_path_factory.mktemp("families")
    tok = root / "tokenizer"
    build_tokenizer(tok)
    out = {}
    for name, (make, _) in FAMILIES.items():
        target = make(root / name, tok)
        out[name] = (target, make_draft_like(target, root / f"draft_{name}", noise=0.004, seed=31))
    return out


def _reference(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers_at_every_position(family_dirs, family):
    target, _ = family_dirs[family]
    ref, tok = _reference(target)
    ours = load_model(target, "cpu", "float32").model
    ids = torch.tensor([tok(p).input_ids[:12] for p in PROMPTS])  # [2, 12]
    B, T = ids.shape
    with torch.inference_mode():
        want = ref(ids).logits  # [B, T, V]
        ours.setup_cache(B, 64, torch.float32, "cpu")
        pos = torch.arange(T)[None].repeat(B, 1)
        whole = ours(ids, pos, pos, causal_mask(pos, T))  # [B, T, V]: one masked forward
        torch.testing.assert_close(whole, want, rtol=1e-4, atol=1e-4)
        ours.setup_cache(B, 64, torch.float32, "cpu")
        steps = []
        for t in range(T):  # token by token through the cache, as decoding reads it
            p = pos[:, t : t + 1]
            steps.append(ours(ids[:, t : t + 1], p, p, causal_mask(p, T)))
        torch.testing.assert_close(torch.cat(steps, dim=1), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_cuda_mask_form_gives_the_same_logits(family_dirs, family, monkeypatch):
    """CUDA's masked kernel folds each kv head's query heads into the queries, so a mask is
    built per head grouping (Gemma 4's global layers group differently from its local
    ones); computed here on the CPU in that form, a forward past the window and a tree
    step give the CPU kernel's logits."""
    from ssdlocal.backends.torch import attention

    target, _ = family_dirs[family]
    model = load_model(target, "cpu", "float32").model
    ids = torch.tensor([list(PROMPT_IDS[:14]), list(PROMPT_IDS[3:17])])  # [2, 14]
    pos = torch.arange(14)[None].repeat(2, 1)
    tree_pos = torch.tensor([[14, 15, 15, 16]]).repeat(2, 1)  # two branches after position 14
    tree_slots = torch.tensor([[14, 15, 16, 17]]).repeat(2, 1)
    tree = causal_mask(pos[:, :1] + 13, 64)[:, [0] * 4].clone()  # [2, 4, 64]: the context
    for t, seen in enumerate([[14], [14, 15], [14, 16], [14, 16, 17]]):  # each token's slots
        tree[:, t, seen] = True
    runs = []
    for kernel in ("cpu-flash", "efficient-folded"):
        monkeypatch.setattr(attention, "attention_kernel", lambda device, masked, rows=1, span=0, k=kernel: k)
        with torch.inference_mode():
            model.setup_cache(2, 64, torch.float32, "cpu")
            whole = model(ids, pos, pos, causal_mask(pos, 14))  # [2, 14, V]
            step = model(ids[:, :4], tree_pos, tree_slots, tree)  # [2, 4, V]
        runs.append((whole, step))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_chunked_prefill_equals_one_forward(family_dirs, family):
    """Prompts read in chunks smaller than the window, one layer at a time (masks kept per
    chunk, per-layer inputs sliced per chunk), a second call continuing rows at other
    positions: the logits of one masked forward over everything."""
    target, _ = family_dirs[family]
    model = load_model(target, "cpu", "float32").model
    ids = torch.tensor([list(range(40, 70)), list(range(90, 120))])  # [2, 30]
    pos = torch.arange(30)[None].repeat(2, 1)
    with torch.inference_mode():
        model.setup_cache(2, 64, torch.float32, "cpu")
        want = model(ids, pos, pos, causal_mask(pos, 30))  # [2, 30, V]
        model.setup_cache(2, 64, torch.float32, "cpu")
        first = model.prefill(ids[:, :17], pos[:, :17], None, chunk=5, fresh=True)  # [2, 17, V]
        rest = model.prefill(ids[:, 17:], pos[:, 17:], None, chunk=6, starts=[17, 17])  # [2, 13, V]
    torch.testing.assert_close(torch.cat([first, rest], dim=1), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_cuda_code_path_takes_the_shapes(family_dirs, family):
    """On fake CUDA tensors (tests/support/fake_cuda.py) in bf16: a fresh prefill, a verify
    step past the window and a tree step (masks folded per head grouping) give logits of
    the right shape and dtype. (The lower-right chunk kernel's bias cannot be faked.)"""
    from support.fake_cuda import CUDA, fake_cuda, to_fake_cuda

    target, _ = family_dirs[family]
    model = load_model(target, "cpu", "float32").model
    bf16 = torch.bfloat16
    with fake_cuda():
        model = to_fake_cuda(model, bf16)
        model.setup_cache(2, 256, bf16, CUDA)
        ids = torch.zeros(2, 12, dtype=torch.long, device=CUDA)
        pos = torch.arange(12, device=CUDA).unsqueeze(0).expand(2, 12)
        fresh = model(ids, pos, pos, None, torch.full((2, 1), 11, device=CUDA))
        step = model(ids[:, :4], pos[:, :4] + 12, pos[:, :4] + 12, causal_mask(pos[:, :4] + 12, 256))
        tree = model(ids, pos + 16, pos + 16, torch.ones(2, 12, 256, dtype=torch.bool, device=CUDA))
    V = model.args.vocab_size
    assert [tuple(t.shape) for t in (fresh, step, tree)] == [(2, 1, V), (2, 4, V), (2, 12, V)]
    assert {t.dtype for t in (fresh, step, tree)} == {torch.float32}


def _engine(target, draft=None, **changes) -> Engine:
    spec = SpecConfig(mode=Mode.AR, k=3, draft=draft_of(None if draft is None else str(draft)))
    return Engine(EngineConfig(target=ModelSpec(str(target), dtype="float32"), spec=spec, pin_cpus=False, **changes))


def _tokens(engine: Engine, spec: SpecConfig) -> list[tuple[int, ...]]:
    """The greedy tokens of PROMPTS; a draft that failed (its rows finished with plain steps)
    fails the caller: equal tokens alone would not show that the mode ran."""
    done = [e for e in engine.generate(PROMPTS, GREEDY, spec=spec) if isinstance(e, DoneEvent)]
    assert done[0].stats.draft_losses == 0, (spec.mode, done[0].stats.draft_lost)
    return [o.token_ids for o in done[0].outputs]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_generate_and_every_mode_equals_ar(family_dirs, family):
    target, draft = family_dirs[family]
    ref, tok = _reference(target)
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok(prompt).input_ids])
        out = ref.generate(ids, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
        expected.append(tuple(out[0, ids.shape[1] :].tolist()))
    modes = {
        "ar": SpecConfig(mode=Mode.AR),
        "sd": SpecConfig(mode=Mode.SD, k=3, draft=draft_of(str(draft))),
        "sd-ngram": SpecConfig(mode=Mode.SD, k=3, draft=NgramDraft()),
        "ssd": SpecConfig(mode=Mode.SSD, k=3, draft=draft_of(str(draft))),
    }
    with _engine(target, draft, graphs="off") as engine:
        for name, spec in modes.items():
            assert _tokens(engine, spec) == expected, name
    with _engine(target, draft, graphs="trace") as traced:  # captured steps read static buffers only
        for name, spec in modes.items():
            done = [e for e in traced.generate(PROMPTS, GREEDY, spec=spec) if isinstance(e, DoneEvent)][0]
            assert [o.token_ids for o in done.outputs] == expected, name
            assert done.stats.draft_losses == 0, (name, done.stats.draft_lost)
            graphs = done.stats["graphs"]["target"]
            assert graphs["replays"] > 0 and graphs["refused"] == graphs["dropped"] == 0, (name, graphs)


@pytest.mark.parametrize("family", FAMILIES)
def test_two_tensor_parallel_ranks_equal_one_device_in_traced_graphs(family_dirs, family, monkeypatch):
    target, draft = family_dirs[family]
    modes = [SpecConfig(mode=Mode.AR), SpecConfig(mode=Mode.SD, k=3, draft=draft_of(str(draft)))]
    with _engine(target, draft, graphs="off") as one:
        want = [_tokens(one, spec) for spec in modes]
    monkeypatch.setenv("SSDLOCAL_GRAPHS", "trace")
    with _engine(target, draft, target_devices=("cpu", "cpu")) as two:
        for spec, expected in zip(modes, want):
            done = [e for e in two.generate(PROMPTS, GREEDY, spec=spec) if isinstance(e, DoneEvent)][0]
            assert [o.token_ids for o in done.outputs] == expected, spec.mode
            assert done.stats["graphs"]["target"]["replays"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_a_decode_step_is_one_traced_graph_without_host_reads(family_dirs, family):
    """Routing stays on the device: every step of a call replays a captured graph (none is
    refused) and the round reads the host once."""
    target, _ = family_dirs[family]
    with _engine(target, graphs="trace") as engine:
        done = [e for e in engine.generate(PROMPTS, GREEDY, spec=SpecConfig()) if isinstance(e, DoneEvent)][0]
        graphs, waits = done.stats["graphs"]["target"], done.stats["host_waits"]["target"]
        assert graphs["eager"] == 0 and graphs["replays"] + graphs["captured"] >= NEW - 1, graphs
        assert waits["waits_per_round"] <= 1.5, waits


@pytest.mark.parametrize("family", FAMILIES)
def test_reused_prefixes_and_rows_joining_a_batch_keep_every_answer(family_dirs, family):
    """The prefix cache (a follow-up turn reuses the first turn's blocks, far past any
    sliding window) and continuous batching (a request joins a running batch) give the
    tokens a fresh engine gives each prompt alone, in AR and SSD."""
    from ssdlocal.engine.request import Inbox
    from ssdlocal.core.sequence import Request

    target, draft = family_dirs[family]
    first = list(range(5, 45))  # 40 tokens: two whole blocks stored
    follow = first + list(range(60, 75))
    specs = [SpecConfig(mode=Mode.AR), SpecConfig(mode=Mode.SSD, k=3, draft=draft_of(str(draft)))]
    with _engine(target, graphs="off", prefix_cache_tokens=0) as fresh:
        want = {tuple(p): _alone(fresh, p, specs[0]) for p in (first, follow, PROMPT_IDS)}
    with _engine(target, draft, graphs="off") as engine:
        for spec in specs:
            assert _alone(engine, first, spec) == want[tuple(first)]
            done = [e for e in engine.generate([follow], GREEDY, spec=spec) if isinstance(e, DoneEvent)][0]
            assert done.outputs[0].token_ids == want[tuple(follow)] and done.stats["cached_prompt_tokens"] >= 32
            inbox, tokens, seated = Inbox(), {}, []
            running, joining = Request(tuple(follow), GREEDY), Request(tuple(PROMPT_IDS), GREEDY)
            inbox.add(running)
            for event in engine.serve(inbox, max_batch=4, spec=spec):
                if isinstance(event, SeatedEvent):
                    seated = list(event.requests)
                elif isinstance(event, TokensEvent):
                    tokens.setdefault(seated[event.row], []).extend(event.token_ids)
                    if len(tokens.get(running.id, ())) >= 6 and joining.id not in tokens:
                        inbox.add(joining)
                        tokens[joining.id] = []
                if sum(map(len, tokens.values())) == 2 * NEW:
                    inbox.close()
            assert tuple(tokens[running.id]) == want[tuple(follow)] and tuple(tokens[joining.id]) == want[PROMPT_IDS]


def test_a_gemma3_gguf_loads_with_its_norms_and_a_dropped_rope_scaling_is_refused(tmp_path, monkeypatch):
    """llama.cpp stores Gemma's norm weights as (1 + weight): the int8 path, which reads the
    GGUF's tensors itself, takes the 1 off again (its norms equal the model's), and its
    logits follow the float conversion's; a file whose rope scaling transformers would
    drop from the config (Gemma 3 4B and larger) is refused by name."""
    from support import tiny_gguf

    from ssdlocal.core.errors import UnsupportedArchitectureError

    monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path / "cache"))
    model = tiny_gguf.make_gemma3(seed=3)
    path = tiny_gguf.write_gguf(tmp_path / "g.gguf", model, "gemma3", "f32", extra=tiny_gguf.gemma3_metadata(model))
    quant = load_model(path, "cpu", "float32", "int8").model
    dense = load_model(path, "cpu", "float32").model
    norms = {n: p for n, p in model.named_parameters() if n.endswith("norm.weight")}
    assert len(norms) == 6 * 6 + 1
    for name, weight in norms.items():
        torch.testing.assert_close(quant.get_parameter(name.removeprefix("model.")), weight, rtol=0, atol=1e-6)
    ids = torch.tensor([[5, 17, 33, 2, 90, 41, 7, 12, 64, 3, 28, 51]])
    pos = torch.arange(12)[None]
    with torch.inference_mode():
        for m in (quant, dense):
            m.setup_cache(1, 64, torch.float32, "cpu")
        got, want = (m(ids, pos, pos, causal_mask(pos, 12)) for m in (quant, dense))
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    scaled = tiny_gguf.write_gguf(
        tmp_path / "s.gguf", model, "gemma3", "f32", extra=tiny_gguf.gemma3_metadata(model, "linear")
    )
    with pytest.raises(UnsupportedArchitectureError, match="gemma3 GGUF with rope scaling 'linear'"):
        load_model(scaled, "cpu", "float32")


def _alone(engine: Engine, prompt, spec: SpecConfig) -> tuple[int, ...]:
    done = [e for e in engine.generate([list(prompt)], GREEDY, spec=spec) if isinstance(e, DoneEvent)][0]
    return done.outputs[0].token_ids


REFUSED = [
    ("qwen3_moe", {"hidden_act": "gelu"}, "qwen3_moe with hidden_act='gelu'"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "gemma3 with attn_logit_softcapping=50.0"),
    ("gemma3", {"use_bidirectional_attention": True}, "gemma3 with use_bidirectional_attention=True"),
    (
        "gemma4",
        {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32},
        "gemma4 with enable_moe_block=True",
    ),
    ("gemma4", {"use_bidirectional_attention": "vision"}, "gemma4 with use_bidirectional_attention='vision'"),
    (
        "gpt_oss",
        {"layer_types": ["sliding_attention", "chunked_attention"] * 2},
        "gpt_oss with layer type 'chunked_attention'",
    ),
    (
        "gpt_oss",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
        "gpt_oss with partial_rotary_factor=0.5",
    ),
    (
        "gpt_oss",
        {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}},
        "gpt_oss with rope_type='longrope'",
    ),
]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_has_a_name_in_the_files_and_back(family_dirs, family):
    """The architecture's description names every tensor of the family's model (layer
    tensors outside any module, like Gemma 4's layer_scalar, included) in its checkpoint
    and, where it has GGUF names, in GGUF files; and the checkpoint holds exactly those."""
    import re

    from safetensors import safe_open

    from ssdlocal.backends.torch.models import args_from_config, build
    from ssdlocal.weights.formats.archs import architecture
    from ssdlocal.weights.formats.checkpoint import load_hf_config

    target, _ = family_dirs[family]
    args = args_from_config(load_hf_config(target))
    described = architecture(args.arch)
    with torch.device("meta"):
        model = build(args)
    ours = set(model.state_dict()) - ({"lm_head.weight"} if args.tie_word_embeddings else set())
    stored = {}  # ours -> shape; a packed tensor (gpt-oss's fused experts) as the ones it holds
    with safe_open(str(target / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118
            stored.update(described.checkpoint_shapes(name, f.get_slice(name).get_shape()))
    if args.tie_word_embeddings:
        stored.pop("lm_head.weight", None)
    stacked = {re.sub(r"\.experts\.\d+\.", ".experts.", name) for name in stored}  # loaders stack experts
    assert stacked == ours
    shapes = model.state_dict()
    assert all(tuple(shapes[n].shape) == shape for n, shape in stored.items() if n in shapes)
    for tensor in ours:
        assert described.checkpoint.ours(described.to_checkpoint(tensor)) == tensor
        if described.gguf_architecture:
            assert described.gguf.ours(described.gguf.theirs(tensor)) == tensor


@pytest.mark.parametrize(("family", "changes", "message"), REFUSED)
def test_an_unimplemented_config_field_is_refused_by_name(family_dirs, tmp_path, family, changes, message):
    import json
    import re
    import shutil

    from ssdlocal.core.errors import UnsupportedArchitectureError

    target, _ = family_dirs[family]
    changed = shutil.copytree(target, tmp_path / "changed")
    config = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(UnsupportedArchitectureError, match=re.escape(message)):
        load_model(changed, "cpu", "float32")


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_sizes_count_the_experts_a_token_reads(family_dirs, family):
    from ssdlocal.weights.size import parameters

    target, _ = family_dirs[family]
    counted = parameters(target)
    model = load_model(target, "cpu", "float32").model
    assert counted.total == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert counted.active == counted.total - experts + experts * 2 // 8  # 2 of 8 experts per token


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_weights_equal_their_dequantized_reference(family_dirs, family, scheme):
    """--quantization int8/int4 quantizes attention, MLPs and experts; the loaded model's
    logits equal the same model with every quantized weight dequantized (float32), and its
    greedy AR, SD and SSD answers agree."""
    from ssdlocal.backends.torch.quant import QuantLinear
    from ssdlocal.backends.torch.quant_experts import QuantStacked

    target, _ = family_dirs[family]
    quant = load_model(target, "cpu", "float32", scheme).model
    reference = load_model(target, "cpu", "float32").model
    kinds = set()
    if reference.args.tie_word_embeddings:  # the quantized lm_head has codes of its own
        reference.lm_head.weight = torch.nn.Parameter(reference.lm_head.weight.clone())
    with torch.no_grad():
        for name, module in quant.named_modules():
            if isinstance(module, QuantStacked):
                reference.get_submodule(name).weight.copy_(module.dequantized())
                kinds.add("experts")
            elif isinstance(module, QuantLinear):
                dense = module.dequantize_rows(torch.arange(module.out_features))
                assert dense is not None, name
                reference.get_submodule(name).weight.copy_(dense)
                kinds.add("linear")
    has_experts = any(".experts." in name for name, _ in reference.named_parameters())
    assert kinds == ({"experts", "linear"} if has_experts else {"linear"})
    ids = torch.tensor([[5, 17, 33, 2, 90, 41, 7, 12, 64, 3, 28, 51]])  # past a sliding window of 8
    T = ids.shape[1]
    pos = torch.arange(T)[None]
    with torch.inference_mode():
        for model in (quant, reference):
            model.setup_cache(1, 64, torch.float32, "cpu")
        got, want = (m(ids, pos, pos, causal_mask(pos, T)) for m in (quant, reference))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    spec = SpecConfig(mode=Mode.AR, k=3, draft=NgramDraft())
    with Engine(EngineConfig(target=ModelSpec(str(target), dtype="float32", quantization=scheme), spec=spec)) as e:
        answers = {m: _tokens(e, replace(spec, mode=m)) for m in (Mode.AR, Mode.SD, Mode.SSD)}
    assert answers[Mode.SD] == answers[Mode.AR] == answers[Mode.SSD]
