"""Quantized weights: round trips, kernels, tiny-model logits, GGUF -> quantized layout.

- quantize/dequantize per scheme stays within half a quantization step;
- QuantLinear's kernels compute x @ dequantized(W)^T (padded rows, bias, 3-D input);
- a quantized tiny model equals the float model holding its dequantized weights, and
  its logits stay within a stated distance of the float model's;
- GGUF Q4_K_M (Q4_K + Q6_K) and Q8_0 files written here load into the quantized layout
  matching gguf's reference de-quantization (Q4_K exactly; llama's permuted q/k rows
  restored), are cached by content + scheme + dtype, and load without ever holding a
  full-precision copy (peak resident memory measured in a fresh process).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from ssdlocal.backends.torch import gguf_quant
from ssdlocal.backends.torch.int4_cpu import expected_layout
from ssdlocal.backends.torch.loader import load_model
from ssdlocal.backends.torch.quant import QuantLinear, quantize
from ssdlocal.backends.torch.quant_apply import QuantEmbedding, model_bytes
from ssdlocal.core.errors import UsageError
from ssdlocal.weights.formats.archs import architecture
from ssdlocal.weights.formats.gguf import gguf_scheme

gguf = pytest.importorskip("gguf")
from support import tiny_gguf
from support.quant import dequantized_copy, effective_weight

IDS = torch.tensor([[5, 17, 200, 3, 99, 12, 40, 41, 42, 43, 100, 7]])
# torch's CPU int4 kernel (and so its weight layout) follows the instruction set it dispatches
# to: the int4 test ids name it (ATEN_CPU_CAPABILITY=avx2 pins an AVX-512 machine to AVX2).
ISA = torch.backends.cpu.get_cpu_capability().lower()
SCHEMES = ["int8", pytest.param("int4", id=f"int4-{ISA}")]


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path_factory.getbasetemp() / "quant-cache"))


def logits(loaded, dtype=torch.float32) -> torch.Tensor:
    t = IDS.shape[1]
    pos = torch.arange(t)[None]
    loaded.model.setup_cache(1, t, dtype, "cpu")
    mask = torch.ones(1, t, t, dtype=torch.bool).tril()
    return loaded.model(IDS, pos, pos, mask).float()  # [1, T, V]


# --------------------------------------------------------------------------- units


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_round_trip_within_half_a_step(scheme, dtype):
    w = torch.randn(96, 256) * 0.05
    w[3] = 0.0  # an all-zero row and a constant group must survive
    w[4, :32] = 0.7
    qw = quantize(w, scheme, dtype)
    err = (qw.dequantize() - w).abs()
    if scheme == "int8":
        step = (w.abs().amax(1, keepdim=True) / 127).expand_as(w)
    else:
        g = w.view(96, 8, 32)
        step = ((g.amax(-1) - g.amin(-1)) / 15).repeat_interleave(32, 1)
    slack = 1e-6 if dtype == torch.float32 else 0.01 * float(w.abs().max())  # bf16 scales/zeros
    assert (err <= step / 2 + slack).all(), float((err - step / 2).max())
    assert err[3].max() == 0 and (err[4, :32] < 1e-2).all()
    size = torch.empty(0, dtype=dtype).element_size()
    assert qw.nbytes == (96 * 256 + 96 * size if scheme == "int8" else 96 * 128 + 2 * 96 * 8 * size)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_head_rows_and_fp32_logits(scheme, record_property):
    """A quantized lm_head's rows de-quantize to exactly the weights the kernel uses, and
    fp32_logits recomputes its best candidates from them in float32 (ties in bf16 output
    then do not depend on how many tokens one forward scores)."""
    from ssdlocal.backends.torch.logits import REFINED, fp32_logits

    record_property("cpu_capability", ISA)
    torch.manual_seed(0)
    w = torch.randn(72, 128) * 0.05  # 72 rows: int4 pads them to the kernel's 96
    qw = quantize(w, scheme, torch.bfloat16)
    lin = QuantLinear(qw, None, dtype=torch.bfloat16, device="cpu")
    idx = torch.tensor([[0, 71], [17, 40]])
    assert torch.equal(lin.dequantize_rows(idx), qw.dequantize()[idx])
    h = torch.randn(2, 3, 128).bfloat16()
    exact = h.float() @ qw.dequantize().t()  # [2, 3, 72]
    got = fp32_logits(lin, h)
    refined = lin(h).float().topk(REFINED, dim=-1).indices  # the candidates recomputed
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    assert torch.allclose(got.gather(-1, refined), exact.gather(-1, refined), atol=1e-5)
    assert not torch.equal(lin(h).float(), exact)  # the kernel's bf16 output is rounded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("n", [64, 40, 200])  # int4 pads rows to 32: 64 + a partial block on AVX-512
def test_kernel_equals_dequantized_matmul(scheme, dtype, n):
    w, bias = torch.randn(n, 128) * 0.05, torch.randn(n)
    qw = quantize(w, scheme, dtype)
    lin = QuantLinear(qw, bias, dtype=dtype, device="cpu")
    assert lin.kernel == f"{scheme}_cpu"
    x = torch.randn(2, 5, 128).to(dtype)
    ref = x.float() @ qw.dequantize().t() + bias.to(dtype).float()
    out = lin(x)
    assert out.shape == (2, 5, n) and out.dtype == dtype
    if scheme == "int4":  # the layout this CPU's kernel reads, built natively (not by torch)
        assert lin.layout == expected_layout()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (out.float() - ref).abs().max() <= tol * ref.abs().max()


def test_tensor_parallel_slices_compose():
    """Rows and group-aligned columns of a QuantizedWeight dequantize to W's slices."""
    w = torch.randn(64, 128)
    for scheme in ("int8", "int4"):
        qw = quantize(w, scheme, torch.float32)
        full = qw.dequantize()
        assert torch.equal(qw.rows(16, 48).dequantize(), full[16:48])
        assert torch.equal(qw.cols(64, 128).dequantize(), full[:, 64:])
    with pytest.raises(ValueError, match="aligned"):
        quantize(w, "int4", torch.float32).cols(0, 48)


# --------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_tiny_model(tiny_dir, tmp_path, arch, scheme):
    """Exactly the float model of its dequantized weights; close to the original model."""
    float_logits = logits(load_model(tiny_dir[arch], "cpu", "float32"))
    quant = load_model(tiny_dir[arch], "cpu", "float32", scheme)
    assert quant.quantization == scheme
    names = {n for n, m in quant.model.named_modules() if isinstance(m, QuantLinear)}
    assert len(names) == 7 * quant.args.num_layers + 1  # all projections and lm_head
    assert isinstance(quant.model.embed_tokens.weight, torch.nn.Parameter)  # stays float
    q_logits = logits(quant)
    same = load_model(dequantized_copy(tiny_dir[arch], tmp_path / "deq", quant), "cpu", "float32")
    assert (logits(same) - q_logits).abs().max() < 1e-4
    # random tiny models spread weights evenly, the worst case for 4 bits
    rel = float(((q_logits - float_logits).pow(2).mean() / float_logits.pow(2).mean()).sqrt())
    assert rel < {"int8": 0.05, "int4": 0.45}[scheme], rel
    assert model_bytes(quant.model) < model_bytes(load_model(tiny_dir[arch], "cpu", "float32").model)


def test_auto_and_mismatch(tiny_dir):
    from ssdlocal.weights.formats.quantized import resolve_scheme

    assert resolve_scheme(tiny_dir["llama"], "auto") == "none"  # safetensors: float
    assert resolve_scheme(tiny_dir["llama"], "int8") == "int8"
    with pytest.raises(UsageError, match="quantization"):
        resolve_scheme(tiny_dir["llama"], "int3")


# --------------------------------------------------------------------------- GGUF


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """{(arch, mix): (path, transformers model)}; qwen2 tied, llama untied."""
    root = tmp_path_factory.mktemp("gguf-quant")
    out = {}
    for arch in ("qwen2", "llama"):
        model = tiny_gguf.make_hf_model(arch, seed=3, tie=arch == "qwen2")
        for mix in ("q4_k_m", "q8_0"):
            out[arch, mix] = (tiny_gguf.write_gguf(root / f"{arch}-{mix}.gguf", model, arch, mix), model)
    return out


def _reference(path: Path, arch: str, model) -> dict[str, tuple[str, np.ndarray]]:
    """our module name -> (ggml type, gguf's own de-quantization in Hugging Face row order)."""
    cfg = model.config
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        name = architecture(arch).from_gguf(t.name)
        if name is None or not name.endswith(".weight") or len(t.shape) != 2:
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(int(t.shape[1]), int(t.shape[0]))
        module = name.removesuffix(".weight")
        if arch == "llama" and module.endswith(("q_proj", "k_proj")):  # transformers' inverse
            n_head = cfg.num_attention_heads if module.endswith("q_proj") else cfg.num_key_value_heads
            w = w.reshape(n_head, -1, 2, w.shape[1]).swapaxes(2, 1).reshape(w.shape)
        out["lm_head" if module == "embed_tokens" and cfg.tie_word_embeddings else module] = (t.tensor_type.name, w)
    return out


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("mix", ["q4_k_m", "q8_0"])
def test_gguf_loads_into_quantized_layout(gguf_files, arch, mix):
    path, model = gguf_files[arch, mix]
    loaded = load_model(path, "cpu", "float32", "auto")
    scheme = {"q4_k_m": "int4", "q8_0": "int8"}[mix]
    assert loaded.quantization == scheme and loaded.path.parent.name == "quantized"
    ref = _reference(path, arch, model)
    hf_state = model.state_dict()
    for name, module in loaded.model.named_modules():
        if not isinstance(module, QuantLinear):
            continue
        kind, want = ref[name]
        got = effective_weight(module).numpy()
        if kind == "Q4_K":  # same values in another layout
            bound = 1e-5 * np.abs(want).max()
        elif scheme == "int4":  # Q6_K re-quantized: half a step of each group's range
            g = want.reshape(want.shape[0], -1, 32)
            bound = ((g.max(-1) - g.min(-1)) / 30).repeat(32, 1) + 1e-6
        else:  # Q8_0 -> one scale per row
            bound = np.abs(want).max(1, keepdims=True) / 254 + 1e-6
        assert (np.abs(got - want) <= bound).all(), f"{name} ({kind})"
        hf_key = (
            "lm_head.weight"
            if name == "lm_head" and "lm_head.weight" in hf_state
            else ("model.embed_tokens.weight" if name == "lm_head" else f"model.{name}.weight")
        )
        hf = hf_state[hf_key].numpy()  # the rows are in Hugging Face order again
        assert np.abs(got - hf).max() < 0.3 * np.abs(hf).max(), name
    # the embedding stays quantized: Q4_K exactly as int4, Q8_0 as int8 rows
    emb = loaded.model.embed_tokens
    assert isinstance(emb, QuantEmbedding) and emb.scheme == scheme
    ids = torch.arange(emb.num_embeddings)
    want = gguf.quants.dequantize(
        *next((t.data, t.tensor_type) for t in gguf.GGUFReader(str(path)).tensors if t.name == "token_embd.weight")
    ).reshape(emb.num_embeddings, -1)
    bound = 1e-5 * np.abs(want).max() if scheme == "int4" else np.abs(want).max(1, keepdims=True) / 254 + 1e-6
    assert (np.abs(emb(ids).numpy() - want) <= bound).all()


def test_gguf_scheme_and_cache_key(gguf_files, tmp_path, monkeypatch):
    path, _ = gguf_files["qwen2", "q4_k_m"]
    assert gguf_scheme(path) == "int4"
    assert gguf_scheme(gguf_files["qwen2", "q8_0"][0]) == "int8"
    first = gguf_quant.ensure_quantized(path, "int4", "float32")
    info = json.loads((first / "quantization.json").read_text())
    assert info["scheme"] == "int4" and info["tensors"]["exact_int4"] > 0
    assert not list(first.parent.glob("*.tmp-*"))
    # cached by content: a copy elsewhere hits it, without converting again
    monkeypatch.setattr(gguf_quant, "_convert", lambda *a, **k: pytest.fail("converted again"))
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    assert gguf_quant.ensure_quantized(copy, "int4", "float32") == first
    assert gguf_quant.quantized_dir(copy, "int8", "float32") != first
    assert gguf_quant.quantized_dir(copy, "int4", "bfloat16") != first
    with open(copy, "r+b") as fh:  # other content: another key
        fh.seek(-1, 2)
        fh.write(b"\x01")
    assert gguf_quant.quantized_dir(copy, "int4", "float32") != first
    monkeypatch.setattr(gguf_quant, "_convert", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        gguf_quant.ensure_quantized(copy, "int4", "float32")
    target = gguf_quant.quantized_dir(copy, "int4", "float32")
    assert not target.exists() and not list(target.parent.glob(f"{target.name}.tmp-*"))


def test_quantized_dir_refuses_other_scheme(gguf_files):
    from ssdlocal.weights.formats.quantized import resolve_scheme

    ckpt = gguf_quant.ensure_quantized(gguf_files["qwen2", "q4_k_m"][0], "int4", "float32")
    assert resolve_scheme(ckpt, "auto") == "int4"
    assert load_model(ckpt, "cpu", "float32", "auto").quantization == "int4"
    with pytest.raises(UsageError, match="int4 weights"):
        load_model(ckpt, "cpu", "float32", "int8")


def test_weight_bytes_estimate(gguf_files, tiny_dir):
    from ssdlocal.weights.size import weight_bytes

    for path, scheme, dtype in (
        (gguf_files["llama", "q4_k_m"][0], "int4", "bfloat16"),
        (gguf_files["qwen2", "q8_0"][0], "int8", "float32"),
        (tiny_dir["qwen3"], "int4", "float32"),
    ):
        real = model_bytes(load_model(path, "cpu", dtype, scheme).model)
        assert abs(weight_bytes(path, scheme, dtype) - real) < 0.1 * real, path


_PEAK_SCRIPT = """
import json, sys
import torch
from ssdlocal.backends.torch.loader import load_model
from ssdlocal.backends.torch.models import args_from_config, build
from ssdlocal.backends.torch.quant_apply import model_bytes
from ssdlocal.weights.formats.checkpoint import config_dir, load_hf_config, load_tokenizer

path = sys.argv[1]
# outside the measured window: imports, the tokenizer, meta-device modules (~80 MB of code)
load_tokenizer(path)
with torch.device("meta"):
    build(args_from_config(load_hf_config(config_dir(path))))

def status_mb(field):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field)) / 1024

with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")  # the peak (VmHWM) restarts from the current resident size
before = status_mb("VmRSS")
loaded = load_model(path, "cpu", "bfloat16", "int4")
print(json.dumps({"before": before, "peak": status_mb("VmHWM"), "model_mb": model_bytes(loaded.model) / 2**20}))
"""


def test_gguf_load_peak_memory(tmp_path):
    """Converting and loading a 120M-parameter Q4_K_M GGUF as int4 in a fresh process: the
    resident peak (VmHWM, reset at the start) grows by about the model's final size, far
    below a bf16 copy of it."""
    path, params = tiny_gguf.write_random_gguf(tmp_path / "big.gguf", hidden=1024, ffn=4096, layers=8)
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_PEAK_SCRIPT), str(path)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    m = json.loads(run.stdout.strip().splitlines()[-1])
    bf16_mb = params * 2 / 2**20
    assert m["model_mb"] < 0.35 * bf16_mb, m
    growth = m["peak"] - m["before"]
    assert growth < m["model_mb"] + 64, m  # the model plus one block of rows in flight
    assert growth < 0.6 * bf16_mb, m


def test_the_backend_prepares_and_sizes_what_it_will_load(gguf_files, tiny_dir, monkeypatch):
    """The CLI, `pull` and bench ask backends.registry, not the quantizer, what a backend
    will load: the torch backend's cache of a GGUF as `auto` resolves for it (the cache a
    load reads), the file itself where no floats are wanted or llama.cpp reads it (nothing
    converted), a checkpoint directory itself; the planner asks weights.size for its bytes:
    quantized bytes are weight_bytes's, None for floats."""
    from ssdlocal.backends.registry import prepare_weights
    from ssdlocal.weights.size import quantized_bytes, weight_bytes
    from ssdlocal.weights.formats import convert

    path = gguf_files["qwen2", "q4_k_m"][0]
    ckpt = prepare_weights(path, "torch", "auto", "float32")
    assert ckpt == gguf_quant.ensure_quantized(path, "int4", "float32")
    assert load_model(path, "cpu", "float32", "auto").path == ckpt
    assert prepare_weights(path, "torch", "int8", "float32", floats=False) == gguf_quant.quantized_dir(
        path, "int8", "float32"
    )
    monkeypatch.setattr(convert, "_convert", lambda *a, **k: pytest.fail("converted to floats"))
    assert prepare_weights(path, "torch", "none", "float32", floats=False) == path
    assert prepare_weights(path, "llamacpp", "auto", "float32") == path
    assert prepare_weights(tiny_dir["llama"], "torch", "none", "float32") == tiny_dir["llama"]
    with pytest.raises(UsageError, match="quantization"):
        prepare_weights(path, "torch", "int3", "float32")
    assert quantized_bytes(path, "auto", "float32") == weight_bytes(path, "int4", "float32") > 0
    assert quantized_bytes(tiny_dir["llama"], "auto", "float32") is None


def test_gguf_source_of_converted_checkpoints(gguf_files, tmp_path):
    """bench's llama.cpp peers default to the GGUF a (converted) target came from."""
    from ssdlocal.weights.cache import gguf_source
    from ssdlocal.bench.run import BenchSettings
    from ssdlocal.cli.bench import _default_gguf_peers
    from ssdlocal.core.config import EngineConfig, ModelSpec, SpecConfig
    from ssdlocal.core.paths import cache_dir
    from ssdlocal.weights.formats.convert import ensure_converted

    path = gguf_files["qwen2", "q8_0"][0]
    assert gguf_source(str(path)) == str(path)
    assert gguf_source(str(gguf_quant.ensure_quantized(path, "int8", "float32"))) == str(path.resolve())
    cached = cache_dir() / "gguf" / "tiny-f32.gguf"  # where downloaded assets live
    cached.parent.mkdir(parents=True, exist_ok=True)
    tiny_gguf.write_gguf(cached, gguf_files["qwen2", "q8_0"][1], "qwen2", "f32")
    assert gguf_source(str(ensure_converted(cached, dtype="float32"))) == str(cached)
    assert gguf_source(str(tmp_path)) is None and gguf_source("ngram") is None
    config = EngineConfig(ModelSpec(str(path), dtype="float32"), SpecConfig(), None)
    settings = _default_gguf_peers(BenchSettings(peers=("llamacpp",)), config)
    assert settings.gguf_target == str(path) and settings.gguf_draft is None
    assert _default_gguf_peers(BenchSettings(), config).gguf_target is None  # no llama.cpp peer


def test_quantize_model_equals_quantized_load(tiny_dir):
    """Swapping a loaded float model's linears gives the model a quantized load gives."""
    from ssdlocal.backends.torch.quant_apply import quantize_model

    for scheme in ("int8", "int4"):
        swapped = load_model(tiny_dir["qwen2"], "cpu", "float32")
        quantize_model(swapped.model, scheme)
        assert isinstance(swapped.model.lm_head, QuantLinear)
        loaded = load_model(tiny_dir["qwen2"], "cpu", "float32", scheme)
        assert torch.equal(logits(swapped), logits(loaded))


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernels_equal_dequantized_matmul(scheme, dtype):
    w, bias = torch.randn(200, 384) * 0.05, torch.randn(200)
    qw = quantize(w, scheme, dtype)
    if scheme == "int4" and dtype != torch.bfloat16:  # tinygemm takes bfloat16 only
        with pytest.raises(UsageError):
            QuantLinear(qw, bias, dtype=dtype, device="cuda")
        return
    lin = QuantLinear(qw, bias, dtype=dtype, device="cuda")
    assert lin.kernel == f"{scheme}_cuda"
    if scheme == "int4":  # tinygemm's layout as this torch writes it, read back
        assert lin.tinygemm_readable
        assert torch.allclose(lin.dequantize_rows(torch.arange(200, device="cuda")).cpu(), qw.dequantize(), atol=1e-6)
    x = torch.randn(3, 7, 384).to(dtype)
    ref = x.float() @ qw.dequantize().t() + bias.to(dtype).float()
    out = lin(x.cuda()).float().cpu()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert (out - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.gpu
def test_cuda_quantized_model_matches_cpu(gguf_files):
    path, _ = gguf_files["llama", "q4_k_m"]
    cpu = logits(load_model(path, "cpu", "bfloat16", "int4"), torch.bfloat16)
    gpu = load_model(path, "cuda", "bfloat16", "int4")
    t = IDS.shape[1]
    pos = torch.arange(t, device="cuda")[None]
    gpu.model.setup_cache(1, t, torch.bfloat16, "cuda")
    mask = torch.ones(1, t, t, dtype=torch.bool, device="cuda").tril()
    out = gpu.model(IDS.cuda(), pos, pos, mask).float().cpu()
    assert (out - cpu).abs().max() < 0.05 * cpu.abs().max()


def test_hf_peer_reads_a_gguf_target_through_its_float_conversion(gguf_files, tmp_path):
    """bench's transformers peers get a checkpoint directory even when our target is a
    .gguf file (the default pair under --quantization auto)."""
    from ssdlocal.bench.peers import HFPeer, PeerOptions

    path = tmp_path / "f32.gguf"
    tiny_gguf.write_gguf(path, gguf_files["qwen2", "q8_0"][1], "qwen2", "f32")
    peer = HFPeer("hf-assisted", PeerOptions(str(path), str(path), "float32", "cpu", 2), frozenset({0}), 0)
    with torch.no_grad():
        want = gguf_files["qwen2", "q8_0"][1](IDS).logits
        got = peer.model(IDS).logits  # the conversion is cached in bf16
        assert (got - want).abs().max() < 0.05 * want.abs().max() and peer.assistant is not None


def test_quantize_model_quantizes_on_the_model_s_device(tiny_dir, monkeypatch):
    """A model on a GPU is quantized there, not copied to the CPU first (a 7B model's int4
    codes in seconds; scripts/gpu_accept.py quantizes its timing models so)."""
    from ssdlocal.backends.torch import quant, quant_apply
    from support.fake_cuda import CUDA, fake_cuda, to_fake_cuda

    seen = []
    real = quant_apply.quantize
    monkeypatch.setattr(quant_apply, "quantize", lambda w, *a: seen.append(w.device) or real(w, *a))
    monkeypatch.setattr(quant, "int8_cuda_kernel", lambda: True)  # a CUDA build has it
    loaded = load_model(tiny_dir["qwen2"], "cpu", "float32")
    with fake_cuda():
        model = to_fake_cuda(loaded.model, torch.bfloat16)
        quant_apply.quantize_model(model, "int8")
    assert seen and set(seen) == {CUDA}
    assert model.lm_head.kernel == "int8_cuda" and model.lm_head.codes.device == CUDA
