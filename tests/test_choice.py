"""Choices between modules are enum members made once at the edge (core/choice.py): the
backend, the SSD backup, the logits a feed returns, the grammar kind; and the drafter of
each draft type comes from one table (draft/factory.py), not from strings in core."""

from __future__ import annotations


import json
import pickle
import re
from pathlib import Path

import pytest
from support.cli import assert_clean_error, run_cli

from ssdlocal.backends.base import Logits
from ssdlocal.core.config import Backup, Mode, ModelSpec, SpecConfig
from ssdlocal.core.errors import UsageError
from ssdlocal.core.models import DRAFT_KINDS, BackendName, NoDraft
from ssdlocal.grammar.kinds import GrammarKind, GrammarSpec

PACKAGE = Path(__file__).resolve().parent.parent / "ssdlocal"
CHOICES = (Backup, BackendName, Logits, GrammarKind)


@pytest.mark.parametrize("kind", CHOICES)
def test_a_choice_is_parsed_once_and_then_is_its_word(kind):
    for member in kind:
        assert kind.parse(member.value.upper(), "x") is member  # the user's text, any case
        assert kind.parse(member, "x") is member  # a member passes through
        assert str(member) == f"{member}" == member.value  # prints as the word on every Python
        assert json.dumps({member: [member]}) == json.dumps({member.value: [member.value]})
        assert pickle.loads(pickle.dumps(member)) is member  # crosses to the SSD worker / compile children
    with pytest.raises(UsageError) as info:
        kind.parse("bogus", "setting")
    assert info.value.message == "unknown setting 'bogus'"
    assert info.value.hint == "choose one of: " + ", ".join(m.value for m in kind)


def test_configs_hold_members_and_refuse_unknown_words_with_the_choices():
    assert SpecConfig(backup="NGRAM").backup is Backup.NGRAM
    assert ModelSpec("m", backend="llamacpp").backend is BackendName.LLAMACPP
    with pytest.raises(UsageError, match="unknown backup 'sometimes'") as info:
        SpecConfig(mode=Mode.AR, backup="sometimes")
    assert all(word in info.value.hint for word in ("auto", "jit", "ngram", "suffix", "none"))
    with pytest.raises(UsageError, match="unknown backend 'onnx'") as info:
        ModelSpec("m", backend="onnx")
    assert info.value.hint == "choose one of: torch, llamacpp"


def test_backend_facts_belong_to_the_name():
    assert BackendName.TORCH.quantizes and BackendName.TORCH.tensor_parallel
    assert not BackendName.TORCH.runs_gguf
    assert BackendName.LLAMACPP.runs_gguf
    assert not (BackendName.LLAMACPP.quantizes or BackendName.LLAMACPP.tensor_parallel)
    with pytest.raises(UsageError, match="torch backend only"):
        ModelSpec("m.gguf", backend=BackendName.LLAMACPP, quantization="int4")


def test_every_backend_has_one_entry_in_the_registry():
    from ssdlocal.backends import registry

    assert set(registry.FACTORIES) == set(BackendName)
    for name in BackendName:
        backend = registry.backend_for(name.value.upper())
        assert backend.name is name and registry.backend_for(name) is backend  # made once
    with pytest.raises(UsageError, match="unknown backend 'onnx'"):
        registry.backend_for("onnx")


def test_make_runner_goes_to_the_backend_that_loaded_the_model(monkeypatch):
    from ssdlocal.backends import registry

    made = []
    for name in BackendName:
        backend = registry.backend_for(name)
        monkeypatch.setattr(
            backend, "make_runner", lambda loaded, tree, graphs, name=name: made.append((name, tree, graphs))
        )

    class Loaded:
        def __init__(self, backend):
            self.backend = backend

    registry.make_runner(Loaded(BackendName.LLAMACPP), tree=True)
    registry.make_runner(Loaded(BackendName.TORCH), graphs="off")
    assert made == [(BackendName.LLAMACPP, True, "auto"), (BackendName.TORCH, False, "off")]


def test_feed_refuses_an_unknown_logits_choice_as_a_callers_bug():
    assert Logits.of("last") is Logits.LAST
    with pytest.raises(ValueError, match="logits must be one of"):
        Logits.of("first")


def test_a_grammar_spec_parses_its_kind_and_checks_text_sources():
    assert GrammarSpec("REGEX", "a+").kind is GrammarKind.REGEX
    assert GrammarKind.JSON_SCHEMA.words == "json schema"
    with pytest.raises(UsageError, match="unknown grammar kind 'yaml'") as info:
        GrammarSpec("yaml", "a: b")
    assert info.value.hint == "choose one of: json_schema, json_object, regex, lark"
    with pytest.raises(UsageError, match="a regex grammar is text"):
        GrammarSpec(GrammarKind.REGEX, {"type": "object"})


def test_every_draft_type_that_proposes_has_a_builder_and_core_names_no_drafter():
    from ssdlocal.draft.factory import BUILDERS

    assert set(BUILDERS) == set(DRAFT_KINDS) - {NoDraft}
    assert all(callable(build) for build in BUILDERS.values())
    assert not any(hasattr(kind, "builder") for kind in DRAFT_KINDS)
    core = "\n".join(path.read_text() for path in (PACKAGE / "core").glob("*.py"))
    assert not re.search(r"[\"']ssdlocal\.[\w.]+:\w+[\"']", core)  # no "module:function" to import


# string comparisons against a choice's words, outside the module that defines the choice
# and the CLI options' default texts
_BACKEND_WORDS = re.compile(r'(==|!=)\s*"(torch|llamacpp)"|"(torch|llamacpp)"\s*(==|!=|in\b)|in \("(torch|llamacpp)"')
_BACKUP_WORDS = re.compile(r'backup\s*(==|!=)\s*"|backup\s+in\s+\("')
_LOGITS_WORDS = re.compile(r'logits\s*(==|!=)\s*"|\.feed\([^)]*,\s*"(all|last|none)"')
_GRAMMAR_WORDS = re.compile(r'kind\s*(==|!=)\s*"(json_schema|json_object|regex|lark)"')


def test_no_module_compares_a_choice_as_a_string():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for pattern in (_BACKEND_WORDS, _BACKUP_WORDS, _LOGITS_WORDS, _GRAMMAR_WORDS):
                if pattern.search(code):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert not found, "compare the enum member instead:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--backup", "sometimes"], ["unknown --backup 'sometimes'", "jit, ngram, suffix, none"]),
        (["--target-backend", "onnx"], ["unknown --target-backend 'onnx'", "torch, llamacpp"]),
        (["--draft-backend", "onnx"], ["unknown --draft-backend 'onnx'", "torch, llamacpp"]),
    ],
)
def test_the_cli_parses_choices_before_anything_is_fetched(monkeypatch, capsys, args, needles):
    from ssdlocal.cli import resolve

    def no_download(*_args, **_kwargs):
        raise AssertionError("the default pair must not be fetched for a bad option")

    monkeypatch.setattr(resolve, "default_pair_paths", no_download)
    code, _, err = run_cli(monkeypatch, capsys, "generate", "hi", *args)
    assert_clean_error(code, err, 2, *needles)
