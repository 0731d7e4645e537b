"""Typed messages between the target (engine) and the SSD draft worker process.

Commands are IntEnum values, payloads frozen dataclasses; nothing else crosses the
pipe (SHUTDOWN and error replies are ssdlocal.ipc's shared control messages). Draft
distributions q travel through the q channel (shared memory or CUDA IPC), not the pipe.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

from ssdlocal.core.config import Backup, GraphMode, ModelSpec, SamplingParams

if TYPE_CHECKING:  # messages carry tensors but need no torch to be defined
    import torch


class Cmd(IntEnum):
    """Target -> worker."""

    LOAD = 1  # load the draft model (payload LoadMsg)
    START = 2  # new batch (StartMsg); the previous batch's rows go to the prefix cache
    FIRST = 3  # draft the first round just-in-time (payload: each row's first token, or None)
    OUTCOME = 4  # verification result of the last round (OutcomeMsg)
    FORGET = 5  # empty the prefix cache (no payload, no reply)


class Reply(IntEnum):
    """Worker -> target."""

    LOADED = 1  # LoadedMsg
    READY = 2  # batch prefilled (payload: {"graphs": the runner's graph counts, "prefix": its prefix cache's})
    PROPOSAL = 3  # ProposalMsg


@dataclass(frozen=True)
class LoadMsg:
    model: ModelSpec
    threads: int | None  # torch threads for the worker (None = leave default)
    cpus: tuple[int, ...] | None  # CPU affinity for the worker process
    graphs: GraphMode = GraphMode.AUTO  # captured forwards (EngineConfig.graphs)
    prefix_tokens: int | None = None  # the prefix cache's size (EngineConfig.prefix_cache_tokens)


@dataclass(frozen=True)
class LoadedMsg:
    vocab_size: int
    device: str
    max_positions: int  # the draft's context length


@dataclass(frozen=True)
class StartMsg:
    sequences: tuple[tuple[int, ...], ...]  # each row's tokens so far: its prompt (FIRST brings the first token)
    params: SamplingParams
    k: int
    num_slots: int  # main-region slots per row (the target's size)
    target_vocab: int
    fan_out: tuple[int, ...] | None  # after a hit; None = auto
    fan_out_miss: tuple[int, ...] | None  # after a miss; None = auto
    saguaro_c: float
    backup: Backup  # the configured one (AUTO is resolved by the engine each round)
    q_buffer: torch.Tensor | None  # shared tensor [B, K, V] float32 for q, or None when greedy
    memory: tuple[tuple[int, ...], ...] = ()  # the engine's suffix memory (backup "suffix")
    min_confidence: float = 0.3  # suffix proposals stop below this share


@dataclass(frozen=True)
class OutcomeMsg:
    round_index: int
    appended: tuple[tuple[int, ...], ...]  # per row: committed tokens this round
    n_accepted: tuple[int, ...]
    bonus: tuple[int, ...]
    active: tuple[bool, ...]
    verify_s: float  # the target's verification time (for fan-out budget sizing)
    backup: Backup  # backup to use for missed rows this round (never AUTO)
    # a prompt waiting to join and how many more of its tokens to read into the prefix store
    # once pre-speculation is done (Drafter.read_ahead), or None
    ahead: tuple[tuple[int, ...], int] | None = None


@dataclass(frozen=True)
class ProposalMsg:
    round_index: int
    tokens: tuple[tuple[int, ...], ...]
    cache_hit: tuple[bool, ...]
    backup: Backup | None  # which backup served the missed rows (None if all hit)
    q_written: bool  # q for these tokens is in the shared buffer
    busy_s: float  # worker compute time since the previous proposal (pre-spec + resolve)
    prespec_s: float  # time of the pre-speculation that preceded this proposal
    fan_out: tuple[int, ...]  # fan-out used for the pre-speculation
    graphs: dict | None = None  # the draft runner's graph counts so far (graphs.graph_report)
    host_waits: dict | None = None  # the worker's host waits so far (core.hostsync.HostWaits.as_dict)
