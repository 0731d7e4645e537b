"""Choices between modules are enum members made once at the edge (core/choice.py): the
backend, the SSD backup, the logits a feed returns, the grammar kind, the decoding mode,
the weights' quantization, the activation dtype and the graph mode; and the drafter of
each draft type comes from one table (draft/factory.py), not from strings in core."""

from __future__ import annotations


import json
import pickle
import re
from pathlib import Path

import pytest
from support.cli import assert_clean_error, run_cli

from ssdlocal.backends.base import Logits
from ssdlocal.core.config import Backup, EngineConfig, GraphMode, Mode, ModelSpec, SpecConfig
from ssdlocal.core.errors import UsageError
from ssdlocal.core.models import DRAFT_KINDS, BackendName, NoDraft
from ssdlocal.core.quantization import DType, Quantization
from ssdlocal.grammar.kinds import GrammarKind, GrammarSpec

PACKAGE = Path(__file__).resolve().parent.parent / "ssdlocal"
CHOICES = (Backup, BackendName, Logits, GrammarKind, Mode, Quantization, DType, GraphMode)


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


def test_model_and_engine_configs_hold_weights_dtype_and_graph_members():
    spec = ModelSpec("m", dtype="Float32", quantization="INT8")
    assert spec.dtype is DType.FLOAT32 and spec.quantization is Quantization.INT8
    assert ModelSpec("m").dtype is DType.BFLOAT16 and ModelSpec("m").quantization is Quantization.NONE
    assert EngineConfig(spec, graphs="TRACE").graphs is GraphMode.TRACE
    assert EngineConfig(spec).graphs is GraphMode.AUTO
    assert json.dumps([spec.dtype, spec.quantization]) == '["float32", "int8"]'  # --json and pair files unchanged
    with pytest.raises(UsageError, match="unknown dtype 'int3'") as info:
        ModelSpec("m", dtype="int3")
    assert info.value.hint == "choose one of: float32, bfloat16, float16"
    with pytest.raises(UsageError, match="unknown quantization 'int3'") as info:
        ModelSpec("m", quantization="int3")
    assert info.value.hint == "choose one of: none, int8, int4, auto"
    with pytest.raises(UsageError, match="unknown graphs setting 'eager'") as info:
        EngineConfig(spec, graphs="eager")
    assert info.value.hint == "choose one of: auto, off, trace"
    assert Quantization.INT8.quantized and Quantization.INT4.quantized
    assert not (Quantization.NONE.quantized or Quantization.AUTO.quantized)
    assert [d.bytes for d in DType] == [4, 2, 2]


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
_COMPARED = r"(==|!=|\bis\b|\bis not\b)"
_QUANTIZATION_WORDS = re.compile(
    rf'{_COMPARED}\s*"(int8|int4)"|"(int8|int4)"\s*{_COMPARED}|\bin\s+\([^)]*"(int8|int4)"'
    rf'|(quantization|scheme)\s*{_COMPARED}\s*"(none|auto)"|(quantization|scheme)\s+(not\s+)?in\s+\("(none|auto)"'
)
_DTYPE_WORDS = re.compile(
    rf'{_COMPARED}\s*"(float32|bfloat16|float16)"|"(float32|bfloat16|float16)"\s*{_COMPARED}'
    rf'|\bin\s+\([^)]*"(float32|bfloat16|float16)"|dtype\s*{_COMPARED}\s*"(auto|fp32|bf16|fp16)"'
)
_GRAPH_WORDS = re.compile(
    rf'{_COMPARED}\s*"(off|trace)"|"(off|trace)"\s*{_COMPARED}|graphs\s*{_COMPARED}\s*"'
    rf'|(mode|graphs)\s+(not\s+)?in\s+\([^)]*"(off|trace)"'
)
_MODE_WORDS = re.compile(rf'\.mode\s*{_COMPARED}\s*"(ar|sd|ssd)"|\.mode\s+(not\s+)?in\s+\("(ar|sd|ssd)"')
_WORDS = (
    _BACKEND_WORDS,
    _BACKUP_WORDS,
    _LOGITS_WORDS,
    _GRAMMAR_WORDS,
    _QUANTIZATION_WORDS,
    _DTYPE_WORDS,
    _GRAPH_WORDS,
    _MODE_WORDS,
)


def _compares_a_word(line: str) -> bool:
    code = line.split("#", 1)[0]
    return any(pattern.search(code) for pattern in _WORDS)


@pytest.mark.parametrize(
    "line",
    [
        'if spec.quantization == "int8":',
        'if scheme != "none":',
        'elif quantization in ("none", ""):',
        'if target.dtype != "float32" or x:',
        'if dtype == "auto":',
        'name = dtype if dtype in ("float32", "bfloat16") else "bfloat16"',
        'if mode == "off" or (mode == "auto" and cuda):',
        'return TracedGraphs() if mode == "trace" else CudaGraphs(device)',
        'if self.mode != "ar"',
        'same = "reference" if run.mode == "ar" else "no"',
    ],
)
def test_the_string_comparison_check_sees_each_kind_of_choice(line):
    assert _compares_a_word(line)


@pytest.mark.parametrize(
    "line",
    [
        "if scheme is Quantization.INT4:",
        'label = {DType.BFLOAT16: "bf16"}.get(dtype, dtype)',
        'if choice.mode == "auto":  # a tool choice, not a Mode',
        'kind = "trace"',
        'return scheme == "http" and own',  # a URL's scheme
    ],
)
def test_the_string_comparison_check_passes_members_and_other_words(line):
    assert not _compares_a_word(line)


def test_no_module_compares_a_choice_as_a_string():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _compares_a_word(line):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert not found, "compare the enum member instead:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--backup", "sometimes"], ["unknown --backup 'sometimes'", "jit, ngram, suffix, none"]),
        (["--target-backend", "onnx"], ["unknown --target-backend 'onnx'", "torch, llamacpp"]),
        (["--draft-backend", "onnx"], ["unknown --draft-backend 'onnx'", "torch, llamacpp"]),
        (["--dtype", "int3"], ["unknown --dtype 'int3'", "float32, bfloat16, float16"]),
        (["--quantization", "int3"], ["unknown --quantization 'int3'", "none, int8, int4, auto"]),
        (["--draft-quantization", "q2"], ["unknown --draft-quantization 'q2'", "none, int8, int4, auto"]),
    ],
)
def test_the_cli_parses_choices_before_anything_is_fetched(monkeypatch, capsys, args, needles):
    from ssdlocal.cli import resolve

    def no_download(*_args, **_kwargs):
        raise AssertionError("the default pair must not be fetched for a bad option")

    monkeypatch.setattr(resolve, "default_pair_paths", no_download)
    code, _, err = run_cli(monkeypatch, capsys, "generate", "hi", *args)
    assert_clean_error(code, err, 2, *needles)
