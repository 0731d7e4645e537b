"""Every option of every model command arrives where it is meant to, under its own name.

Each command runs through `main()` with a distinctive non-default value for every option
it has (the shared ones of ssdlocal.cli.options and its own); the model loading and the
run itself are replaced by recorders. The shared values must reach the option groups
(and the SamplingParams), the command's own values the call they configure, and
resolve.engine_config must carry every model and speculation option into EngineConfig.
A parameter whose name stops matching its field, or a value a command drops, fails here.
"""

from __future__ import annotations

from types import SimpleNamespace

from dataclasses import replace

import dataclasses
import os

import pytest
from support.cli import run_cli

from ssdlocal.cli import options
from ssdlocal.core.config import EngineConfig, ModelSpec, NgramDraft, SpecConfig

# shared option -> (command-line words, the value its group field then holds)
SHARED = {
    "target": (["--target", "t-dir"], "t-dir"),
    "draft": (["--draft", "d-dir"], "d-dir"),
    "pair": (["--pair", "p-name"], "p-name"),
    "dtype": (["--dtype", "float16"], "float16"),
    "quantization": (["--quantization", "int8"], "int8"),
    "draft_quantization": (["--draft-quantization", "int4"], "int4"),
    "target_device": (["--target-device", "cuda:3"], "cuda:3"),
    "draft_device": (["--draft-device", "cuda:5"], "cuda:5"),
    "target_devices": (["--target-devices", "cuda:0-1"], "cuda:0-1"),
    "target_backend": (["--target-backend", "torch"], "torch"),
    "draft_backend": (["--draft-backend", "llamacpp"], "llamacpp"),
    "cuda_graphs": (["--no-cuda-graphs"], False),
    "batch_invariant": (["--batch-invariant"], True),
    "prefix_cache": (["--no-prefix-cache"], False),
    "prefix_cache_tokens": (["--prefix-cache-tokens", "4096"], 4096),
    "mode": (["--mode", "sd"], "sd"),
    "k": (["--k", "7"], 7),
    "fan_out": (["--fan-out", "1,2"], "1,2"),
    "fan_out_miss": (["--fan-out-miss", "2,1"], "2,1"),
    "saguaro_c": (["--saguaro-c", "0.5"], 0.5),
    "backup": (["--backup", "jit"], "jit"),
    "suffix": (["--no-suffix"], False),
    "suffix_memory_tokens": (["--suffix-memory-tokens", "5000"], 5000),
    "persist_suffix_memory": (["--persist-suffix-memory"], True),
    "temperature": (["--temperature", "0.7"], 0.7),
    "top_k": (["--top-k", "9"], 9),
    "top_p": (["--top-p", "0.9"], 0.9),
    "seed": (["--seed", "11"], 11),
    "max_new_tokens": (["--max-new-tokens", "13"], 13),
    "ignore_eos": (["--ignore-eos"], True),
    "stop": (["--stop", "zz", "--stop", "yy"], ("zz", "yy")),  # a tuple in SamplingParams
}

# each command's own options -> (command-line words, where the value lands: see _landed)
OWN = {
    "generate": {
        "prompts": (["p1"], ["p1"]),
        "chat": (["--chat"], True),
        "num_samples": (["--num-samples", "3"], 3),
        "as_json": (["--json"], True),
        "json_schema": (["--json-schema", "SCHEMA"], {"type": "object"}),
        "regex": (["--regex", "[a-z]+"], "[a-z]+"),
        "fim_suffix": (["--fim-suffix", "AFTER"], "AFTER"),
    },
    "chat": {"system": (["--system", "be brief"], "be brief")},
    "race": {
        "prompt": (["p1"], "p1"),
        "chat_template": (["--raw"], False),
        "warmup": (["--no-warmup"], False),
        "speed": (["--speed", "2.5"], 2.5),
        "no_tui": (["--no-tui"], True),
    },
    "bench": {
        "modes": (["--modes", "sd,ar"], ("sd", "ar")),
        "peers": (["--peers", "llamacpp"], ("llamacpp",)),
        "prompts": (["--prompts", "PROMPTS"], ["a", "b"]),
        "limit": (["--limit", "2"], 2),
        "batch_size": (["--batch-size", "2"], 2),
        "repeats": (["--repeats", "3"], 3),
        "chat": (["--no-chat"], False),
        "out": (["--out", "OUT"], "OUT"),
        "project": (["--project"], True),
        "gguf_target": (["--gguf-target", "gt.gguf"], "gt.gguf"),
        "gguf_draft": (["--gguf-draft", "gd.gguf"], "gd.gguf"),
        "pin": (["--no-pin"], False),
        "workload": (["--workload", "concurrent"], "concurrent"),
        "clients": (["--clients", "5"], 5),
        "requests": (["--requests", "4"], 4),
        "duration": (["--duration", "30"], 30.0),
        "peer_python": (["--peer-python", "/x/python"], "/x/python"),
    },
    "check": {"chat": (["--chat"], True), "as_json": (["--json"], True)},
    "serve": {
        "host": (["--host", "127.0.0.9"], "127.0.0.9"),
        "port": (["--port", "8123"], 8123),
        "api_key": (["--api-key", "k3y"], "k3y"),
        "served_model_name": (["--served-model-name", "nm"], "nm"),
        "max_batch": (["--max-batch", "3"], 3),
        "max_request_rows": (["--max-request-rows", "5"], 5),
        "max_body_mb": (["--max-body-mb", "2"], 2 * 1024 * 1024),
        "max_prompt_chars": (["--max-prompt-chars", "77"], 77),
        "max_connections": (["--max-connections", "9"], 9),
        "header_timeout": (["--header-timeout", "1.5"], 1.5),
        "body_timeout": (["--body-timeout", "2.5"], 2.5),
        "idle_timeout": (["--idle-timeout", "3.5"], 3.5),
        "allowed_hosts": (["--allowed-hosts", "a.lan,b.lan:9"], ("a.lan", "b.lan:9")),
        "allowed_origins": (["--allowed-origins", "http://localhost:3000"], ("http://localhost:3000",)),
    },
}
# race's --speed only reaches the TUI: a second race run leaves --no-tui out; --fim-suffix
# excludes --chat: the regex run takes it instead
RUNS = {
    "generate": ("regex", "fim_suffix"),
    "generate-regex": ("json_schema", "chat"),
    "chat": (),
    "race": ("speed",),
    "race-tui": ("no_tui",),
    "check": (),
    "bench": ("workload", "clients", "requests", "duration", "peer_python"),  # the sequential workload
    "bench-concurrent": ("prompts", "limit", "batch_size", "repeats", "chat", "project", "gguf_draft", "pin"),
    "serve": (),
}  # run -> own options it leaves out


def _params(command: str) -> dict:
    import typer

    from ssdlocal.cli.app import app

    return {p.name: p for p in typer.main.get_command(app).commands[command].params}


def test_every_option_of_every_command_is_covered_here_with_a_value_not_its_default():
    shared = {f.name for group in options.GROUPS for f in dataclasses.fields(group)}
    assert set(SHARED) == shared  # a new shared option needs a line in SHARED
    assert set(options.COMMANDS) == set(OWN)
    for command, own in OWN.items():
        params = _params(command)
        assert set(params) == (set(params) & shared) | set(own), command  # nothing left unpassed
        assert not set(own) & shared, command
        for name in set(params) & shared:
            assert SHARED[name][1] != params[name].default, (command, name)


class _Recorder:
    """Stands in for the heavy calls; keeps what each was given."""

    def __init__(self):
        self.calls: dict[str, tuple] = {}

    def __call__(self, name, result=None):
        def record(*args, **kwargs):
            self.calls[name] = (args, kwargs)
            return result

        return record


def _fake_run(monkeypatch, rec):
    """Replace engine_config in every command module and each command's final call."""
    from ssdlocal.bench.check import CheckReport, ModeRun

    config = EngineConfig(ModelSpec("t"), SpecConfig(draft=NgramDraft()))
    for module in ("generate", "tui", "bench", "check", "serve"):
        monkeypatch.setattr(f"ssdlocal.cli.{module}.engine_config", rec("engine_config", config))
    runs = tuple(ModeRun(m, ((1,),), 1, 1.0, 0.5, 0.6) for m in ("ar", "sd", "ssd"))
    monkeypatch.setattr("ssdlocal.bench.check.run_check", rec("run_check", CheckReport("float16", ("p",), runs, ())))
    monkeypatch.setattr("ssdlocal.cli.render.run_generate", rec("run_generate"))
    monkeypatch.setattr("ssdlocal.cli.bench._run_and_report", rec("run_bench"))
    monkeypatch.setattr("ssdlocal.cli.bench._run_concurrent_and_report", rec("run_concurrent"))
    monkeypatch.setattr("ssdlocal.cli.tui._run_app", rec("run_app"))
    monkeypatch.setattr("ssdlocal.cli.tui._race_plain", rec("race_plain"))
    monkeypatch.setattr("ssdlocal.tui.app.ChatApp", rec("app"))
    monkeypatch.setattr("ssdlocal.tui.app.RaceApp", rec("app"))
    monkeypatch.setattr("ssdlocal.cli.serve._serve", rec("serve"))
    sock = type("Sock", (), {"close": lambda self: None, "getsockname": lambda self: ("127.0.0.9", 8123)})()
    monkeypatch.setattr("ssdlocal.server.run.bind", rec("bind", sock))


def _landed(command: str, calls: dict, out: str) -> tuple[object, dict]:
    """(the SamplingParams the run got, {own option: the value it got}); `out` is stdout."""
    (args, kw) = calls.get("run_generate") or calls.get("race_plain") or calls.get("run_bench") or ((), {})
    if command.startswith("generate"):
        spec = kw.pop("grammar", None)  # a grammar.kinds.GrammarSpec
        kind, source = (spec.kind, spec.source) if spec is not None else (None, None)
        grammar = {
            "json_schema": source if kind == "json_schema" else None,
            "regex": source if kind == "regex" else None,
        }
        return args[2], {"prompts": args[1][:1], "num_samples": len(args[1]), **grammar, **kw}
    if command == "chat":
        (_, _, settings), app_kw = calls["app"]
        return settings.sampling, app_kw
    if command in ("race", "race-tui"):
        if command == "race-tui":  # RaceApp(factory, config, prompt, specs, params)
            args, kw = calls["app"][0][1:5], calls["app"][1]
        else:  # _race_plain(config, default, prompt, specs, params)
            args = (args[0], *args[2:])
        return args[3], {"prompt": args[1], "chat_template": kw["chat"], "no_tui": "race_plain" in calls, **kw}
    if command == "bench-concurrent":
        settings, params, out_dir = calls["run_concurrent"][0]
        own = {
            "modes": settings.modes,
            "peers": settings.peers,
            "clients": settings.clients,
            "requests": settings.requests,
            "duration": settings.duration_s,
            "peer_python": settings.peer_python,
            "gguf_target": settings.gguf_target,
        }
        return params, {**own, "workload": "concurrent", "out": out_dir.name}
    if command == "bench":
        config, chosen, settings, params, out_dir, project = args
        own = {
            f: getattr(settings, f)
            for f in ("modes", "peers", "batch_size", "repeats", "chat", "gguf_target", "gguf_draft")
        }
        return params, {
            **own,
            "prompts": [p.prompt for p in chosen],
            "limit": len(chosen),
            "out": out_dir.name,
            "project": project,
            "pin": config.pin_cpus,
        }
    if command == "check":
        return calls["run_check"][1]["params"], {**calls["run_check"][1], "as_json": out.startswith("{")}
    (_, _, name), kw = calls["serve"]
    limits = kw["limits"]
    return None, {
        "host": calls["bind"][0][0],
        "port": calls["bind"][0][1],
        "api_key": kw["api_key"],
        "served_model_name": name,
        "max_batch": kw["max_batch"],
        "max_body_mb": limits.max_body_bytes,
        **{f: getattr(limits, f) for f in ("max_request_rows", "max_prompt_chars", "max_connections")},
        **{f: getattr(limits, f + "_s") for f in ("header_timeout", "body_timeout", "idle_timeout")},
        "max_new_tokens": kw["max_new_tokens"],
        "allowed_hosts": kw["access"].extra_hosts,
        "allowed_origins": kw["access"].extra_origins,
    }


@pytest.mark.parametrize("run", list(RUNS))
def test_every_option_of_every_command_reaches_its_config(monkeypatch, capsys, tmp_path, run):
    command = run.removesuffix("-tui").removesuffix("-regex").removesuffix("-concurrent")
    for var in [v for v in os.environ if v.startswith("SSDLOCAL_")]:
        monkeypatch.delenv(var)  # no SSDLOCAL_<OPTION> defaults ...
    monkeypatch.setenv("SSDLOCAL_CONFIG_DIR", str(tmp_path))  # ... and no config file
    (tmp_path / "prompts.txt").write_text("a\nb\nc\n")
    (tmp_path / "schema.json").write_text('{"type": "object"}')
    rec = _Recorder()
    _fake_run(monkeypatch, rec)
    params = _params(command)
    own = {k: v for k, v in OWN[command].items() if k not in RUNS[run]}
    argv = [command]
    for words, _ in [*own.values(), *(SHARED[name] for name in SHARED if name in params)]:
        argv += [
            {
                "PROMPTS": str(tmp_path / "prompts.txt"),
                "OUT": str(tmp_path / "OUT"),
                "SCHEMA": str(tmp_path / "schema.json"),
            }.get(w, w)
            for w in words
        ]
    if command == "serve":
        pytest.importorskip("uvicorn")
    code, out, err = run_cli(monkeypatch, capsys, *argv)
    assert code == 0, err

    (models, spec), _ = rec.calls["engine_config"]
    sampling, landed = _landed(run, rec.calls, out)
    for name in SHARED.keys() & params.keys():
        expected = SHARED[name][1]
        group = models if name in _fields(options.ModelOptions) else spec
        if name in _fields(options.SamplingOptions):  # the SamplingParams the run got
            got = landed["max_new_tokens"] if sampling is None else getattr(sampling, name)
        else:
            got = getattr(group, name)
        assert got == expected, (run, name)
    for name, (_, expected) in own.items():
        assert landed[name] == expected, (run, name)


@pytest.mark.parametrize(
    "words, kept",
    [
        ((), False),
        (("--prefix-cache-tokens", "4096"), True),
        (("--prefix-cache-tokens", "4096", "--no-prefix-cache"), False),
    ],
)
def test_generate_keeps_no_prefix_cache_unless_asked_for_one(monkeypatch, capsys, tmp_path, words, kept):
    """One call, then the process ends: generate makes no prefix store (its context cost
    0.5-1 s of the first token and a GB here) unless --prefix-cache-tokens asks for one;
    chat and serve keep the default."""
    for var in [v for v in os.environ if v.startswith("SSDLOCAL_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("SSDLOCAL_CONFIG_DIR", str(tmp_path))
    rec = _Recorder()
    _fake_run(monkeypatch, rec)
    code, _, err = run_cli(monkeypatch, capsys, "generate", *words, "p1")
    assert code == 0, err
    (models, _), _ = rec.calls["engine_config"]
    assert models.prefix_cache is kept
    code, _, err = run_cli(monkeypatch, capsys, "chat")
    assert code == 0, err
    assert rec.calls["engine_config"][0][0].prefix_cache is True


def _fields(group) -> set[str]:
    return {f.name for f in dataclasses.fields(group)}


# option field -> where it shows in the EngineConfig that resolve.engine_config builds
IN_CONFIG = {
    "target": lambda c: c.target.path,
    "draft": lambda c: c.draft_model.path,
    "dtype": lambda c: {c.target.dtype, c.draft_model.dtype},
    "quantization": lambda c: c.target.quantization,
    "draft_quantization": lambda c: c.draft_model.quantization,
    "target_device": lambda c: c.target.device,
    "draft_device": lambda c: c.draft_model.device,
    "target_backend": lambda c: c.target.backend,
    "draft_backend": lambda c: c.draft_model.backend,
    "cuda_graphs": lambda c: c.graphs,
    "prefix_cache": lambda c: c.prefix_cache_tokens != 0,
    "mode": lambda c: c.spec.mode.value,
    "k": lambda c: c.spec.k,
    "fan_out": lambda c: c.spec.fan_out,
    "fan_out_miss": lambda c: c.spec.fan_out_miss,
    "saguaro_c": lambda c: c.spec.saguaro_c,
    "backup": lambda c: c.spec.backup,
    "suffix": lambda c: c.spec.draft.suffix is not None,
    "suffix_memory_tokens": lambda c: c.spec.memory.max_tokens,
    "persist_suffix_memory": lambda c: c.spec.memory.persist,
}


def test_model_and_speculation_options_reach_the_engine_config(monkeypatch):
    """Every ModelOptions and SpecOptions field, non-default, shows in the EngineConfig;
    --pair and --target-devices replace others, so they get their own runs."""
    from ssdlocal.cli.options import ModelOptions, SpecOptions
    from ssdlocal.cli.resolve import engine_config

    monkeypatch.setattr("ssdlocal.backends.llamacpp.probe.installed", lambda: False)
    models = ModelOptions(
        target="t-dir",
        draft="d.gguf",
        dtype="float16",
        quantization="int8",
        draft_quantization="none",
        target_device="cuda:3",
        draft_device="cuda:5",
        target_backend="torch",
        draft_backend="llamacpp",
        cuda_graphs=False,
        prefix_cache=False,
        prefix_cache_tokens=4096,
    )
    spec = SpecOptions(
        mode="ssd",
        k=5,
        fan_out="1,1,1,1,1,2",
        fan_out_miss="2,1,1,1,1,1",
        saguaro_c=0.5,
        backup="jit",
        suffix=False,
        suffix_memory_tokens=5000,
        persist_suffix_memory=True,
    )
    config = engine_config(models, spec)
    expected = {
        **{f: getattr(models, f) for f in _fields(ModelOptions)},
        **{f: getattr(spec, f) for f in _fields(SpecOptions)},
        "dtype": {"float16"},
        "cuda_graphs": "off",
        "fan_out": (1, 1, 1, 1, 1, 2),
        "fan_out_miss": (2, 1, 1, 1, 1, 1),
    }
    # --pair and --target-devices replace others, --no-prefix-cache overrides --prefix-cache-tokens,
    # --batch-invariant needs a llama.cpp target on the CPU
    assert set(IN_CONFIG) | {"pair", "target_devices", "prefix_cache_tokens", "batch_invariant"} == _fields(
        ModelOptions
    ) | _fields(SpecOptions)
    for name, where in IN_CONFIG.items():
        assert getattr(models, name, getattr(spec, name, None)) != getattr(
            ModelOptions(), name, getattr(SpecOptions(), name, None)
        ), name
        assert where(config) == expected[name], name

    alike = engine_config(
        ModelOptions(
            target="t.gguf", draft="ngram", target_backend="llamacpp", target_device="cpu", batch_invariant=True
        ),
        SpecOptions(mode="sd"),
    )
    assert alike.target.batch_invariant and not config.target.batch_invariant
    sized = engine_config(replace(models, prefix_cache=True), spec)
    assert (
        sized.prefix_cache_tokens == 4096
        and engine_config(replace(models, prefix_cache_tokens=None), spec).prefix_cache_tokens == 0
    )
    monkeypatch.setattr("ssdlocal.weights.hub.resolve_pair_paths", lambda name, **kw: (f"{name}-t", f"{name}-d"))
    monkeypatch.setattr("ssdlocal.weights.pairs.get_pair", lambda name: SimpleNamespace(draft_head=None))
    paired = engine_config(
        ModelOptions(pair="p", target_backend="torch", target_device="cpu", draft_device="cpu"), SpecOptions(mode="sd")
    )
    assert (paired.target.path, paired.draft_model.path) == ("p-t", "p-d")
    split = engine_config(dataclasses.replace(models, target_devices="cuda:0-1"), spec)
    assert split.target_devices == ("cuda:0", "cuda:1") and split.target.device == "cuda:0"


def test_a_misspelt_override_fails_when_the_command_is_defined(monkeypatch):
    monkeypatch.setitem(options.COMMANDS, "typo", options.Takes(drop=frozenset({"temprature"})))
    with pytest.raises(TypeError, match="temprature"):

        @options.model_command("typo")
        def typo(sampling: options.SamplingOptions) -> None: ...


def test_checks_own_defaults_come_from_the_one_table():
    check = _params("check")
    assert check["dtype"].default == "float32" and check["max_new_tokens"].default == 32
    assert _params("generate")["dtype"].default == options.ModelOptions.dtype
