"""Target side of SSD: the worker process handle and the SSDDrafter the engine drives.

DraftWorkerClient spawns the worker (an ipc.ChildProcess: deadline on every receive, a
dead or silent worker becomes DraftWorkerError, no process left behind on close).
SSDDrafter implements the Drafter protocol: `observe` sends the outcome without waiting,
so the worker's reply is usually ready by the next `propose` (a cache hit then costs
only a pipe round trip).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from ssdlocal.core.config import Backup, GraphMode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.core.errors import DraftWorkerError
from ssdlocal.core.events import SsdRound
from ssdlocal.core.hostsync import Audit, HostWaits
from ssdlocal.draft.base import DrafterBase, Proposal, RoundOutcome, RowView
from ssdlocal.draft.ssd import protocol as pr
from ssdlocal.ipc.child import ChildProcess
from ssdlocal.ipc.qchannel import QChannel, choose_q_channel, make_q_channel
from ssdlocal.speculation.backup import BackupChooser

log = logging.getLogger(__name__)


RECV_TIMEOUT_S = 120.0  # longest wait for one reply during generation (tests lower it)
PREFILL_S_PER_TOKEN = 0.25  # more for READY per prompt token the worker prefills (slow CPUs)
LOAD_TIMEOUT_S = 900.0  # longest wait for the draft model to load


class DraftWorkerClient:
    """Owns the draft worker process (an ipc.ChildProcess) and loads the draft in it.

    After any failed or interrupted exchange the client is `broken`: it refuses further
    use and `close` kills the worker at once.
    """

    def __init__(
        self,
        model: ModelSpec,
        *,
        threads: int | None = None,
        cpus: tuple[int, ...] | None = None,
        graphs: GraphMode = GraphMode.AUTO,
        timeout_s: float | None = None,
        load_timeout_s: float | None = None,
        prefix_tokens: int | None = None,
    ) -> None:
        from ssdlocal.draft.ssd.worker import worker_main

        self.timeout_s = RECV_TIMEOUT_S if timeout_s is None else timeout_s
        self.load_timeout_s = LOAD_TIMEOUT_S if load_timeout_s is None else load_timeout_s
        self.vocab_size: int | None = None
        self.max_positions: int | None = None  # the draft's context, once loaded
        self.prefix_report: dict | None = None  # the worker's prefix cache, as of its last READY
        self.child = ChildProcess(
            worker_main,
            (),
            name="ssdlocal-draft",
            role="the draft worker",
            error=DraftWorkerError,
            dead_hint="the draft process was killed or crashed (out of memory?); rerun, or use --mode sd",
            hung_hint="the draft device may be overloaded; try --mode sd, or a smaller draft",
        )
        try:
            self.send(pr.Cmd.LOAD, pr.LoadMsg(model, threads, cpus, graphs, prefix_tokens))
        except BaseException:
            self.close()  # the caller never gets a handle to close
            raise

    @property
    def proc(self):
        return self.child.proc

    @property
    def broken(self) -> bool:
        return self.child.broken

    @broken.setter
    def broken(self, value: bool) -> None:
        self.child.broken = value

    @property
    def usable(self) -> bool:
        return not (self.child.broken or self.child.closed)

    def send(self, cmd: pr.Cmd, payload=None) -> None:
        self.child.send(cmd, payload)

    def recv(self, expect: pr.Reply, timeout_s: float | None = None):
        """Wait for one reply of kind `expect`; raise on error, death or timeout."""
        return self.child.recv(expect, self.timeout_s if timeout_s is None else timeout_s)

    def wait_loaded(self) -> int:
        msg = self.recv(pr.Reply.LOADED, self.load_timeout_s)
        self.vocab_size, self.max_positions = msg.vocab_size, msg.max_positions
        return msg.vocab_size

    def forget_prefixes(self) -> None:
        """Empty the worker's prefix cache (when it runs)."""
        if self.usable:
            self.send(pr.Cmd.FORGET)

    def close(self) -> None:
        """Stop the worker; never hangs, never leaves a process. Idempotent."""
        self.child.close()


class SSDDrafter(DrafterBase):
    """Drafter protocol over the async worker: propose waits, observe does not."""

    def __init__(
        self,
        client: DraftWorkerClient,
        spec: SpecConfig,
        params: SamplingParams,
        target_vocab: int,
        num_slots: int,
        *,
        target_device: str = "cpu",
        draft_device: str = "cpu",
        memory=None,
        audit: Audit | None = None,
    ) -> None:
        self.client = client
        self.site = (audit or Audit()).site("target")  # proposals go up to the target staged
        self.target_device = target_device  # rank 0 of the target: where the q buffer lives
        self.draft_device = draft_device
        self.k = spec.k
        self.spec = spec
        self.params = params
        self.target_vocab = target_vocab
        self.num_slots = num_slots
        self._round = 0
        self._first = True
        self._proposed_at = 0.0
        self._q_channel: QChannel | None = None  # None when greedy (no q)
        self.chooser = BackupChooser(spec.backup, spec.k)
        self.last: pr.ProposalMsg | None = None
        self._awaiting = False  # a PROPOSAL reply is owed by the worker
        self._ahead: tuple[tuple[int, ...], int] | None = None  # sent with the next outcome (read_ahead)
        self.memory = memory  # speculation.suffix.SuffixMemory, sent when the backup is suffix
        self.graphs_at_start: dict | None = None  # the worker's graph counts at START
        self.waits_at_start = HostWaits()  # the worker's host waits at START
        self._ready_owed = 0  # prompt tokens of a START whose READY is not read yet
        self._started = False  # START sent for this call
        self._firsts: tuple[int, ...] | None = None  # each row's first token, sent with FIRST

    def read_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        """START the batch from its prompts, so the worker reads them while the target reads
        its own (the first tokens follow with FIRST)."""
        sequences = [list(p) for p in prompts]
        batch = len(sequences)
        self._q_channel = None
        if not self.params.greedy:
            choice = choose_q_channel(self.target_device, self.draft_device)
            log.debug("q channel: %s (%s)", choice.kind, choice.reason)
            self._q_channel = make_q_channel(choice, batch, self.k, self.target_vocab, self.target_device)
        msg = pr.StartMsg(
            sequences=tuple(tuple(s) for s in sequences),
            params=self.params,
            k=self.k,
            num_slots=self.num_slots,
            target_vocab=self.target_vocab,
            fan_out=self.spec.fan_out,
            fan_out_miss=self.spec.fan_out_miss,
            saguaro_c=self.spec.saguaro_c,
            backup=self.spec.backup,
            q_buffer=None if self._q_channel is None else self._q_channel.buffer,
            memory=self._memory(),
        )
        self.client.send(pr.Cmd.START, msg)
        self._ready_owed = sum(len(s) + 1 for s in sequences)  # the prompts, then each row's first token
        self._started, self._first = True, True

    def start(self, rows: Sequence[RowView], hidden=None) -> None:
        """The rows as the target's prefill left them (prompt + first token); START them
        now unless `read_prompts` did."""
        if self._started:
            self._firsts = tuple(row.tokens[-1] for row in rows)
        else:
            self.read_prompts([row.tokens for row in rows])
            self._firsts = None
        self._wait_ready()

    def _wait_ready(self) -> None:
        """READY comes after the worker has prefilled every prompt: long prompts on a CPU
        can take minutes, which must not pass for a hung worker."""
        owed, self._ready_owed = self._ready_owed, 0
        if owed:
            ready = self.client.recv(pr.Reply.READY, self.client.timeout_s + PREFILL_S_PER_TOKEN * owed) or {}
            self.graphs_at_start = ready.get("graphs")
            self.waits_at_start = HostWaits.from_dict(ready.get("host_waits") or {})
            self.client.prefix_report = ready.get("prefix")  # the worker's prefix cache, as of READY

    def _memory(self) -> tuple[tuple[int, ...], ...]:
        """The suffix memory for the worker, when the suffix backup may serve a miss."""
        if self.memory is None or self.spec.backup is not Backup.SUFFIX:
            return ()
        return tuple(tuple(seq) for seq in self.memory.sequences())

    def propose(self, active: Sequence[bool]) -> Proposal:
        if self._first:
            self.client.send(pr.Cmd.FIRST, self._firsts)
            self._first = False
        self._awaiting = False  # on failure the pipe is unusable anyway
        msg: pr.ProposalMsg = self.client.recv(pr.Reply.PROPOSAL)
        self.last = msg
        self._proposed_at = time.perf_counter()
        q = None
        if msg.q_written and self._q_channel is not None:
            q = self._q_channel.read()  # [B, K, V]: a private copy (host shared memory, or the target's GPU)
            if q.device.type == "cpu":
                q = self.site.to_device(q, self.target_device)  # where the target verifies: staged, no wait
        self.chooser.observe_proposal(msg)
        return Proposal.from_lists(
            msg.tokens,
            self.k,
            self.target_device,
            self.site,
            q=q,
            ssd=SsdRound(tuple(msg.cache_hit), msg.backup, msg.busy_s),
        )

    def observe(self, outcome: RoundOutcome) -> None:
        verify_s = time.perf_counter() - self._proposed_at
        if not any(outcome.active):
            return  # generation is over; the worker needs no outcome
        if self.last is not None:
            for b, appended in enumerate(outcome.appended):
                if appended and b < len(self.last.cache_hit):
                    served_by = None if self.last.cache_hit[b] else (self.last.backup or Backup.JIT)
                    self.chooser.observe_tokens(served_by, len(appended))
        backup = self.chooser.choose(sum(outcome.active), verify_s)
        msg = pr.OutcomeMsg(
            round_index=self._round,
            appended=outcome.appended,
            n_accepted=outcome.n_accepted,
            bonus=outcome.bonus,
            active=outcome.active,
            verify_s=verify_s,
            backup=backup,
            ahead=self._ahead,
        )
        self._ahead = None
        self._round += 1
        self.client.send(pr.Cmd.OUTCOME, msg)
        self._awaiting = True

    def host_waits(self) -> HostWaits | None:
        """The worker's host waits during this batch (as of its last proposal)."""
        if self.last is None or self.last.host_waits is None:
            return None
        return HostWaits.from_dict(self.last.host_waits) - self.waits_at_start

    def graph_report(self, since: dict | None = None) -> dict | None:
        """The draft runner's graph counts during this batch (as of its last proposal; the
        worker's counts at START are what they are counted from, whatever `since` says)."""
        if self.last is None or self.last.graphs is None:
            return None
        start = self.graphs_at_start or {}
        counts = {k: v - start.get(k, 0) if isinstance(v, int) else v for k, v in self.last.graphs.items()}
        if not (counts.get("refused") or counts.get("dropped")):
            counts.pop("notes", None)
        return counts

    def close(self) -> None:
        """End of one generate call: collect a reply still owed (after a cancel) so the
        pipe is clean for the next batch. The worker itself lives on. After a failure
        the client is broken and there is nothing to collect (close kills the worker)."""
        if self._ready_owed and self.client.usable:  # the call ended before its first round
            self._wait_ready()
        self._ready_owed = 0
        if self._awaiting and self.client.usable:
            self._awaiting = False
            self.client.recv(pr.Reply.PROPOSAL)
        self._awaiting = False

    def store_prefixes(self) -> None:
        return None  # the worker stores its rows when the next batch starts

    def read_ahead(self, tokens, n: int) -> None:
        """Drafter.read_ahead: sent with the next outcome; the worker reads it after that
        round's pre-speculation."""
        self._ahead = (tuple(int(t) for t in tokens), n)
