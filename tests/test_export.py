"""`ssdlocal export --to vllm|sglang|llama-server` (bench/export.py, bench/export_engines.py):
the generated command lines use only the option names each engine documents, carry the
pair, K, the plan's tensor-parallel size and the context, and the config files say the same.

DOCUMENTED holds the names as the engines' own pages give them (read 2026):
- vLLM: docs.vllm.ai, features/speculative_decoding/draft_model (`vllm serve MODEL --host
  --port -tp --max-model-len --speculative-config '{"model", "num_speculative_tokens",
  "method": "draft_model"}'`), configuration/serve_args ("Configuration file": a YAML of the
  long option names, `vllm serve --config config.yaml`), the CLI reference
  (`--tensor-parallel-size`, `--served-model-name`).
- SGLang: docs/advanced_features/server_arguments.md (`--model-path`, `--host`, `--port`,
  `--tensor-parallel-size` / `--tp-size`, `--context-length`, `--served-model-name`, the
  speculative table, `--config` YAML of long names) and speculative_decoding.md ("Standalone
  Speculative Decoding": `--speculative-algorithm STANDALONE`; with topk 1,
  num-draft-tokens = num-steps + 1).
- llama.cpp: tools/server/README.md (ggml-org/llama.cpp 00dc805): `-m`, `--spec-draft-model,
  -md, --model-draft`, `--spec-draft-hf, -hfd`, `-hf`, `--spec-type` (draft-simple, ...),
  `--spec-draft-n-max`, `-c, --ctx-size`, `-ngl`, `--spec-draft-ngl, -ngld`, `-dev`,
  `--spec-draft-device, -devd`, `-sm` (none, layer, row, tensor), `-ts`, `-a, --alias`,
  `--host`, `--port`; `--draft, --draft-n, --draft-max` "has been removed. use
  --spec-draft-n-max".
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from support.cli import assert_clean_error, run_cli

from ssdlocal.bench.export import Engine, ExportRequest, Sourced, destination, export_settings, measured_k
from ssdlocal.bench.export_engines import export
from ssdlocal.core.errors import UsageError
from ssdlocal.placement.inventory import DeviceInventory
from ssdlocal.weights.hub import OFFLINE_PAIR
from ssdlocal.weights.pairs import get_pair

yaml = pytest.importorskip("yaml")

DOCUMENTED = {
    Engine.VLLM: {
        "program": ("vllm", "serve"),
        "options": {"--host", "--port", "--tensor-parallel-size", "-tp", "--max-model-len", "--speculative-config"}
        | {"--served-model-name", "--config"},
        "speculative_config": {"model", "num_speculative_tokens", "method"},
    },
    Engine.SGLANG: {
        "program": ("python", "-m", "sglang.launch_server"),
        "options": {"--model-path", "--model", "--host", "--port", "--tensor-parallel-size", "--tp-size"}
        | {"--context-length", "--served-model-name", "--config", "--speculative-algorithm"}
        | {"--speculative-draft-model-path", "--speculative-num-steps", "--speculative-eagle-topk"}
        | {"--speculative-num-draft-tokens"},
    },
    Engine.LLAMA_SERVER: {
        "program": ("llama-server",),
        "options": {"-m", "-md", "--model-draft", "--spec-draft-model", "-hf", "-hfd", "--spec-type"}
        | {"--spec-draft-n-max", "-c", "--ctx-size", "-ngl", "-ngld", "-dev", "-devd", "-sm", "-ts"}
        | {"-a", "--alias", "--host", "--port"},
        "removed": {"--draft", "--draft-n", "--draft-max"},
    },
}
CPU_ONLY = DeviceInventory((), cpu_cores=2, ram_gb=16.0, ram_available_gb=12.0)
TWO_GPUS = destination(2, 24.0, CPU_ONLY)
FILES = ("/models/t.gguf", "/models/d.gguf")


def settings(
    engine: Engine,
    inventory=TWO_GPUS,
    k: int = 4,
    pair: str = OFFLINE_PAIR,
    gguf_files=None,
    contexts=(None, None),
    **asked,
):
    request = ExportRequest(Sourced(k, "given"), **asked)
    return export_settings(engine, get_pair(pair), inventory, request, gguf_files, contexts)


def options_of(argv: tuple[str, ...], program: tuple[str, ...]) -> dict[str, str]:
    assert argv[: len(program)] == program
    rest = list(argv[len(program) :])
    if program == ("vllm", "serve"):
        rest = rest[1:]  # the model, positional
    assert len(rest) % 2 == 0, rest  # every option here takes one value
    return dict(zip(rest[::2], rest[1::2]))


@pytest.mark.parametrize("engine", list(Engine))
def test_every_generated_option_is_one_the_engine_documents(engine):
    doc = DOCUMENTED[engine]
    result = export(settings(engine, gguf_files=FILES, contexts=(32768, 32768)))
    flags = options_of(result.argv, doc["program"])
    assert set(flags) <= doc["options"], set(flags) - doc["options"]
    assert not set(flags) & doc.get("removed", set())
    if result.config_name is not None:  # the config file's keys are the long option names
        assert {f"--{key}" for key in yaml.safe_load(result.config_text())} - {"--model"} <= doc["options"]
        assert result.config_argv[-2:] == ("--config", result.config_name)
    assert shlex.split(result.command().replace("\\\n", " ")) == list(result.argv)  # pastes as one command


def test_the_built_in_pair_on_vllm():
    result = export(settings(Engine.VLLM, contexts=(32768, 32768)))
    assert result.argv == (
        "vllm",
        "serve",
        "Qwen/Qwen2.5-Coder-1.5B-Instruct",
        "--served-model-name",
        OFFLINE_PAIR,
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--tensor-parallel-size",
        "1",
        "--max-model-len",
        "32768",
        "--speculative-config",
        '{"model": "Qwen/Qwen2.5-Coder-0.5B-Instruct", "num_speculative_tokens": 4, "method": "draft_model"}',
    )
    config = yaml.safe_load(result.config_text())
    assert config["model"] == "Qwen/Qwen2.5-Coder-1.5B-Instruct" and config["max-model-len"] == 32768
    spec = json.loads(config["speculative-config"])
    assert set(spec) == DOCUMENTED[Engine.VLLM]["speculative_config"] and spec["num_speculative_tokens"] == 4


def test_the_built_in_pair_on_sglang_drafts_one_chain_of_k():
    result = export(settings(Engine.SGLANG, k=3, contexts=(32768, 32768)))
    flags = options_of(result.argv, DOCUMENTED[Engine.SGLANG]["program"])
    assert flags["--model-path"] == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert flags["--speculative-algorithm"] == "STANDALONE"
    assert flags["--speculative-draft-model-path"] == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert (flags["--speculative-num-steps"], flags["--speculative-eagle-topk"]) == ("3", "1")
    assert flags["--speculative-num-draft-tokens"] == "4"  # the root and K drafts
    assert flags["--context-length"] == "32768" and flags["--tensor-parallel-size"] == "1"
    config = yaml.safe_load(result.config_text())
    assert {f"--{key}": str(value) for key, value in config.items()} == flags


def test_a_head_pair_exports_as_the_engines_head_method():
    """vLLM's `method` eagle3 / dflash and SGLang's EAGLE3 / DFLASH algorithms, as published
    heads' model cards run them (DFLASH with no step options; vLLM's dflash as its DFlash
    design page configures it); the head shares the target's GPU in the plan; llama-server
    runs no heads: refused with a hint."""
    vllm = export(settings(Engine.VLLM, pair="llama-3.1-8b-eagle3"))
    spec = json.loads(options_of(vllm.argv, DOCUMENTED[Engine.VLLM]["program"])["--speculative-config"])
    assert spec == {"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 4, "method": "eagle3"}
    assert vllm.settings.plan.draft_device == vllm.settings.plan.target_devices[0] == "cuda:0"
    eagle = options_of(
        export(settings(Engine.SGLANG, pair="llama-3.1-8b-eagle3")).argv, DOCUMENTED[Engine.SGLANG]["program"]
    )
    assert eagle["--speculative-algorithm"] == "EAGLE3" and eagle["--speculative-num-draft-tokens"] == "5"
    dflash = export(settings(Engine.SGLANG, k=15, pair="qwen3-8b-dflash"))
    flags = options_of(dflash.argv, DOCUMENTED[Engine.SGLANG]["program"])
    assert flags["--speculative-algorithm"] == "DFLASH" and "--speculative-num-steps" not in flags
    assert (
        json.loads(
            options_of(
                export(settings(Engine.VLLM, k=15, pair="qwen3-8b-dflash")).argv, DOCUMENTED[Engine.VLLM]["program"]
            )["--speculative-config"]
        )["method"]
        == "dflash"
    )
    with pytest.raises(UsageError, match="llama-server does not run"):
        settings(Engine.LLAMA_SERVER, pair="llama-3.1-8b-eagle3")


def test_the_built_in_pair_on_llama_server():
    on_cpu = export(settings(Engine.LLAMA_SERVER, CPU_ONLY, gguf_files=FILES, contexts=(32768, 32768)))
    assert on_cpu.argv == (
        "llama-server",
        "-m",
        FILES[0],
        "-md",
        FILES[1],
        "--spec-type",
        "draft-simple",
        "--spec-draft-n-max",
        "4",
        "-c",
        "32768",
        "-ngl",
        "0",
        "-ngld",
        "0",
        "--alias",
        OFFLINE_PAIR,
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
    )
    assert on_cpu.config_name is None and "--draft-max 4" in on_cpu.legacy
    on_gpus = options_of(
        export(settings(Engine.LLAMA_SERVER, gguf_files=FILES)).argv, DOCUMENTED[Engine.LLAMA_SERVER]["program"]
    )
    assert on_gpus["-ngl"] == "99" and on_gpus["-ngld"] == "99" and on_gpus["-devd"] == "CUDA1"  # its own GPU
    assert "-c" not in on_gpus  # no context known: the model's own


def test_the_plan_gives_the_tensor_parallel_size_and_the_devices():
    big = destination(3, 48.0, CPU_ONLY)  # a 32B target in bf16 needs two of them, the draft the third
    vllm = options_of(export(settings(Engine.VLLM, big, pair="qwen2.5-coder-32b")).argv, ("vllm", "serve"))
    assert vllm["--tensor-parallel-size"] == "2"
    small = destination(3, 24.0, CPU_ONLY)  # its Q4_K_M GGUF needs two of these
    llama = export(settings(Engine.LLAMA_SERVER, small, pair="qwen2.5-coder-32b"))
    flags = options_of(llama.argv, ("llama-server",))
    assert (flags["-dev"], flags["-sm"], flags["-ts"], flags["-devd"]) == ("CUDA0,CUDA1", "row", "1,1", "CUDA2")
    assert flags["-hf"].startswith("bartowski/") and flags["-hf"].endswith(":Q4_K_M")  # not on this machine
    given = export(settings(Engine.VLLM, big, pair="qwen2.5-coder-32b", tensor_parallel=4))
    assert given.settings.tensor_parallel == Sourced(4, "given")
    with pytest.raises(UsageError, match="does not fit"):
        settings(Engine.VLLM, destination(1, 8.0, CPU_ONLY), pair="qwen2.5-coder-32b")


def test_what_is_lost_is_said():
    for engine in Engine:
        notes = " ".join(export(settings(engine, CPU_ONLY, gguf_files=FILES)).notes)
        assert "SSD itself" in notes and "K is fixed" in notes and "--gpus N --gpu-memory GB" in notes


def _bench_doc(**aggregates) -> dict:
    return {"aggregates": aggregates, "records": []}


def test_k_measured_by_a_benchmark_is_its_fastest_exact_speculative_systems():
    doc = _bench_doc(
        ar={"k": 0, "valid": True, "tokens_per_s": 20.0},
        sd={"k": 3, "valid": True, "tokens_per_s": 30.0, "acceptance_rate": 0.8, "speedup_vs_ar": 1.5},
        ssd={"k": 6, "valid": False, "tokens_per_s": 50.0},  # failed exactness: not a measurement
    )
    found = measured_k(doc, "results.json")
    assert found.value == 3 and "sd in results.json" in found.source and "80%" in found.source
    adaptive = {"width_rounds": {"1": 2, "3": 2}, "source_rows": {"model": 4}}  # K chosen per round
    record = {"system": "sd", "spec": {"k": 3, "rounds": 4, **adaptive}}
    mean = measured_k({**doc, "records": [record]}, "results.json")
    assert mean.value == 2 and "mean K 2.00" in mean.source
    with pytest.raises(UsageError, match="no exact speculative system"):
        measured_k(_bench_doc(ar={"k": 0, "valid": True, "tokens_per_s": 20.0}))
    with pytest.raises(UsageError, match="no `ssdlocal bench` results"):
        measured_k({"something": 1})


def test_the_command_prints_and_writes_the_config(monkeypatch, capsys, tmp_path):
    plan = ("--gpus", "2", "--gpu-memory", "24")
    code, out, err = run_cli(monkeypatch, capsys, "export", "--to", "vllm", "--k", "5", *plan, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["settings"]["k"] == {"value": 5, "from": "given"} and doc["argv"][:2] == ["vllm", "serve"]
    assert json.loads(doc["argv"][doc["argv"].index("--speculative-config") + 1])["num_speculative_tokens"] == 5
    results = tmp_path / "results.json"
    results.write_text(json.dumps(_bench_doc(sd={"k": 3, "valid": True, "tokens_per_s": 9.0})))
    path = tmp_path / "sglang.yaml"
    code, out, err = run_cli(
        monkeypatch, capsys, "export", "--to", "SGLang", "--from-bench", results, *plan, "--write-config", path
    )
    assert code == 0, err
    assert yaml.safe_load(path.read_text())["speculative-num-steps"] == 3
    assert f"python -m sglang.launch_server --config {path}" in out and "K = 3: measured" in out
    code, out, err = run_cli(monkeypatch, capsys, "export", "--to", "ollama")
    assert_clean_error(code, err, 2, "unknown --to 'ollama'", "vllm, sglang, llama-server")
    code, out, err = run_cli(monkeypatch, capsys, "export", "--to", "llama-server", "--write-config", path)
    assert_clean_error(code, err, 2, "takes no config file")
    code, out, err = run_cli(monkeypatch, capsys, "export", "--to", "vllm", "--k", "2", "--from-bench", results)
    assert_clean_error(code, err, 2, "--k and --from-bench")
    code, out, err = run_cli(monkeypatch, capsys, "export", "--to", "vllm", "--gpus", "2")
    assert_clean_error(code, err, 2, "--gpus and --gpu-memory")
    assert Path(path).exists()
