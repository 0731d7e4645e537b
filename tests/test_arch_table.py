"""One architecture table (ssdlocal/weights/formats/arch.py).

The built-in descriptions name every tensor of the model both ways; no other module
names an architecture, a checkpoint's or a GGUF's tensors; and a llama-family
architecture whose files use other names (support/renamed_arch.py) loads, runs, quantizes,
converts from GGUF and shards over two ranks exactly like llama once its description is
registered, and not before: adding it touches nothing but the table.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.renamed_arch import RENAMED, gguf_name, write_checkpoint

from ssdlocal.backends.torch.loader import load_model
from ssdlocal.backends.torch.models import args_from_config, build
from ssdlocal.weights.size import weight_bytes
from ssdlocal.core.config import ModelSpec
from ssdlocal.core.errors import UnsupportedArchitectureError
from ssdlocal.parallel.shard_loader import load_shard
from ssdlocal.weights.formats import arch, archs
from ssdlocal.weights.formats.checkpoint import load_hf_config

PACKAGE = Path(__file__).resolve().parent.parent / "ssdlocal"
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


@pytest.fixture
def registered():
    archs.register(RENAMED)
    yield RENAMED
    archs.unregister(RENAMED.name)


@pytest.fixture(scope="module")
def renamed_dirs(tiny_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("renamed")
    return {name: write_checkpoint(tiny_dir[name], root / name) for name in ("llama", "draft_llama")}


def _logits(loaded) -> torch.Tensor:
    """Float32 logits [2, 6, V] of a fresh prefill of two fixed rows."""
    loaded.model.setup_cache(2, 32, torch.float32, "cpu")
    ids = torch.tensor([[1, 5, 9, 30, 7, 2], [3, 4, 8, 100, 12, 6]])  # [2, 6]
    positions = torch.arange(6).expand(2, 6)  # [2, 6]
    return loaded.model(ids, positions, positions, None)


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- the table


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_descriptions_name_every_tensor_of_the_model_both_ways(tiny_dir, name):
    described = archs.architecture(name)
    args = args_from_config(load_hf_config(tiny_dir[name]))
    assert args.arch == name
    with torch.device("meta"):
        model = build(args)
    for tensor in model.state_dict():
        module = tensor.rpartition(".")[0]
        inside = re.fullmatch(r"layers\.\d+\.(.+)", module)
        assert (inside.group(1) in described.checkpoint.modules) if inside else module in arch.GLOBAL_MODULES, tensor
        assert described.checkpoint.ours(described.to_checkpoint(tensor)) == tensor
        assert described.gguf.ours(described.gguf.theirs(tensor)) == tensor
    for module, linear in described.linears.items():
        found = model.get_submodule(module if module == "lm_head" else f"layers.0.{module}")
        assert isinstance(found, torch.nn.Linear) and linear.split in ("column", "row", "replicated")


MODELS_REGISTRY = PACKAGE / "backends" / "torch" / "models" / "__init__.py"


def test_no_other_module_names_an_architecture_or_a_files_tensors():
    """Architecture keys, config class names, Hugging Face and GGUF tensor names are
    written in the architecture table only (weights/formats/arch.py and archs.py; the
    llama.cpp backend's probe writes a GGUF of its own); the torch models' registry names
    families (backends/torch/models/__init__.py), and every architecture's family is one."""
    pattern = re.compile(
        r'"(llama|qwen2|qwen3)"|\w+ForCausalLM"|"model\.(layers|embed_tokens|norm)\b'
        r'|"(token_embd|output_norm|output\.|blk\.|attn_|ffn_)'
    )
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name in ("arch.py", "archs.py") or "llamacpp" in path.parts or path == MODELS_REGISTRY:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line.split("#")[0]):
                found.append(f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
    from ssdlocal.backends.torch.models import FAMILIES

    assert {a.family for a in archs.architectures()} <= set(FAMILIES)


def test_register_refuses_a_clash():
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        archs.register(arch.Architecture("other", ("LlamaForCausalLM",), "other"))
    with pytest.raises(ValueError, match="lm_head"):
        arch.Architecture("other", ("OtherForCausalLM",), "other", linears={"lm_head": arch.Linear("column")})


# --------------------------------------------------------------------------- a new architecture


def test_unregistered_architecture_is_refused(renamed_dirs):
    with pytest.raises(UnsupportedArchitectureError, match="RenamedLlamaForCausalLM"):
        load_model(renamed_dirs["llama"], "cpu", "float32")


@pytest.mark.parametrize("scheme", ["none", "int8", "int4"])
def test_new_architecture_loads_and_runs_like_llama(registered, renamed_dirs, tiny_dir, scheme):
    ours = load_model(renamed_dirs["llama"], "cpu", "float32", scheme)
    reference = load_model(tiny_dir["llama"], "cpu", "float32", scheme)
    assert ours.args.arch == "renamed-llama" and reference.args.arch == "llama"
    assert _same(_state(ours.model), _state(reference.model))
    assert torch.equal(_logits(ours), _logits(reference))
    if scheme != "none":
        assert weight_bytes(renamed_dirs["llama"], scheme, "float32") == weight_bytes(
            tiny_dir["llama"], scheme, "float32"
        )


@pytest.mark.parametrize("scheme", ["none", "int8"])
def test_new_architecture_shards_like_llama(registered, renamed_dirs, tiny_dir, scheme):
    for rank in (0, 1):
        ours = load_shard(
            ModelSpec(str(renamed_dirs["llama"]), dtype="float32", quantization=scheme), "cpu", rank, 2, tokenizer=False
        )
        reference = load_shard(
            ModelSpec(str(tiny_dir["llama"]), dtype="float32", quantization=scheme), "cpu", rank, 2, tokenizer=False
        )
        assert ours.model.layers[0].self_attn.q_proj.out_features == 64 // 2  # this rank's heads
        assert _same(_state(ours.model), _state(reference.model))


def test_new_architecture_decodes_and_drafts_like_llama(registered, renamed_dirs, tiny_dir):
    from support.drafts import draft_of
    from support.renamed_arch import greedy_tokens

    from ssdlocal.core.config import EngineConfig, Mode, SamplingParams, SpecConfig
    from ssdlocal.core.events import DoneEvent
    from ssdlocal.engine import Engine

    want = greedy_tokens(tiny_dir["llama"])
    assert greedy_tokens(renamed_dirs["llama"]) == want
    spec = SpecConfig(mode=Mode.SD, k=3, draft=draft_of(str(renamed_dirs["draft_llama"])))
    config = EngineConfig(target=ModelSpec(str(renamed_dirs["llama"]), dtype="float32"), spec=spec, pin_cpus=False)
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    with Engine(config) as engine:
        done = [e for e in engine.generate(["The quick brown fox", "def foo(x):"], params) if isinstance(e, DoneEvent)]
    assert [list(o.token_ids) for o in done[0].outputs] == want


def test_new_architecture_tensor_parallel_equals_llama(renamed_dirs, tiny_dir):
    """TP=2 in a fresh process that registers the description (so do its spawned ranks)."""
    script = Path(__file__).parent / "support" / "renamed_arch.py"
    run = subprocess.run(
        [sys.executable, str(script), str(renamed_dirs["llama"]), str(tiny_dir["llama"])],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    tokens = json.loads(run.stdout.strip().splitlines()[-1])
    assert tokens["renamed_tp2"] == tokens["llama_tp1"]
    assert tokens["renamed_int8_tp2"] == tokens["llama_int8_tp1"]


@pytest.mark.parametrize("mix", ["q8_0", "q4_k_m"])
def test_new_architecture_gguf_quantizes_like_llama(registered, tmp_path, monkeypatch, mix):
    """Its GGUF names and GGUF architecture come from the description; int8 (from Q8_0) and
    exact int4 (from Q4_K) loads equal llama's GGUF of the same weights."""
    pytest.importorskip("gguf")
    from support import tiny_gguf

    monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path / "cache"))
    model = tiny_gguf.make_hf_model("llama", seed=5)
    ours = tiny_gguf.write_gguf(
        tmp_path / "renamed.gguf", model, "llama", mix, file_arch="mistral", tensor_name=gguf_name
    )
    reference = tiny_gguf.write_gguf(tmp_path / "llama.gguf", model, "llama", mix)
    got, want = (load_model(p, "cpu", "float32", "auto") for p in (ours, reference))
    assert got.args.arch == "renamed-llama" and got.quantization == want.quantization != "none"
    assert _same(_state(got.model), _state(want.model))
    assert torch.equal(_logits(got), _logits(want))
    assert weight_bytes(ours, got.quantization, "float32") == weight_bytes(reference, want.quantization, "float32")
