"""Each engine's command line and config file for bench/export.py's ExportSettings.

The option names are the engines' documented ones (docs/serving.md, "Moving to another
engine", names the pages; tests/test_export.py pins them):
- vLLM: `vllm serve MODEL` with `--speculative-config` JSON (`model`, `num_speculative_tokens`,
  `method: draft_model`, or `eagle3` / `dflash` for a pair's draft head), `--tensor-parallel-size`,
  `--max-model-len`, and the same settings as a YAML file of long option names for
  `vllm serve --config FILE`.
- SGLang: `python -m sglang.launch_server --model-path` with `--speculative-algorithm
  STANDALONE` (a draft head: `EAGLE3`, or `DFLASH` with no step options, as its model cards
  run it), `--speculative-draft-model-path`, `--speculative-num-steps K`,
  `--speculative-eagle-topk 1` and `--speculative-num-draft-tokens K+1` (one chain of K
  drafts: the root and K tokens), `--tensor-parallel-size`, `--context-length`; YAML for
  `--config`.
- llama.cpp's `llama-server`: `-m`, `-md` (or `-hf` / `-hfd` for files not on this machine),
  `--spec-type draft-simple`, `--spec-draft-n-max K`, `-c`, `-ngl` / `-ngld` (layers on the
  GPU: all where the plan puts the model on one, else 0), `-dev` / `-devd` and a row split
  for several GPUs. It takes no config file. Builds before the `--spec-*` rename spell K
  `--draft-max` (`Export.legacy` says so).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass

from ssdlocal.bench.export import Engine, ExportSettings
from ssdlocal.core.errors import UsageError

LOST = (
    "SSD itself: no draft pre-speculates while the target verifies (no speculation cache, no "
    "backup); the engine runs synchronous speculative decoding, its draft waiting on each verification",
    "K is fixed: ssdlocal chooses K per round (0 = a plain step) from measured costs; "
    "the engine drafts K tokens every round",
)


@dataclass(frozen=True)
class Export:
    """One engine's way to serve the settings: a command, a config file where it reads one."""

    settings: ExportSettings
    argv: tuple[str, ...]
    config_name: str | None = None  # the file name the config command reads
    config: tuple[tuple[str, object], ...] = ()  # the YAML file: long option name -> value
    config_argv: tuple[str, ...] = ()  # the command that reads it (with config_name)
    notes: tuple[str, ...] = ()
    legacy: str | None = None  # how older builds spell what differs
    head: int = 1  # words of argv that name the program (and the model) before the options

    def command(self) -> str:
        """The command line to paste: the program, then one option and its value per line."""
        lines = [" ".join(shlex.quote(a) for a in self.argv[: self.head])]
        for word in self.argv[self.head :]:
            if word.startswith("-") and not _is_number(word):
                lines.append(shlex.quote(word))
            else:
                lines[-1] += " " + shlex.quote(word)
        return " \\\n  ".join(lines)

    def config_command(self, path: str | None = None) -> str:
        return shlex.join(path if a == self.config_name and path else a for a in self.config_argv)

    def config_text(self) -> str | None:
        """The YAML file (values as JSON scalars, which YAML reads as they are)."""
        if self.config_name is None:
            return None
        return "".join(f"{key}: {json.dumps(value)}\n" for key, value in self.config)

    def to_dict(self) -> dict:
        s = self.settings
        return {
            "engine": s.engine.value,
            "pair": s.pair,
            "argv": list(self.argv),
            "command": self.command(),
            "config": None
            if self.config_name is None
            else {"name": self.config_name, "text": self.config_text(), "command": self.config_command()},
            "settings": {
                "target": s.target,
                "draft": s.draft,
                "k": {"value": s.k.value, "from": s.k.source},
                "tensor_parallel": {"value": s.tensor_parallel.value, "from": s.tensor_parallel.source},
                "context": {"value": s.context.value, "from": s.context.source or None},
                "served_model_name": s.served_name,
            },
            "notes": list(self.notes),
            "legacy": self.legacy,
        }


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _common_notes(s: ExportSettings) -> list[str]:
    notes = list(LOST)
    if s.context.value is None:
        notes.append("context: the engine's default (the model's own); give one with --context")
    if not s.plan.target_devices[0].startswith("cuda"):
        notes.append(
            "the plan is for this machine, which has no GPU: plan for the one you move to with --gpus N --gpu-memory GB"
        )
    return notes


def _serving(s: ExportSettings, context_flag: str) -> list[tuple[str, object]]:
    """The options vLLM and SGLang name alike: served name, address, tensor parallelism, then
    the context length (when set) under the engine's `context_flag`."""
    options: list[tuple[str, object]] = [
        ("served-model-name", s.served_name),
        ("host", s.host),
        ("port", s.port),
        ("tensor-parallel-size", s.tensor_parallel.value),
    ]
    if s.context.value is not None:
        options.append((context_flag, s.context.value))
    return options


# a pair's draft head (weights.formats.archs.HEADS kinds) -> each engine's name for its method
VLLM_HEAD_METHODS = {"eagle3": "eagle3", "dflash": "dflash"}
SGLANG_HEAD_ALGORITHMS = {"eagle3": "EAGLE3", "dflash": "DFLASH"}


def _head_name(s: ExportSettings, names: dict[str, str]) -> str:
    """The engine's name for the method of the settings' draft head (UsageError: none known)."""
    if s.head not in names:
        raise UsageError(
            f"ssdlocal knows no {s.engine} option for a {s.head} draft head (pair {s.pair})",
            f"serve it with `ssdlocal serve --pair {s.pair}`; {s.engine} exports name {', '.join(names)} heads",
        )
    return names[s.head]


def _draft_note(s: ExportSettings) -> str:
    if s.head:
        return "the draft head runs beside the target, as in ssdlocal"
    return "the draft runs on the target's GPUs, not on a GPU of its own"


# ---------------------------------------------------------------------- vLLM
def _vllm(s: ExportSettings) -> Export:
    method = "draft_model" if s.head is None else _head_name(s, VLLM_HEAD_METHODS)
    spec = json.dumps({"model": s.draft, "num_speculative_tokens": s.k.value, "method": method})
    options = [*_serving(s, "max-model-len"), ("speculative-config", spec)]
    argv = ("vllm", "serve", s.target, *_flags(options))
    name = "vllm.yaml"
    notes = _common_notes(s) + [
        "vLLM loads the Hugging Face checkpoints (bf16), not the pair's GGUF files",
        _draft_note(s),
    ]
    config = (("model", s.target), *options)
    return Export(s, argv, name, config, ("vllm", "serve", "--config", name), tuple(notes), head=3)


# ---------------------------------------------------------------------- SGLang
def _sglang(s: ExportSettings) -> Export:
    k = int(s.k.value)  # type: ignore[call-overload]
    options: list[tuple[str, object]] = [("model-path", s.target), *_serving(s, "context-length")]
    algorithm = "STANDALONE" if s.head is None else _head_name(s, SGLANG_HEAD_ALGORITHMS)
    options += [("speculative-algorithm", algorithm), ("speculative-draft-model-path", s.draft)]
    if algorithm != "DFLASH":  # a block drafter drafts its whole block: no steps to set
        options += [
            ("speculative-num-steps", k),
            ("speculative-eagle-topk", 1),
            ("speculative-num-draft-tokens", k + 1),
        ]
    program = ("python", "-m", "sglang.launch_server")
    name = "sglang.yaml"
    notes = _common_notes(s) + [
        "SGLang loads the Hugging Face checkpoints (bf16), not the pair's GGUF files",
        _draft_note(s),
    ]
    argv = (*program, *_flags(options))
    return Export(s, argv, name, tuple(options), (*program, "--config", name), tuple(notes), head=len(program))


# ---------------------------------------------------------------------- llama-server
def _llama_server(s: ExportSettings) -> Export:
    plan = s.plan
    gpus = [d for d in plan.target_devices if d.startswith("cuda")]
    draft_gpu = plan.draft_device if plan.draft_device and plan.draft_device.startswith("cuda") else None
    t_layers, d_layers = (max(99, (n or 0) + 1) for n in s.layers)  # every layer and the output
    argv: list[str] = ["llama-server"]
    argv += ["-m", s.target] if s.local_files or _is_file(s.target) else ["-hf", s.target]
    argv += ["-md", s.draft] if s.local_files or _is_file(s.draft) else ["-hfd", s.draft]
    argv += ["--spec-type", "draft-simple", "--spec-draft-n-max", str(s.k.value)]
    if s.context.value is not None:
        argv += ["-c", str(s.context.value)]
    argv += ["-ngl", str(t_layers if gpus else 0), "-ngld", str(d_layers if draft_gpu else 0)]
    if len(gpus) > 1:  # llama.cpp's names for CUDA devices: CUDA0, CUDA1, ...
        argv += ["-dev", ",".join(_cuda(d) for d in gpus), "-sm", "row", "-ts", ",".join("1" * len(gpus))]
    if draft_gpu is not None and draft_gpu not in gpus:
        argv += ["-devd", _cuda(draft_gpu)]
    argv += ["--alias", s.served_name, "--host", s.host, "--port", str(s.port)]
    notes = _common_notes(s)
    if not s.local_files:
        notes.append("-hf / -hfd: llama-server downloads the GGUF files the pair names")
    legacy = f"llama.cpp builds before the --spec-* options: --draft-max {s.k.value} instead of --spec-draft-n-max"
    return Export(s, tuple(argv), notes=tuple(notes), legacy=legacy)


def _cuda(device: str) -> str:
    return "CUDA" + device.split(":")[1]


def _is_file(ref: str) -> bool:
    return ref.endswith(".gguf")


def _flags(options: list[tuple[str, object]]) -> list[str]:
    out: list[str] = []
    for key, value in options:
        out += [f"--{key}", str(value)]
    return out


BUILDERS: dict[Engine, Callable[[ExportSettings], Export]] = {
    Engine.VLLM: _vllm,
    Engine.SGLANG: _sglang,
    Engine.LLAMA_SERVER: _llama_server,
}


def export(settings: ExportSettings) -> Export:
    return BUILDERS[settings.engine](settings)
