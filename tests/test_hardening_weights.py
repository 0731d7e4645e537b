"""Hardening of everything that reads model files: no remote code, pair files checked
against a schema, hub failures explained, pulled commits locked and verified, GGUF
conversions locked, content-keyed and never half-trusted, damaged wheels replaced, and
tokenizer compatibility judged on what the models can emit.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- remote code
def _hf_loader_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("from_pretrained", "from_config"):
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

    from ssdlocal.backends.torch.loader import load_hf_config
    from ssdlocal.core.errors import ModelLoadError

    ckpt = tmp_path / "custom"
    shutil.copytree(tiny_dir["llama"], ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config.update(model_type="evilnet", auto_map={"AutoConfig": "evil.EvilConfig"})
    (ckpt / "config.json").write_text(json.dumps(config))
    (ckpt / "evil.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(ModelLoadError):
        load_hf_config(ckpt)
