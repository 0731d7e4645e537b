"""The registry of known-good target/draft pairs (`models/pairs/*.toml`).

Reads the built-in pair files (shipped in the wheel as `ssdlocal/_pairs`, or read from
`models/pairs/` in a source checkout), the user's `<config dir>/pairs/*.toml`, and any
files named in `$SSDLOCAL_PAIRS_PATH`. Pure data: downloading lives in hub.py, device
planning in ssdlocal.placement; what a file may hold is pair_keys.py. A pair's draft is a
draft model, a draft head (`[draft] head = "eagle3"`: it drafts from the target's hidden
states beside the target, torch only, SD only) or a drafter without a model (`draft = "suffix"`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import tomllib

from ssdlocal.core.errors import UsageError
from ssdlocal.core.models import BackendName
from ssdlocal.core.quantization import Quantization, quantized_gb, scheme_for_gguf_type
from ssdlocal.core.reads import step_params
from ssdlocal.weights.pair_keys import (
    DRAFT_WORDS,
    FILE_KEYS,
    LLAMACPP_KEYS,
    MAX_SUGGESTED_K,
    MODEL_KEYS,
    SOURCES,
    TOP_KEYS,
    TORCH_KEYS,
    bad,
    check,
)


@dataclass(frozen=True)
class ModelRef:
    """One model of a pair: a hub repo (hf), a PyPI asset (pypi) or a local path (local)."""

    repo: str | None = None
    revision: str = "main"
    asset: str | None = None  # ssdlocal.weights.assets name, for source = "pypi"
    path: str | None = None  # for source = "local"
    params_b: float | None = None
    # a mixture of experts: parameters one token reads, routed experts and how many a token uses
    active_params_b: float | None = None
    experts: int | None = None
    experts_per_token: int | None = None
    bf16_gb: float = 0.0  # approximate weight memory in bf16
    embed_b: float | None = None  # token-embedding parameters in billions (vocab x hidden)
    # parameters (billions) every tensor-parallel rank holds whole (weights/size.py whole_bytes:
    # embeddings, norms, lm_head, replicated linears); None: the token embedding alone (embed_b)
    whole_b: float | None = None
    heads: int | None = None
    kv_heads: int | None = None
    layers: int | None = None
    head_dim: int | None = None
    head: str | None = None  # a draft head's kind (weights.formats.archs.HEADS); None: a model

    @property
    def label(self) -> str:
        return self.repo or self.asset or self.path or "?"

    def read_share(self, tokens: int = 1) -> float:
        """The share of the weights one forward step of `tokens` tokens reads: 1 for a dense
        model; for a mixture of experts the weights every token reads plus the routed experts
        the step is expected to touch (core.reads)."""
        if not self.params_b or self.active_params_b is None:
            return 1.0
        read = step_params(self.params_b, self.active_params_b, self.experts, self.experts_per_token, tokens)
        return read / self.params_b

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int | None:
        """One token's keys and values in every layer (what the KV and prefix caches hold)."""
        kv = self.kv_heads or self.heads
        if not (self.layers and self.head_dim and kv):
            return None
        return 2 * self.layers * kv * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class GGUFRef:
    """A single GGUF file for the llama.cpp backend."""

    repo: str | None = None
    revision: str = "main"
    filename: str | None = None
    asset: str | None = None
    path: str | None = None
    quant: str = ""
    size_gb: float = 0.0


@dataclass(frozen=True)
class Pair:
    """A target and its draft: a draft model (`draft`), or, for a target no smaller model of
    its family could draft for, a drafter without a model (`draft` None, `draft_word`)."""

    name: str
    description: str
    family: str
    source: str
    target: ModelRef
    draft: ModelRef | None
    suggested_k: int = 4
    suggested_fan_out: tuple[int, ...] | None = None
    gated: bool = False
    allow_patterns: tuple[str, ...] = ("*.json", "*.safetensors", "tokenizer*")
    ignore_patterns: tuple[str, ...] = ()
    gguf_target: GGUFRef | None = None
    gguf_draft: GGUFRef | None = None
    only_backends: tuple[BackendName, ...] | None = None  # the file's `backends`
    file: Path | None = field(default=None, compare=False)
    draft_word: str | None = None  # with `draft` None: the drafter without a model
    weights: str = "safetensors"  # hf pairs: "gguf" when the repos hold GGUF files only

    @property
    def draft_label(self) -> str:
        if self.draft is None:
            return f"{self.draft_word} drafting (no draft model)"
        return f"{self.draft.label} ({self.draft.head} head)" if self.draft.head else self.draft.label

    @property
    def draft_head(self) -> str | None:
        """The kind of the pair's draft head (weights.formats.archs.HEADS), None for a draft
        model or a drafter without one. A head reads the target's hidden states: it runs beside
        the target on its device, on the torch backend, in SD (never SSD)."""
        return self.draft.head if self.draft is not None else None

    @property
    def has_gguf(self) -> bool:
        """GGUF files for the target and for the draft model (if it has one)."""
        return self.gguf_target is not None and (self.gguf_draft is not None or self.draft is None)

    @property
    def backends(self) -> tuple[BackendName, ...]:
        """Backends the pair can run on: every backend reading checkpoints; those that run
        GGUF files as they are when the pair names GGUF files for both models (a draft head
        has none: its backend must hand it the target's hidden states); of those, the ones
        the file's `backends` lists when it lists any."""
        found = tuple(b for b in BackendName if self.has_gguf or not b.runs_gguf)
        return found if self.only_backends is None else tuple(b for b in found if b in self.only_backends)

    def schemes(self, quantization: Quantization = Quantization.NONE) -> tuple[Quantization, Quantization]:
        """(target, draft) torch weight schemes for `--quantization`: auto is the GGUF
        files' class for a PyPI (GGUF) pair and none for safetensors pairs."""
        quantization = Quantization(quantization)
        if quantization is not Quantization.AUTO:
            return quantization, quantization
        if self.source != "pypi" and self.weights != "gguf":
            return Quantization.NONE, Quantization.NONE
        refs = (self.gguf_target, self.gguf_draft)
        return tuple(scheme_for_gguf_type(r.quant) if r and r.quant else Quantization.NONE for r in refs)  # type: ignore[return-value]

    def memory_gb(
        self, backend: BackendName = BackendName.TORCH, quantization: Quantization = Quantization.NONE
    ) -> tuple[float, float]:
        """(target, draft) weight memory in GB for `backend` (one running GGUF files: their
        sizes; torch: bf16, or the quantized size of codes + scales with the embedding kept
        in bf16)."""
        gguf_sizes = self.gguf_target, self.gguf_draft
        if self.has_gguf and (
            BackendName(backend).runs_gguf or (self.weights == "gguf" and quantization != Quantization.NONE)
        ):
            return tuple(r.size_gb if r is not None else 0.0 for r in gguf_sizes)  # type: ignore[return-value]
        out = []
        for ref, scheme in zip((self.target, self.draft), self.schemes(quantization)):
            if ref is None:  # no draft model
                out.append(0.0)
            elif scheme is Quantization.NONE or not ref.params_b or ref.head:  # a head loads unquantized
                out.append(ref.bf16_gb)
            else:  # no embedding size given: assume a tenth of the model, on the safe side
                embed = ref.embed_b if ref.embed_b is not None else 0.1 * ref.params_b
                # a GGUF pair's embedding stays quantized (int8 at most); a safetensors one, bf16
                embed_bytes = 1.0 if self.source == "pypi" else None
                out.append(round(quantized_gb(ref.params_b, embed, scheme, embed_bytes=embed_bytes), 2))
        return out[0], out[1]

    def whole_gb(
        self, backend: BackendName = BackendName.TORCH, quantization: Quantization = Quantization.NONE
    ) -> float:
        """Of memory_gb's target, the GB every tensor-parallel rank holds whole (the target's
        `whole_b`, sized as memory_gb sizes it; without one, its token embedding `embed_b`,
        which every rank holds: a lower bound, as an untied lm_head and the norms are left
        out); 0 where neither is given or where files run as GGUF (llama.cpp)."""
        ref = self.target
        as_gguf = BackendName(backend).runs_gguf or (self.weights == "gguf" and quantization != Quantization.NONE)
        whole_b = ref.whole_b if ref.whole_b is not None else ref.embed_b
        if whole_b is None or (self.has_gguf and as_gguf):
            return 0.0
        scheme = self.schemes(quantization)[0]
        embed = min(ref.embed_b if ref.embed_b is not None else 0.0, whole_b)
        return round(quantized_gb(whole_b, embed, scheme), 2)

    def step_gb(
        self,
        backend: BackendName = BackendName.TORCH,
        quantization: Quantization = Quantization.NONE,
        tokens: tuple[int, int] = (1, 1),
    ) -> tuple[float, float]:
        """(target, draft) weight GB one forward step reads, the target's of `tokens[0]`
        tokens (K+1 for a verification) and the draft's of `tokens[1]`: memory_gb's sizes
        times the share of the weights such a step reads (ModelRef.read_share: a mixture of
        experts reads only the experts its tokens use). What a memory-bound step's time is
        over bandwidth."""
        sizes = self.memory_gb(backend, quantization)
        refs = (self.target, self.draft)
        return sizes[0] * refs[0].read_share(tokens[0]), sizes[1] * refs[1].read_share(tokens[1])


# --------------------------------------------------------------------------- reading


def builtin_dir() -> Path:
    """Where the shipped pair files are: the installed package data, else the checkout."""
    try:
        installed = Path(str(resources.files("ssdlocal") / "_pairs"))
    except (ModuleNotFoundError, TypeError):  # pragma: no cover - zipped installs
        installed = Path(__file__).parent.parent / "_pairs"
    if installed.is_dir():
        return installed
    return Path(__file__).resolve().parents[2] / "models" / "pairs"


def user_dir() -> Path:
    from ssdlocal.core.paths import config_dir

    return config_dir() / "pairs"


def _model(data: dict, key: str, source: str, path: Path) -> ModelRef | None:
    if key == "draft" and data.get("draft") in DRAFT_WORDS:
        return None  # a drafter without a model
    if key not in data:
        raise bad(path, f"needs a [{key}] table")
    table = check(data[key], MODEL_KEYS, key, path, kinds=False)
    need = {"hf": "repo", "pypi": "asset", "local": "path"}[source]
    if not table.get(need):
        raise bad(path, f'[{key}] needs `{need}` for source = "{source}"')
    ref = ModelRef(**check(table, MODEL_KEYS, key, path))
    if ref.active_params_b is not None and ref.params_b is not None and ref.active_params_b > ref.params_b:
        raise bad(path, f"[{key}] active_params_b {ref.active_params_b} is more than params_b {ref.params_b}")
    if (ref.experts is None) != (ref.experts_per_token is None) or (ref.experts or 0) < (ref.experts_per_token or 0):
        raise bad(path, f"[{key}] needs both `experts` and `experts_per_token`, at most `experts` of them per token")
    if ref.experts and ref.active_params_b is None:
        raise bad(path, f"[{key}] has experts: give `active_params_b`, the parameters one token reads")
    if ref.head is not None and key != "draft":
        raise bad(path, f"[{key}] has `head`: only the [draft] can be a draft head")
    return ref


def _check_head(data: dict, source: str, path: Path) -> None:
    """A draft head runs beside the target on the torch backend (it reads the target's hidden
    states, which llama.cpp's bindings do not expose), from a checkpoint directory."""
    draft = data.get("draft")
    kind = draft.get("head") if isinstance(draft, dict) else None
    if not MODEL_KEYS["head"].ok(kind):
        return  # no head (or an unknown kind: [draft]'s own check names it)
    where = f'[draft] head = "{kind}"'
    if source == "pypi":
        raise bad(path, f'{where} needs source = "hf" or "local" (a head is a checkpoint directory)')
    if data.get("weights") == "gguf" or data.get("llamacpp") is not None:
        raise bad(path, f"{where} runs on the torch backend only: drop `weights` and the [llamacpp] tables")
    gguf_only = [b for b in data.get("backends", ()) if BackendName(b).runs_gguf]
    if gguf_only:
        raise bad(path, f"{where} runs on the torch backend only, not on {', '.join(gguf_only)}: fix `backends`")


def _gguf(table: dict | None, key: str, path: Path) -> GGUFRef | None:
    if table is None:
        return None
    check(table, FILE_KEYS, f"llamacpp.{key}", path, kinds=False)
    if not (table.get("asset") or table.get("path") or (table.get("repo") and table.get("filename"))):
        raise bad(path, f"[llamacpp.{key}] needs repo + filename, asset, or path")
    return GGUFRef(**check(table, FILE_KEYS, f"llamacpp.{key}", path))


def _suggested(data: dict, path: Path) -> tuple[int, tuple[int, ...] | None]:
    k, fan = data.get("suggested_k", 4), data.get("suggested_fan_out")
    if k > MAX_SUGGESTED_K:
        raise bad(path, f"suggested_k must be at most {MAX_SUGGESTED_K}, got {k}")
    if fan is not None and len(fan) != k + 1:
        raise bad(path, f"suggested_fan_out needs K+1 = {k + 1} integers >= 0, got {fan!r}")
    return k, tuple(fan) if fan is not None else None


def parse_pair(path: Path) -> Pair:
    """Read one pair file; every mistake is a UsageError naming the file and the key."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise bad(path, f"not valid TOML ({exc})") from None
    except OSError as exc:
        raise bad(path, f"cannot be read ({exc.strerror or exc})") from None
    check(data, TOP_KEYS, "", path)
    source = data.get("source", "hf")
    if source not in SOURCES:
        raise bad(path, f"unknown source {source!r} (use one of {', '.join(SOURCES)})")
    _check_head(data, source, path)
    weights = data.get("weights", "safetensors")
    if weights == "gguf" and not (data.get("llamacpp") or {}).get("target"):
        raise bad(path, 'weights = "gguf" needs a [llamacpp.target] table naming the GGUF file')
    k, fan = _suggested(data, path)
    torch_table = check(data.get("torch", {}), TORCH_KEYS, "torch", path)
    llamacpp = check(data.get("llamacpp", {}), LLAMACPP_KEYS, "llamacpp", path)
    allow = torch_table.get("allow_patterns", list(Pair.allow_patterns))
    if not allow:
        raise bad(path, "`torch.allow_patterns` must not be empty (nothing would be downloaded)")
    return Pair(
        name=data.get("name") or path.stem,
        description=data.get("description", ""),
        family=data.get("family", ""),
        source=source,
        target=_model(data, "target", source, path),
        draft=_model(data, "draft", source, path),
        suggested_k=k,
        suggested_fan_out=fan,
        gated=data.get("gated", False),
        allow_patterns=tuple(allow),
        ignore_patterns=tuple(torch_table.get("ignore_patterns", ())),
        gguf_target=_gguf(llamacpp.get("target"), "target", path),
        gguf_draft=_gguf(llamacpp.get("draft"), "draft", path),
        only_backends=tuple(BackendName(b) for b in data["backends"]) if "backends" in data else None,
        file=path,
        draft_word=data["draft"] if data.get("draft") in DRAFT_WORDS else None,
        weights=weights,
    )


def _files_in(where: Path) -> list[Path]:
    if where.is_file():
        return [where]
    return sorted(where.glob("*.toml")) if where.is_dir() else []


def pair_files() -> list[Path]:
    """Built-in files, then the user's, then $SSDLOCAL_PAIRS_PATH (each file once)."""
    files = _files_in(builtin_dir()) + _files_in(user_dir())
    for entry in os.environ.get("SSDLOCAL_PAIRS_PATH", "").split(os.pathsep):
        if entry:
            files += _files_in(Path(entry).expanduser())
    return list({f.resolve(): f for f in files}.values())


def load_pairs() -> dict[str, Pair]:
    """Every known pair by name. A name defined twice (a user file reusing a built-in
    name, or two user files) is an error: a pair must never be silently replaced."""
    pairs: dict[str, Pair] = {}
    for pair in map(parse_pair, pair_files()):
        first = pairs.get(pair.name)
        if first is not None:
            raise UsageError(
                f"pair {pair.name!r} is defined twice: in {first.file} and in {pair.file}",
                f"give the pair in {pair.file} another `name` (built-in names are reserved)",
            )
        pairs[pair.name] = pair
    return pairs


def get_pair(name: str) -> Pair:
    """A pair by registry name, or by the path of a pair file."""
    if name.endswith(".toml") or os.sep in name:
        path = Path(name).expanduser()
        if not path.is_file():
            raise UsageError(f"pair file {path} does not exist", "run `ssdlocal pairs` to list known pairs")
        return parse_pair(path)
    pairs = load_pairs()
    if name in pairs:
        return pairs[name]
    import difflib

    close = difflib.get_close_matches(name, list(pairs), n=3)
    maybe = f"did you mean {', '.join(close)}? " if close else ""
    raise UsageError(
        f"unknown pair {name!r}",
        f"{maybe}known pairs: {', '.join(sorted(pairs))} (`ssdlocal pairs` shows them; "
        f"add your own as {user_dir()}/NAME.toml)",
    )


def suggest_pairs(family: str | None = None, limit: int = 4) -> list[str]:
    """Names of registry pairs to recommend, those of `family` first."""
    try:
        pairs = load_pairs()
    except UsageError:  # a broken user file must not hide the original error
        return []
    ordered = sorted(pairs.values(), key=lambda p: (p.family != family, p.target.bf16_gb))
    return [p.name for p in ordered][:limit]
