"""`--mode auto` as far as the placement decides it: one decision, one reason, the same
words in `devices`, `generate`, `chat` and `serve`.

No draft -> AR; a draft that costs nothing (n-gram, suffix) -> SD; a draft on hardware of
its own (another GPU, or the CPU beside a GPU target) -> SSD, whose drafting then overlaps
verification; target and draft on one GPU (one of a tensor-parallel target's too) -> SD,
since SSD's worker process would time-slice with the target there (SHARED_GPU says why). Target and draft both on the CPU share
one memory system, where SSD would split the cores and lose to SD: SD choosing K each
round (K=0 is a plain step, so plain decoding is one of its choices), or, with K pinned,
AR or SD by a calibration of the loaded models (engine/auto.py). A target whose kernels
give a token other logits in a call of several tokens than alone (llama.cpp on a CPU,
unless its steps are batch-invariant) -> AR whatever the draft: verifying K+1 tokens in
one call could change a greedy answer at a near-tie. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ssdlocal.core.config import Mode
from ssdlocal.core.models import BackendName

CPU_SHARED = "target and draft share the CPU"  # the start of every CPU-shared reason
# Why one GPU gets SD, not SSD: the worker is a process of its own (it owns its model, cache
# and speculation cache, and talks through typed messages), and without NVIDIA's MPS two
# processes' kernels share a GPU by time-slicing, never at once; the worker also waits for
# its device after every tree step and proposal. Running the speculator in the target's
# process on a stream of its own would overlap, but shares the target's caching allocator,
# graph pools and current-device state with the round: not built.
SHARED_GPU = (
    "target and draft share {draft}: SSD would run the draft in a second process, whose kernels "
    "time-slice with the target's on one GPU (no MPS) instead of running beside them, and which "
    "waits for the GPU after every tree step, so pre-speculation would not overlap verification; "
    "synchronous speculation drafts and verifies on one stream without that contention"
)
KERNELS_APART = (
    "llama.cpp's CPU kernels give a token other logits in a call of several tokens than alone "
    "(tenths apart), so verifying K+1 drafted tokens at once could change a greedy answer "
    "wherever the top two tokens are that close, and with it from run to run"
)


@dataclass(frozen=True)
class ModeChoice:
    """A mode and why: `short` is the one line printed before the first token (and by
    `devices`), `reason` the whole story (`mode_reason` in --json, the chat's `why` key)."""

    mode: Mode
    reason: str
    short: str = ""
    # a calibration's step costs (seconds of one target step by scored tokens) the choice
    # was made from, which its SD re-checks itself against; None when the placement decided
    widths: dict[int, float] | None = field(default=None, compare=False)

    @property
    def line(self) -> str:
        """`mode sd: <short reason>`: what every command prints."""
        return f"mode {self.mode.value}: {self.short or self.reason}"

    def measured(self, detail: str) -> ModeChoice:
        """The same choice, its full reason followed by what a calibration measured."""
        return replace(self, reason=f"{self.reason}; {detail}")


def _is_gpu(device: str) -> bool:
    return device.startswith("cuda")


def cpu_shared(adaptive_k: bool) -> ModeChoice | None:
    """Target and draft model on the CPU: SD choosing K per round, or (K pinned) None: a
    calibration decides between AR and SD."""
    if not adaptive_k:
        return None
    return ModeChoice(
        Mode.SD,
        f"{CPU_SHARED} and one memory system, where SSD would split the cores and lose to SD; "
        "SD chooses K each round from the measured costs and acceptance (K=0, a plain step, "
        "when drafting does not pay), and switches to AR for the rest of an answer whose rounds "
        "run slower than plain steps would",
        f"{CPU_SHARED}: K chosen per round (0 = plain step)",
    )


def batch_exact(backend: BackendName, targets: tuple[str, ...], batch_invariant: bool = False) -> bool:
    """Whether a target on `backend` over `targets` gives a token the same logits however
    many tokens its call holds: not llama.cpp on the CPU, unless its steps are
    batch-invariant (placement_mode's `batch_exact`)."""
    return not (backend is BackendName.LLAMACPP and tuple(targets) == ("cpu",) and not batch_invariant)


def placement_mode(
    targets: tuple[str, ...],
    draft_device: str | None,
    draft_kind: str,
    draft_label: str = "",
    adaptive_k: bool = True,
    batch_exact: bool = True,
) -> ModeChoice | None:
    """The mode for this placement. `draft_kind`: "none", "model", "head" (a draft head
    beside the target: SD), or a drafter that costs nothing ("ngram", "suffix"); `batch_exact`: the target's kernels give a token the same
    logits however many tokens its call holds (False: llama.cpp on a CPU without
    batch-invariant steps). None when a calibration of the loaded models decides."""
    if draft_kind == "none":
        return ModeChoice(Mode.AR, "no draft model, so plain autoregressive decoding", "no draft model")
    if not batch_exact:
        return ModeChoice(
            Mode.AR,
            f"{KERNELS_APART}; plain decoding keeps every answer exact and the same each run "
            "(--batch-invariant makes speculation exact on them, at about 1.5x the cost of a "
            "plain step; --mode sd speculates anyway, exact up to such near-ties)",
            "llama.cpp's CPU kernels: plain decoding keeps greedy answers exact",
        )
    if draft_kind == "head":
        return ModeChoice(
            Mode.SD,
            "a draft head reads the target's hidden states, which exist only once the target has "
            "verified a token, so it drafts between verifications (synchronous speculation)",
            "a draft head drafts between verifications",
        )
    if draft_kind != "model":
        label = draft_label or draft_kind
        return ModeChoice(
            Mode.SD,
            f"the {label} draft costs nothing to run, so synchronous speculation",
            f"the {label} draft costs nothing to run",
        )
    where = ",".join(targets)
    draft = draft_device or "cpu"
    if draft not in targets and (_is_gpu(draft) or any(_is_gpu(t) for t in targets)):
        return ModeChoice(
            Mode.SSD,
            f"the draft has hardware of its own ({draft}, target on {where}), so SSD "
            "pre-speculates while the target verifies",
            f"the draft has hardware of its own ({draft}; target {where})",
        )
    if _is_gpu(draft):
        return ModeChoice(
            Mode.SD, SHARED_GPU.format(draft=draft), f"target and draft share {draft}: SSD's worker would time-slice"
        )
    return cpu_shared(adaptive_k)
