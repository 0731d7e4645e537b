"""The target loop: prefill, then rounds of speculate -> verify -> commit; yields events.

The engine owns the target model and a drafter (none for AR, n-gram or a draft model
for SD, the async worker for SSD). It never imports a UI library. `commit` is the
only place where row and KV state change; `verify` is the pure function of verify.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence

import torch

from .config import EngineConfig, Mode, SamplingParams, SpecConfig
from .errors import OutOfMemoryError, UsageError
from .events import DoneEvent, Event, Output, RoundEvent, TokenOrigin, TokensEvent
from .sampling import logits_to_probs, sample
from .sequence import Row
from .stats import SpecStats
from .verify import verify

log = logging.getLogger(__name__)


class Engine:
    """Loads the target (and draft) once; `generate` may be called many times.

    Use as a context manager so drafter processes are shut down deterministically.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        spec = config.spec
        self._draft_runner = None
        self._worker = None
        self._cpu_plan = None
        self._tp_group = None  # ranks 1..N-1 of a tensor-parallel target
        self._cancel = False
        self._closed = False
        self.has_draft_model = bool(spec.draft) and not spec.draft_is_ngram
        if self.has_draft_model:
            from .compat import check_pair

            if config.draft_model is None:
                raise UsageError("a draft checkpoint needs a ModelSpec", "set EngineConfig.draft_model")
            check_pair(
                _tokenizer(config.target.path, config.target.backend),
                _tokenizer(spec.draft, config.draft_model.backend),
            )
        try:
            if self.has_draft_model and spec.mode is Mode.SSD:
                self._start_worker()  # loads the draft in its own process while we load the target
            if len(config.target_devices) > 1:
                from .parallel.group import load_tensor_parallel

                self.target, self._tp_group = load_tensor_parallel(config.target, config.target_devices)
            else:
                self.target = _load_model(config.target)
            self.tokenizer = self.target.tokenizer
            self.runner = _make_runner(self.target)
            if self._worker is not None:
                self._worker.wait_loaded()
            elif self.has_draft_model:
                self._load_draft_here()
        except BaseException:
            self.close()
            raise

    def _load_draft_here(self) -> None:
        """Load the draft model in this process (synchronous SD)."""
        self._draft_runner = _make_runner(_load_model(self.config.draft_model))

    def _start_worker(self) -> None:
        """Spawn the SSD draft worker; on CPU-only placements split the cores."""
        from .draft.ssd import DraftWorkerClient
        from .placement import split_cpus

        draft_spec = self.config.draft_model
        _preflight(draft_spec.path, draft_spec.backend)  # bad paths / architectures fail here, not in the worker
        both_cpu = self.config.target.device == "cpu" and draft_spec.device == "cpu"
        # both on CPU: split the cores (thread counts always; affinity when pin_cpus),
        # otherwise two full thread pools oversubscribe the cores and both crawl
        self._cpu_plan = split_cpus() if both_cpu else None
        plan = self._cpu_plan
        self._worker = DraftWorkerClient(
            draft_spec,
            threads=plan.draft_threads if plan else None,
            cpus=plan.draft_cpus if plan and self.config.pin_cpus else None,
        )

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the draft worker (if any). Idempotent; never hangs."""
        self._closed = True
        try:
            self._stop_worker()
        finally:
            group, self._tp_group = self._tp_group, None
            if group is not None:
                group.close()

    def _stop_worker(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()

    def cancel(self) -> None:
        """Ask a running `generate` to stop after the current round (thread-safe)."""
        self._cancel = True

    # ----------------------------------------------------------------- helpers
    @property
    def eos_ids(self) -> frozenset[int]:
        return frozenset(self.target.eos_token_ids)

    def encode(self, prompt: str, chat: bool) -> list[int]:
        """Token ids of one prompt, through the chat template when `chat`."""
        if not prompt.strip():
            raise UsageError("empty prompt", "pass some text to generate from")
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise UsageError(
                    "this model's tokenizer has no chat template", "drop --chat to use a raw prompt"
                )
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return list(self.tokenizer.encode(prompt))

    def _make_drafter(self, spec: SpecConfig, params: SamplingParams, batch: int, num_slots: int):
        if spec.mode is Mode.AR:
            return None
        if spec.draft_is_ngram:
            from .draft.sync import NgramDrafter

            return NgramDrafter(spec.k, spec.ngram_max, spec.ngram_min)
        if spec.draft != self.config.spec.draft:
            raise UsageError(
                f"this engine was loaded with draft {self.config.spec.draft!r}, not {spec.draft!r}",
                "create a new Engine to change the draft model",
            )
        if spec.mode is Mode.SD:
            from .draft.sync import ModelDrafter

            if self._draft_runner is None:
                self._load_draft_here()
            drafter = ModelDrafter(self._draft_runner, spec.k, params, self.target.args.vocab_size)
            drafter.reserve(batch, num_slots)
            return drafter
        from .draft.ssd import SSDDrafter

        if self._worker is not None and self._worker.broken:
            self._stop_worker()  # it failed on an earlier call: replace it with a fresh one
        if self._worker is None:
            self._start_worker()
            self._worker.wait_loaded()
        return SSDDrafter(
            self._worker, spec, params, self.target.args.vocab_size, num_slots,
            target_device=self.config.target.device, draft_device=self.config.draft_model.device,
        )

    def _forward(self, rows: list[list[int]]) -> list[torch.Tensor]:
        try:
            return self.runner.feed(rows)
        except (torch.OutOfMemoryError, RuntimeError) as exc:  # noqa: PERF203
            if "out of memory" in str(exc).lower() or isinstance(exc, torch.OutOfMemoryError):
                raise OutOfMemoryError(
                    f"out of memory running the target on {self.target.device}",
                    "use fewer prompts, a smaller --max-new-tokens, --dtype bfloat16, or another device",
                ) from exc
            raise

    # ----------------------------------------------------------------- generate
    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        chat: bool = False,
        spec: SpecConfig | None = None,
    ) -> Iterator[Event]:
        """Generate for every prompt (strings, or token-id lists) and yield events.

        `spec` overrides the engine's speculation settings for this call (mode, K,
        fan-out, backup, C); the draft model itself cannot change.
        Yields TokensEvent as tokens are committed, a RoundEvent per verification,
        and finally one DoneEvent with per-row outputs and the stats snapshot.
        While an SSD call runs on a CPU-only placement, this process is pinned to the
        target's cores (the worker has the others); the old affinity is restored after.
        """
        if not prompts:
            raise UsageError("no prompt given", "pass at least one prompt")
        ids = [self.encode(p, chat) if isinstance(p, str) else list(p) for p in prompts]
        if any(len(x) == 0 for x in ids):
            raise UsageError("empty prompt", "pass some text to generate from")
        spec = spec or self.config.spec
        k = spec.k if spec.mode is not Mode.AR else 0
        batch = len(ids)
        num_slots = max(map(len, ids)) + params.max_new_tokens + k + 2
        limit = self.target.args.max_position_embeddings
        if num_slots > limit:
            raise UsageError(
                f"prompt + max-new-tokens needs {num_slots} positions, the model supports {limit}",
                "shorten the prompt or lower --max-new-tokens",
            )
        self._cancel = False
        self.runner.reset(batch, num_slots)
        rows = [Row(x, params, self.eos_ids, self.tokenizer) for x in ids]
        stats = SpecStats(k=k)
        generator = torch.Generator().manual_seed(params.seed)
        drafter = self._make_drafter(spec, params, batch, num_slots)
        pinned = None
        if spec.mode is Mode.SSD and self._cpu_plan is not None:
            pinned = self._cpu_plan.apply_to_this_process(pin_affinity=self.config.pin_cpus)
        try:
            # prefill: the prompt's logits give the first token
            t0 = time.perf_counter()
            logits = self._forward([r.prompt for r in rows])
            p_first = logits_to_probs(torch.stack([lg[-1] for lg in logits]), params)  # [B, V]
            first = sample(p_first, generator)  # [B]
            stats.verify_s += time.perf_counter() - t0
            for b, row in enumerate(rows):
                row.append(int(first[b]))
            stats.mark_first_token()
            stats.tokens += batch
            yield from self._token_events(
                rows, [[r.generated[0]] for r in rows], [[TokenOrigin.TARGET]] * batch
            )
            if drafter is not None:
                drafter.start([r.tokens for r in rows])
            round_index = 0
            while any(r.active for r in rows) and not self._cancel:
                yield from self._round(rows, drafter, k, params, generator, stats, round_index)
                round_index += 1
            if self._cancel:
                for r in rows:
                    if r.active:
                        r.finish_reason = "cancelled"
        except KeyboardInterrupt:
            if self._worker is not None:  # Ctrl-C: do not wait for the worker, kill it now
                self._worker.broken = True
                self._stop_worker()
            raise
        finally:
            if pinned is not None:
                pinned.restore()
            if drafter is not None:
                drafter.close()
        stats.finish()
        outputs = tuple(Output(r.text(), tuple(r.generated), r.finish_reason or "length") for r in rows)
        yield DoneEvent(outputs, stats.snapshot())

    def _round(self, rows, drafter, k, params, generator, stats, round_index) -> Iterator[Event]:
        """One speculate -> verify -> commit round over every active row."""
        active = [r.active for r in rows]
        batch = len(rows)
        # speculate
        t0 = time.perf_counter()
        if drafter is None:
            proposal_tokens = [[] for _ in rows]
            q = None
            cache_hit = None
            backup = None
        else:
            proposal = drafter.propose([r.tokens for r in rows], active)
            proposal_tokens, q = proposal.tokens, proposal.q
            cache_hit, backup = proposal.cache_hit, proposal.backup
            if proposal.draft_busy_s is not None:
                stats.draft_busy_s += proposal.draft_busy_s
        t1 = time.perf_counter()
        # verify: the target scores pending + drafts in one forward
        pending = [self.runner.pending(b, r.tokens) if active[b] else [] for b, r in enumerate(rows)]
        feed = [pending[b] + proposal_tokens[b] for b in range(batch)]
        logits = self._forward(feed)  # per row [len(pending)+n_draft, V]
        width = k + 1
        vocab = self.target.args.vocab_size
        stacked = torch.zeros(batch, width, vocab)  # [B, K+1, V]
        drafts = torch.zeros(batch, k, dtype=torch.long)  # [B, K]
        n_draft = torch.zeros(batch, dtype=torch.long)  # [B]
        for b in range(batch):
            if not active[b]:
                continue
            n = len(proposal_tokens[b])
            scored = logits[b][len(pending[b]) - 1 :]  # [n+1, V]
            stacked[b, : n + 1] = scored
            stacked[b, n + 1 :] = scored[-1]
            drafts[b, :n] = torch.tensor(proposal_tokens[b], dtype=torch.long)
            n_draft[b] = n
        p = logits_to_probs(stacked, params)  # [B, K+1, V]
        if k == 0:
            n_acc = torch.zeros(batch, dtype=torch.long)
            bonus = sample(p[:, 0], generator)  # [B]
        else:
            verdict = verify(p, drafts, q, generator, n_draft)
            n_acc, bonus = verdict.n_accepted, verdict.bonus
        t2 = time.perf_counter()
        # commit
        n_acc_list = n_acc.tolist()
        bonus_list = bonus.tolist()
        emitted: list[list[int]] = []
        origins: list[list[str]] = []
        for b, row in enumerate(rows):
            if not active[b]:
                emitted.append([])
                origins.append([])
                continue
            n = n_acc_list[b]
            hit = bool(cache_hit[b]) if cache_hit is not None else False
            draft_origin = TokenOrigin.DRAFT_HIT if hit else TokenOrigin.DRAFT
            new = proposal_tokens[b][:n] + [bonus_list[b]]
            kinds = [draft_origin] * n + [TokenOrigin.TARGET]
            taken = [tok for tok in new if row.append(tok)]
            emitted.append(taken)
            origins.append(kinds[: len(taken)])
            self.runner.sync(b, row.tokens)
            stats.tokens += len(taken)
            stats.record_row(int(n_draft[b]), n, len(taken))
            if cache_hit is not None:
                stats.record_ssd_row(hit, len(taken))
        if drafter is not None:
            drafter.observe([r.tokens for r in rows], n_acc_list, bonus_list, [r.active for r in rows])
        stats.rounds += 1
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        if cache_hit is not None:
            stats.ssd_rounds += 1
            stats.cache_hits += int(all(h for h, a in zip(cache_hit, active) if a))
            if backup:
                stats.backup_used[backup] = stats.backup_used.get(backup, 0) + 1
        yield from self._token_events(rows, emitted, origins)
        yield RoundEvent(
            round_index,
            tuple(int(n_draft[b]) for b in range(batch) if active[b]),
            tuple(n_acc_list[b] for b in range(batch) if active[b]),
            tuple(cache_hit[b] for b in range(batch) if active[b]) if cache_hit is not None else None,
            backup,
            stats.snapshot(),
        )

    @staticmethod
    def _token_events(rows, emitted, origins) -> Iterator[TokensEvent]:
        for b, row in enumerate(rows):
            if not emitted[b]:
                continue
            yield TokensEvent(b, tuple(emitted[b]), row.take_text_delta(), tuple(origins[b]))


def _load_model(spec):
    """Load a ModelSpec's model on its backend (torch: HF dir or converted .gguf)."""
    if spec.backend == "llamacpp":
        from .backends.llamacpp import load_gguf

        return load_gguf(spec.path, spec.device)
    from .backends.torch_backend.loader import load_model

    return load_model(spec.path, spec.device, spec.dtype)


def _make_runner(loaded):
    """The runner for a loaded model: LlamaCppRunner for GGUF via llama.cpp, else ModelRunner."""
    from .backends.llamacpp import LlamaCppRunner, LoadedGGUF
    from .backends.torch_backend.runner import ModelRunner

    return LlamaCppRunner(loaded) if isinstance(loaded, LoadedGGUF) else ModelRunner(loaded)


def _tokenizer(path: str, backend: str):
    if backend == "llamacpp":
        from .backends.llamacpp import gguf_tokenizer

        return gguf_tokenizer(path)
    from .backends.torch_backend.loader import load_tokenizer

    return load_tokenizer(path)


def _preflight(path: str, backend: str = "torch") -> None:
    """Cheap checks of a checkpoint (files, config, architecture) without reading weights."""
    if backend == "llamacpp":
        from .backends.llamacpp import preflight

        preflight(path)
        return
    from .backends.torch_backend.loader import load_hf_config, resolve_checkpoint, weight_files
    from .backends.torch_backend.model import ModelArgs

    ckpt = resolve_checkpoint(path)
    ModelArgs.from_hf_config(load_hf_config(ckpt))
    weight_files(ckpt)
