"""Draft-side SSD logic for one batch: drafting, pre-speculation, cache lookup, backups.

Runs inside the draft worker process (or in-process in tests). While the target
verifies round T, `prespeculate` decodes K tokens for every likely outcome
(n_accepted, bonus) of T in one batched tree forward per step; `resolve` then serves
round T+1 from the speculation cache, or from the backup on a miss.

KV layout per row: backends.base.SlotLayout.with_tree (the row's sequence, then one
scratch run of K slots per branch, then a trash slot that padded queries write to).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ssdlocal.backends.base import Logits, Runner, SlotLayout
from ssdlocal.core.config import Backup, SamplingParams
from ssdlocal.core.hostsync import Audit
from ssdlocal.core.sampling import logits_to_probs, saguaro_probs, sample
from ssdlocal.draft.decode import DraftDecoder, Drafting, align_vocab
from ssdlocal.draft.ssd.protocol import OutcomeMsg, StartMsg
from ssdlocal.speculation.fanout import FanOutPlanner
from ssdlocal.speculation.ngram import propose_ngram
from ssdlocal.speculation.suffix import MAX_MATCH, SuffixIndex, SuffixMemory, propose
from ssdlocal.speculation.cache import Branch, SpeculationCache, bonus_candidates_device, candidate_count


@dataclass
class RowState:
    seq: list[int]  # committed tokens (last one = latest bonus, not yet fed)
    proposal: list[int]  # current drafts d_1..d_n (n <= K)
    q: torch.Tensor | None  # [n, V] distributions the drafts were drawn from (None = greedy)
    pred: dict[int, torch.Tensor]  # sequence index -> draft logits [V] predicting it
    from_hit: bool = False
    active: bool = True


@dataclass(frozen=True)
class Served:
    """The next proposal, as the worker returns it."""

    tokens: list[list[int]]
    q: torch.Tensor | None  # [B, K, V]
    cache_hit: list[bool]
    backup: Backup | None


def wait_for_device(t: torch.Tensor) -> None:
    """Block until the work queued on `t`'s device so far has run (CUDA queues kernels
    asynchronously: without this, every tree step is queued before the first poll)."""
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


class SuffixBackup:
    """Suffix proposals for missed rows: each row's own tokens and the engine's memory."""

    def __init__(self, start: StartMsg) -> None:
        self.memory = SuffixMemory(max(len(start.memory), 1), max(sum(map(len, start.memory)), 1))
        for seq in start.memory:
            self.memory.add(seq)
        self.own = [SuffixIndex(s) for s in start.sequences]
        self.min_confidence = start.min_confidence

    def propose(self, b: int, seq: list[int], k: int) -> list[int]:
        found = propose(seq, self.own[b], self.memory.indexes(), k, self.min_confidence)
        return list(found.tokens)


class Speculator:
    """Owns a draft Runner's state for one batch of rows.

    Host waits (counted in `audit`, model "worker"): per pre-speculation one read, of the
    tree's bonuses and drafts together (the bonus candidates of every row and accepted
    length come from one batched top-k and stay on the device: the tree's first tokens are
    gathered from them there); a miss served just in time reads its drafts once; with
    automatic fan-out each poll for an early outcome waits for the previous tree step (by
    design: counted too)."""

    def __init__(self, runner: Runner, start: StartMsg, max_budget: int = 32, audit: Audit | None = None) -> None:
        self.runner = runner
        self.site = (audit or Audit()).site("worker")
        self.k = start.k
        self.params: SamplingParams = start.params
        self.vocab = start.target_vocab
        self.c = start.saguaro_c
        self.fixed_hit = start.fan_out
        self.fixed_miss = start.fan_out_miss
        self.plan_hit = FanOutPlanner(self.k, max_budget=max_budget)
        self.plan_miss = FanOutPlanner(self.k, max_budget=max_budget)
        widest = max(max_budget, sum(start.fan_out or ()), sum(start.fan_out_miss or ()))
        self.max_branches = widest
        self.full_layout = SlotLayout(start.num_slots).with_tree(widest, self.k)  # slots allocated
        self.layout = self.full_layout  # this round's placement of the tree (_tree_decode)
        runner.reset(len(start.sequences), self.full_layout.total)
        self.generator = torch.Generator(device=runner.device).manual_seed(start.params.stream_seed(104729))
        self.rows = [RowState(list(s), [], None, {}) for s in start.sequences]
        self.suffix = SuffixBackup(start) if start.backup is Backup.SUFFIX else None
        self.cache = SpeculationCache()
        self.last_fan: tuple[int, ...] = ()
        self.last_depth = 0  # tree depth reached by the last pre-speculation
        for b, seq in enumerate(start.sequences):  # from the longest prefix the prefix cache holds
            runner.reuse(b, seq[:-1])
        runner.feed([runner.pending(b, seq[:-1]) for b, seq in enumerate(start.sequences)], Logits.NONE)

    def store_prefixes(self) -> None:
        """Each row's committed tokens that the draft's cache holds go to its prefix cache."""
        for b, row in enumerate(self.rows):
            self.runner.store(b, row.seq[: self.runner.holds(b, row.seq)])

    # ------------------------------------------------------------- fan-out
    def early_stop(self, poll):
        """`should_stop` for prespeculate: stop when `poll()` says the outcome has arrived.

        Only with automatic fan-out: with fixed fan-outs the tree is always completed,
        so seeded SSD sampling does not depend on timing.
        """
        if self.fixed_hit is not None or self.fixed_miss is not None:
            return None
        return lambda: bool(poll())

    def fan_for(self, from_hit: bool) -> tuple[int, ...]:
        fixed = self.fixed_hit if from_hit else self.fixed_miss
        if fixed is not None:
            return fixed
        return (self.plan_hit if from_hit else self.plan_miss).plan()

    def _probs(self, logits: torch.Tensor, fan: int) -> torch.Tensor:
        """Draft logits [N, V] -> q' [N, V]: warped like p, then Saguaro-scaled."""
        q = logits_to_probs(logits, self.params)  # [N, V]
        return saguaro_probs(q, fan, self.c) if not self.params.greedy else q

    # ------------------------------------------------------------- drafting (jit)
    def draft_jit(self, which: list[int]) -> None:
        """Draft K tokens just-in-time for rows `which` (SD for those rows), on the draft's
        device with the K-step decoder ModelDrafter uses; one host read-back at the end.

        The first forward feeds each row's pending tokens (the committed ones it lacks);
        then K-1 one-token steps over every row (the other rows' writes land past their
        cached tokens and are forgotten by `end_steps`)."""
        fan = self.fan_for(False)
        feeds = [self.runner.pending(b, r.seq) if b in which else [] for b, r in enumerate(self.rows)]
        out = self.runner.feed(feeds, Logits.LAST)  # per row [1, V_d] (or [0, V_d])
        width = max(o.shape[-1] for o in out)
        first = torch.stack([o[-1] if len(o) else o.new_zeros(width) for o in out])  # [B, V_d]
        self.runner.begin_steps()
        drafting = Drafting(self.runner, self.k, self.params, self.vocab)
        decoder = DraftDecoder(drafting, self.generator, probs=lambda logits, j: self._probs(logits, fan[j]))
        bound = max(self.runner.cached(b) for b in range(len(self.rows))) + self.k
        drafted = decoder.decode(first, bound, keep_logits=True)
        predicted = drafted.logits  # [B, K, V]
        if predicted is None:  # keep_logits=True keeps them
            raise ValueError("the draft decoder dropped its logits")
        tokens = self.site.read(drafted.tokens)  # [B, K]: the one host transfer
        self.runner.end_steps({b: tokens[b][: self.k - 1] for b in which})  # d_1..d_{K-1} cached
        for b in which:
            row = self.rows[b]
            row.proposal = tokens[b]
            row.q = None if drafted.q is None else drafted.q[b]  # [K, V]
            row.pred.update({len(row.seq) + j: predicted[b, j] for j in range(self.k)})
            row.from_hit = False

    # ------------------------------------------------------------- pre-speculation
    def prespeculate(self, should_stop=None) -> float:
        """Fill the speculation cache for every active row's pending outcome; returns seconds.

        `should_stop` (optional, polled between tree steps) lets the worker cut the tree
        short when the target's outcome arrives early.
        """
        t0 = time.perf_counter()
        self.last_depth = 0
        self.cache.clear()
        rows = self.rows
        # 1. make sure the draft has seen seq + proposal, collecting its predictions
        feeds = [self.runner.pending(b, r.seq + r.proposal) if r.active else [] for b, r in enumerate(rows)]
        starts = [self.runner.cached(b) for b in range(len(rows))]
        out = self.runner.feed(feeds)
        for b, r in enumerate(rows):
            for j in range(len(feeds[b])):
                r.pred[starts[b] + j + 1] = align_vocab(out[b][j], self.vocab)  # [V]
        # 2. candidates per accepted length: one batched top-k, kept on the device; how many
        # each place has is host-known, so the branch list needs no read
        fans = [self.fan_for(r.from_hit) for r in rows]
        places = [(b, k) for b, r in enumerate(rows) if r.active for k in range(len(r.proposal) + 1)]
        cands, counts = self._candidates(places, fans)  # [N, C] on the device, [N] host
        branches: list[list[tuple[int, int | None, int | None]]] = [[] for _ in rows]
        for p, (b, k) in enumerate(places):
            r = rows[b]
            branches[b] += [(k, p * cands.shape[1] + i, None) for i in range(counts[p])]
            if self.suffix is not None:
                drafted = r.proposal[k] if k < len(r.proposal) else None
                branches[b] += [(k, None, c) for c in self._seed(b, r.seq[-MAX_MATCH:] + r.proposal[:k], drafted)]
        branches = [todo[: self.max_branches] for todo in branches]
        self.last_fan = fans[0] if fans else ()
        width = max((len(t) for t in branches), default=0)
        if width:
            self._tree_decode(branches, cands, width, should_stop)
        return time.perf_counter() - t0

    def _candidates(self, places: list[tuple[int, int]], fans) -> tuple[torch.Tensor, list[int]]:
        """Bonus candidates at each (row, accepted length) of `places`, without a host read:
        [N, C] on the draft's device (row p: the top tokens of the draft's prediction at
        place p, the drafted token excluded, best first) and each place's count (its
        fan-out, capped by the vocabulary); place p's candidates are its row's first
        counts[p] entries."""
        if not places:
            return torch.zeros(0, 0, dtype=torch.long, device=self.runner.device), []
        logits, drafted, counts = [], [], []
        for b, k in places:
            r, n_d = self.rows[b], len(self.rows[b].proposal)
            logits.append(r.pred[len(r.seq) + k])  # [V]
            drafted.append(r.proposal[k] if k < n_d else None)
            counts.append(candidate_count(fans[b][k] if k < n_d else fans[b][self.k], drafted[-1], self.vocab))
        stacked = torch.stack(logits)  # [N, V]
        marks = self.site.upload([-1 if d is None else d for d in drafted], stacked.device)  # [N]
        cands = bonus_candidates_device(stacked, marks, max(counts), self.params)  # [N, C]
        return cands, counts

    def _seed(self, b: int, context: list[int], drafted: int | None) -> list[int]:
        """With the suffix backup: the token earlier text continued `context` with (the end
        of the row's sequence, at least its last MAX_MATCH tokens), as one more bonus
        candidate (a rejected draft token cannot be the bonus). The draft's candidates stay
        on the device, so a guess already among them is decoded too and dropped when the
        tree is cached (the draft's branch wins): it costs compute, never a host read.
        Which branches are cached changes hits, not tokens."""
        if self.suffix is None:
            return []
        guess = self.suffix.propose(b, context, 1)
        if not guess or guess[0] == drafted or guess[0] >= self.vocab:
            return []
        return guess

    def _tree_decode(self, branches, cands: torch.Tensor, width: int, should_stop=None) -> None:
        """Up to K batched steps decoding every branch; branch i of row b -> scratch run i.

        branches[b]: (accepted length k, candidate, token) per branch: its bonus is entry
        `candidate` of the flattened `cands` ([N, C] on the device, see `_candidates`) or,
        when candidate is None, the host-known `token` (a suffix seed).

        `should_stop()` is polled between steps (never before the first), after the device
        has finished the previous step: when it turns True the branches keep the depth
        reached so far (shorter proposals, no waiting), also on a GPU.
        Inputs and masks are built on the draft's device; the width is padded up to what
        the runner prefers (its graph buckets) with queries that see only the trash slot.
        The W real branches' logits of every step go straight into one [B, W, K, V_d] buffer
        (Runner.forward_raw's `out`): no copy per step of the padded width, no stack after.
        """
        kept = width  # the branches whose logits are kept; the rest of the padded width is padding
        width = self.runner.tree_width(width)
        self.layout = self._tree_layout()
        ids, positions, slots, prefix = self._tree_inputs(branches, cands, width)  # [B, W] each
        bonuses = ids[:, :kept]  # [B, W] each branch's bonus (its first query)
        own = slots.clone()  # [B, W] first scratch slot of each branch (trash for padding)
        real = slots != self.layout.trash  # [B, W]
        span = torch.arange(self.layout.total, device=ids.device)  # [S]
        fan = self.fan_for(True)  # a branch becomes a proposal only on a hit
        found = torch.empty(ids.shape[0], kept, self.k, self.runner.vocab_size, device=ids.device)  # [B, W, K, V_d]
        step_tokens: list[torch.Tensor] = []  # per step [B, W]
        step_q: list[torch.Tensor] = []  # per step [B, W, V] (sampling only)
        for j in range(self.k):
            if j > 0 and should_stop is not None:
                wait_for_device(ids)  # step j-1 done: the poll sees real progress, not a queue
                self.site.waited()
                if should_stop():
                    break  # the outcome is here: serve branches of depth j rather than wait
            sees_prefix = span[None, None, :] < prefix[..., None]  # [B, W, S] seq + d_1..d_k
            sees_own = (span >= own[..., None]) & (span <= own[..., None] + j)  # [B, W, S]
            mask = torch.where(real[..., None], sees_prefix | sees_own, span == self.layout.trash)
            logits = self.runner.forward_raw(ids, positions, slots, mask, out=found[:, :, j])  # [B, W, V_d]
            logits = align_vocab(logits, self.vocab)  # [B, W, V]
            if self.params.greedy:
                drawn = torch.argmax(logits, dim=-1)  # [B, W]
            else:
                q = self._probs(logits.reshape(-1, logits.shape[-1]), fan[j])  # [B*W, V]
                drawn = sample(q, self.generator).reshape(logits.shape[:2])  # [B, W]
                step_q.append(q.reshape(logits.shape))
            step_tokens.append(drawn)
            ids = torch.nn.functional.pad(drawn, (0, width - kept))  # [B, W padded]: padding feeds 0
            positions = positions + 1
            slots = torch.where(real, slots + 1, slots)
        self.last_depth = len(step_tokens)
        self._cache_branches(
            branches, bonuses, step_tokens, align_vocab(found[:, :, : self.last_depth], self.vocab), step_q
        )

    def _tree_layout(self) -> SlotLayout:
        """Where this round's scratch runs and trash go: right after the longest row's
        sequence and proposal (K + 2 slots), so a tree step attends over the slots the rows
        hold, not their whole budget, when the runner says a span (Runner.tree_span);
        else after the budget. A branch's slots are recorded with it (Branch.slot_start)."""
        full = self.full_layout
        longest = max((len(r.seq) for r in self.rows), default=0) + self.k + 2
        needed = SlotLayout(longest, full.branches, full.depth).total
        span = self.runner.tree_span(needed) if needed < full.total else None
        return full if span is None else full.placed(min(span, full.total))

    def _tree_inputs(self, branches, cands: torch.Tensor, width: int):
        """ids, positions, slots and prefix lengths [B, W] of every branch's first query; ids
        gathered on the device from `cands` (no read), padding and seeds from the host."""
        layout, batch = self.layout, len(self.rows)
        host = torch.zeros(5, batch, width, dtype=torch.long)  # token, positions, slots, prefix, pick
        host[2] = layout.trash  # padded queries write the trash slot
        host[4] = -1  # -1: the id is the host token (a seed, or 0 for padding)
        for b, todo in enumerate(branches):
            L = len(self.rows[b].seq)
            for i, (k, pick, token) in enumerate(todo):
                chosen = -1 if pick is None else pick
                host[:, b, i] = torch.tensor([token or 0, L + k, layout.scratch(i), L + k, chosen])
        token, positions, slots, prefix, pick = self.site.to_device(host, self.runner.device).unbind(0)
        flat = cands.reshape(-1)  # [N * C]
        ids = token if flat.numel() == 0 else torch.where(pick >= 0, flat[pick.clamp(min=0)], token)
        return ids, positions, slots, prefix

    def _cache_branches(self, branches, bonuses, step_tokens, logits, step_q) -> None:
        """Store every branch's bonus, drafted tokens, logits ([B, W, depth, V]) and q in
        the speculation cache, read in one host transfer. A branch whose key (row, k,
        bonus) an earlier branch of the round holds (a suffix seed among the draft's
        candidates) is dropped: the first wins."""
        if not step_tokens:
            return
        read = self.site.read(torch.stack([bonuses, *step_tokens], dim=-1))  # [B, W, 1 + depth]: one transfer
        qs = torch.stack(step_q, dim=2) if step_q else None  # [B, W, depth, V]
        for b, todo in enumerate(branches):
            for i, (k, _, _) in enumerate(todo):
                c, *tokens = read[b][i]
                if self.cache.get(b, k, c) is not None:
                    continue
                self.cache.put(
                    Branch(
                        row=b,
                        n_accepted=k,
                        bonus=c,
                        tokens=tuple(tokens),
                        logits=logits[b, i],
                        q=None if qs is None else qs[b, i],
                        slot_start=self.layout.scratch(i),
                    )
                )

    # ------------------------------------------------------------- resolve
    def resolve(self, outcome: OutcomeMsg) -> Served:
        """Apply the target's verdict; serve the next proposal from cache or backup."""
        hits = [False] * len(self.rows)
        missed: list[int] = []
        for b, r in enumerate(self.rows):
            if not outcome.active[b]:
                r.active = False
                r.proposal, r.q, r.pred = [], None, {}
                continue
            n, bonus = outcome.n_accepted[b], outcome.bonus[b]
            planner = self.plan_hit if r.from_hit else self.plan_miss
            planner.observe_acceptance(len(r.proposal), n)
            old_len = len(r.seq)
            r.seq = r.seq + list(outcome.appended[b])
            if self.suffix is not None:
                self.suffix.own[b].extend(outcome.appended[b])
            branch = self.cache.get(b, n, bonus)
            if branch is not None and list(outcome.appended[b]) == r.proposal[:n] + [bonus]:
                self._take_branch(b, branch, old_len + n)
                hits[b] = True
            else:
                missed.append(b)
                r.pred = {}
                self.runner.sync(b, r.seq)
        backup = None
        if missed:
            backup = outcome.backup
            self._backup(missed, backup)
        return self._served(hits, backup)

    def _take_branch(self, b: int, branch: Branch, bonus_index: int) -> None:
        r = self.rows[b]
        depth = len(branch.tokens)
        src = [branch.slot_start + j for j in range(depth)]  # holds bonus, e_1..e_{depth-1}
        self.runner.take_branch(b, src, bonus_index, r.seq[bonus_index:] + list(branch.tokens[:-1]))
        r.proposal = list(branch.tokens)
        r.q = branch.q
        r.pred = {len(r.seq) + j: branch.logits[j] for j in range(depth)}
        r.from_hit = True

    def _backup(self, missed: list[int], backup: Backup) -> None:
        if backup is Backup.JIT:
            self.draft_jit(missed)
            return
        for b in missed:
            r = self.rows[b]
            if backup is Backup.SUFFIX and self.suffix is not None:
                r.proposal = self.suffix.propose(b, r.seq, self.k)
            else:
                r.proposal = propose_ngram(r.seq, self.k) if backup is Backup.NGRAM else []
            r.q = None
            if not self.params.greedy and r.proposal:
                r.q = torch.nn.functional.one_hot(
                    self.site.upload(r.proposal, self.runner.device), self.vocab
                ).float()  # [n, V] point mass, on the draft's device
            r.from_hit = False

    def _served(self, hits: list[bool], backup: Backup | None) -> Served:
        tokens = [list(r.proposal) if r.active else [] for r in self.rows]
        q = None
        if not self.params.greedy:
            q = torch.zeros(len(self.rows), self.k, self.vocab, device=self.runner.device)  # [B, K, V]
            for b, r in enumerate(self.rows):
                if r.active and r.q is not None:
                    q[b, : len(r.proposal)] = r.q
        return Served(tokens, q, hits, backup)

    def first(self, firsts: tuple[int, ...] | None = None) -> Served:
        """Round 0: every row drafts just-in-time (nothing was pre-speculated yet).
        `firsts`: each row's first token, when the batch started from its prompts alone."""
        if firsts is not None:
            for b, (row, token) in enumerate(zip(self.rows, firsts)):
                row.seq.append(token)
                if self.suffix is not None:
                    self.suffix.own[b].extend([token])
        self.draft_jit([b for b, r in enumerate(self.rows) if r.active])
        return self._served([False] * len(self.rows), None)
