"""One request's measurements (engine.py fills them; responses, /metrics and benchmarks read them)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

# an early ask's way (docs/architecture.md, "Pool snapshots", early asks): from the engine's submit
# to a call thread's start (sent), the call's round trip (call), of which the draft side's time
# (draft: queued for its thread, waiting for a forward in flight), the engine's own work before
# it waited (overlap), from the call's end to the engine reading its answer (back), and the engine's
# wait (wait; the response's ask_ms also has its 90th percentile, wait_p90)
ASK_PARTS = ("sent", "call", "draft", "queued", "flight", "overlap", "back", "wait")


class PhaseClock:
    """Splits one step's wall time into named phases (`clock(name)` ends the phase running since
    the last mark), added to a kind of step's sums (RequestStats.phases; docs/architecture.md,
    "Overlapped drafting")."""

    __slots__ = ("_sums", "_t")

    def __init__(self, sums: dict, t0: float) -> None:
        self._sums, self._t = sums, t0

    def __call__(self, name: str) -> float:
        """-> the mark's time (perf_counter): a step that ends here reads its wall time from it,
        so that its phases add up to it (read twice, a pause between the reads, a collection say,
        once left 1.7% of a tiny pair's tree steps outside every phase in a CI run)."""
        now = time.perf_counter()
        self._sums[name] = self._sums.get(name, 0.0) + (now - self._t)
        self._t = now
        return now

    def add(self, name: str, seconds: float) -> None:
        """A phase timed elsewhere (the clock's next phase starts where it ended)."""
        self._sums[name] = self._sums.get(name, 0.0) + seconds
        self._t += seconds


@dataclass
class RequestStats:
    num_steps: int = 0  # verification steps
    accepted_per_step: list[int] = field(default_factory=list)  # accepted draft tokens per step
    nodes_per_step: list[int] = field(default_factory=list)  # draft nodes verified per step
    wait_per_step: list[float] = field(default_factory=list)  # seconds the target waited for each tree
    server_per_step: list[float] = field(default_factory=list)  # of which on the draft side (DraftTree.server_s; 0: not measured)
    queued_per_step: list[float] = field(default_factory=list)  # of which waiting for the draft's thread
    ready_per_step: list[bool] = field(default_factory=list)  # each tree came from the overlap pool
    refresh_per_step: list[bool] = field(default_factory=list)  # each draft step received a retrieval
    context_per_step: list[int] = field(default_factory=list)  # committed context at each step
    draft_tokens: int = 0  # draft tokens proposed in total
    retrieval_refreshes: int = 0
    draft_cache_tokens: int = 0
    plain_steps: int = 0  # plain decoding steps the adaptive policy chose while a draft was available
    probe_steps: int = 0  # steps with the largest tree the adaptive policy took to re-measure it
    unready_steps: int = 0  # plain steps because the overlapping draft had no tree ready (overlap_miss=plain)
    unready_wait_s: float = 0.0  # the target's wait for those empty answers
    # (wait, draft side, queued) of each unready step: with the trees' (above), the split of every asked step
    unready_split: list[tuple[float, float, float]] = field(default_factory=list)
    unready_refreshes: int = 0  # retrieval selections those steps delivered to the draft
    lookup_steps: int = 0  # steps without a draft tree that verified a context-lookup chain instead
    lookup_skipped: int = 0  # ... and those with a chain found that the lookup gate left out (RequestLookup.skipped)
    open_steps: int = 0  # plain steps decoded while the draft still prefilled (adaptive policy: it joins when done)
    told_steps: int = 0  # plain steps whose tokens went to an overlapping draft at once (draft_link.TELL_BOUND)
    ahead_steps: int = 0  # steps decoded ahead of the host: plain steps ahead and lookup runs' steps
    asked_steps: int = 0  # tree steps whose tree was asked for at the verdict before (draft_ask_early)
    snapshot_trees: int = 0  # tree steps whose tree came from the draft's latest snapshot (draft_snapshots)
    lookup_nodes: int = 0  # nodes that context-lookup chains added to the trees verified
    lookup_accepted: int = 0  # accepted tokens that only a lookup chain proposed
    ahead_depth_sum: int = 0  # sum over steps of the ready pool's depth below the new root
    prepared_per_step: list[bool] = field(default_factory=list)  # each tree came with a prepare (no step call)
    fallback: bool = False
    replayed: bool = False
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of which the prefix cache held (their K/V copied, not forwarded)
    num_generated: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_open_s: float = 0.0  # the draft's open (its prefill, transport included) as the target timed it
    target_prefill_s: float = 0.0  # the target's prefill of the same prompt, beside it (0: no draft joined)
    max_step_s: float = 0.0  # the longest decode step (wall): a stall shows here, not in the means
    # per kind of decode step ("tree", "plain", "lookup": a plain step that verified a lookup chain,
    # "unready", "open": before the draft joined): [steps, tokens emitted, seconds of wall time, of
    # which waiting for the draft, seconds of the target's forwards]
    step_kinds: dict = field(default_factory=dict)
    # what the policy expected: "tree"/"plain" -> [sum of the chosen rungs' predicted tokens/s, steps]
    predicted: dict = field(default_factory=dict)
    priced: dict = field(default_factory=dict)  # the policy's prices at the request's end (Carrying.priced)
    # an early ask's way, per asked step: ASK_PARTS, seconds (ask_done)
    ask_split: list = field(default_factory=list)
    # a kind of step's wall time by phase (PhaseClock): kind -> {phase: seconds, summed over its steps}
    phases: dict = field(default_factory=dict)
    between_s: float = 0.0  # wall time between a step's event and the next step's start (the caller's, the policy's)
    # benchmarks' reference tokens (verify.Reference): the target's top-two gap wherever the reference
    # overrode its choice (None: no reference)
    reference_gaps: Optional[list] = None
    reference_steps: Optional[list] = None  # the rounding step at each of those places (verify.rounding_step)
    reference_positions: Optional[list] = None  # the output position of each (verify.Reference.positions)
    reference_chosen: Optional[list] = None  # the target's own token at each (verify.Reference.chosen)
    draft_s: float = 0.0  # time in DraftBackend.step for the trees verified (includes RPC when remote)
    verify_s: float = 0.0
    retrieval_s: float = 0.0  # target side: scoring and selecting chunks (docs/architecture.md, "Cross-model retrieval")

    def keep_reference(self, ref) -> None:
        """The override lists of `ref` (verify.Reference, or None), filled as the request runs."""
        if ref is not None:
            self.reference_gaps, self.reference_steps = ref.gaps, ref.steps
            self.reference_positions, self.reference_chosen = ref.positions, ref.chosen

    def ask_done(self, call, waited_from: float, tree) -> None:
        """A tree step's answer to an early ask (`call`: the lane's future, its times set by
        draft_link.Lane) read after the engine waited from `waited_from` (perf_counter)."""
        now = time.perf_counter()
        sub, start, end = (getattr(call, k, now) for k in ("submitted", "started", "ended"))
        self.asked_steps += 1
        self.ask_split.append((start - sub, end - start, tree.server_s, tree.queued_s, tree.flight_s,
                               waited_from - sub, now - end, now - waited_from))

    def clock(self, kind: str, t0: float) -> PhaseClock:
        """A PhaseClock for one step of `kind` that started at `t0` (perf_counter)."""
        return PhaseClock(self.phases.setdefault(kind, {}), t0)

    @property
    def phase_ms(self) -> dict:
        """Mean ms per step of each kind's phases, and `between` steps (per step of any kind)."""
        out = {k: {p: 1e3 * s / max(self.step_kinds.get(k, [1])[0], 1) for p, s in ph.items()}
               for k, ph in self.phases.items()}
        steps = sum(v[0] for v in self.step_kinds.values())
        if steps:
            out["between"] = {"ms": 1e3 * self.between_s / steps}
        return out

    @property
    def ask_ms(self) -> dict:
        """The asked steps' mean ASK_PARTS, milliseconds."""
        n = len(self.ask_split)
        if not n:
            return {}
        out = {k: 1e3 * sum(s[i] for s in self.ask_split) / n for i, k in enumerate(ASK_PARTS)}
        waits = sorted(s[-1] for s in self.ask_split)
        out["wait_p90"] = 1e3 * waits[min(n - 1, int(0.9 * n))]
        return out

    @property
    def reference_summary(self) -> dict:
        """With reference tokens: {reference_overrides, reference_max_gap} (the tokens they overrode,
        the largest top-two gap where they did), the largest gap in rounding steps, and with positions
        each override as [position, gap, gap in steps, the target's token] (`reference_override_at`: the
        benchmarks settle those beyond one step by the target's float32 logits and rounding noise
        there, near_tie.settle_overrides); {}
        without."""
        gaps, steps = self.reference_gaps, self.reference_steps
        if gaps is None:
            return {}
        out = dict(reference_overrides=len(gaps), reference_max_gap=max(gaps, default=0.0))
        if steps is not None:  # (without them no gap is measured in steps: none passes by steps)
            out["reference_max_gap_steps"] = max((g / s for g, s in zip(gaps, steps)), default=0.0)
        if self.reference_positions is not None:
            chosen = self.reference_chosen or [None] * len(gaps)
            out["reference_override_at"] = [[p, g, None if steps is None else g / steps[i], c]
                                            for i, (p, g, c) in enumerate(zip(self.reference_positions, gaps, chosen))]
        return out

    @property
    def predicted_tok_per_s(self) -> dict:
        """The policy's mean predicted tokens/s of the tree steps and the plain steps it chose."""
        return {k: s / n for k, (s, n) in self.predicted.items() if n}

    def tree_step(self, accepted: int, context: int, drafted: int, nodes: int, tree, wait_s: float,
                  prepared: bool, refreshed: bool) -> None:
        """A verified tree: `accepted` nodes of its `nodes` (`drafted` of them the draft's, the rest a
        lookup chain's) at `context` committed tokens; `tree` the draft's answer (DraftTree), waited
        for `wait_s`; `prepared`: taken from prepared outcomes; `refreshed`: its call carried a
        retrieval selection."""
        self.num_steps += 1
        self.accepted_per_step.append(accepted)
        self.context_per_step.append(context)
        self.draft_tokens += drafted
        self.nodes_per_step.append(nodes)
        self.draft_cache_tokens = tree.draft_cache_tokens
        self.wait_per_step.append(wait_s)
        self.server_per_step.append(tree.server_s)
        self.queued_per_step.append(tree.queued_s)
        self.ready_per_step.append(bool(tree.ready))
        self.prepared_per_step.append(prepared)
        self.refresh_per_step.append(refreshed)
        self.ahead_depth_sum += tree.ahead_depth

    def step_read(self, kind: str, tokens: int, t_step: float, t_read: float, t1: float) -> float:
        """A step run ahead of the host (plain_ahead.py, lookup_ahead.py) that began at `t_step` and
        read its token at `t_read`: its phases ("step" to the read, "books" after: the emit) and its
        wall time end at one clock reading, so that they add up; `t1`: the decode's start. -> that reading."""
        clock = self.clock(kind, t_step)
        clock.add("step", t_read - t_step)
        end = clock("books")
        self.decode_s = end - t1
        self.step_done(kind, tokens, end - t_step)
        return end

    def step_done(self, kind: str, tokens: int, seconds: float, wait_s: float = 0.0, forward_s: float = 0.0) -> None:
        """One decode step of `kind` ended: it emitted `tokens` in `seconds` of wall time, of which
        `wait_s` waiting for the draft's answer; its target forwards took `forward_s` (the device's
        time, CUDA events; 0: not timed). The rest is the host's work on the step."""
        k = self.step_kinds.setdefault(kind, [0, 0, 0.0, 0.0, 0.0])
        k[0], k[1], k[2], k[3], k[4] = k[0] + 1, k[1] + tokens, k[2] + seconds, k[3] + wait_s, k[4] + forward_s
        self.max_step_s = max(self.max_step_s, seconds)

    @property
    def mean_acceptance_length(self) -> float:
        """Accepted draft tokens + 1 bonus per step (vLLM's convention); 1.0 for plain decoding."""
        if not self.num_steps:
            return 1.0
        return (sum(self.accepted_per_step) + self.num_steps) / self.num_steps

    @property
    def mean_tree_nodes(self) -> float:
        """Draft nodes verified per speculative step (the trees the policy chose)."""
        return self.draft_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def target_wait_ms_per_step(self) -> float:
        """Time the target waited for a tree, per step that asked for one (the draft call, transport
        included; an unready step's wait for its empty answer too)."""
        asked = self.num_steps + self.unready_steps
        return 1e3 * (self.draft_s + self.unready_wait_s) / asked if asked else 0.0

    def _measured(self) -> list[tuple[float, float, float]]:
        """(wait, draft side, queued) of the steps that asked for a tree (verified or unready, as
        target_wait_ms_per_step counts them) whose draft reported its own time."""
        trees = zip(self.wait_per_step, self.server_per_step, self.queued_per_step)
        return [t for t in [*trees, *self.unready_split] if t[1] > 0]

    @property
    def transport_s(self) -> float:
        """The target's wait beyond the draft side's own time (DraftTree.server_s), summed over the
        steps that reported it: the round trip between target and draft (serialisation, sockets,
        waking the threads at both ends); about 0 in process (docs/architecture.md, "Wire protocol")."""
        return sum(max(0.0, w - d) for w, d, _ in self._measured())

    @property
    def draft_queue_s(self) -> float:
        """Time the steps waited for the draft's thread (behind a background launch or another job)."""
        return sum(q for _, _, q in self._measured())

    @property
    def transport_ms_per_step(self) -> float:
        n = len(self._measured())
        return 1e3 * self.transport_s / n if n else 0.0

    @property
    def draft_queue_ms_per_step(self) -> float:
        n = len(self._measured())
        return 1e3 * self.draft_queue_s / n if n else 0.0

    @property
    def prepared_steps(self) -> int:
        """Trees taken from a prepare's outcomes (docs/architecture.md, "Prepared outcomes")."""
        return sum(self.prepared_per_step)

    @property
    def ready_steps(self) -> int:
        """Trees the draft had ready when asked (overlapped drafting)."""
        return sum(self.ready_per_step)

    @property
    def tree_ready_fraction(self) -> float:
        """Of the steps that asked the draft for a tree, those it had ready."""
        asked = self.num_steps + self.unready_steps
        return self.ready_steps / asked if asked else 0.0

    @property
    def draft_ahead_depth(self) -> float:
        return self.ahead_depth_sum / self.num_steps if self.num_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        total = self.prefill_s + self.decode_s
        return self.num_generated / total if total > 0 else 0.0

    def summary(self) -> dict:
        return dict(num_generated=self.num_generated, mean_acceptance_length=self.mean_acceptance_length,
                    num_steps=self.num_steps, prefill_s=self.prefill_s, decode_s=self.decode_s,
                    tokens_per_s=self.tokens_per_s, retrieval_refreshes=self.retrieval_refreshes,
                    draft_cache_tokens=self.draft_cache_tokens,
                    target_wait_ms_per_step=self.target_wait_ms_per_step, plain_steps=self.plain_steps,
                    unready_steps=self.unready_steps, lookup_steps=self.lookup_steps, told_steps=self.told_steps, asked_steps=self.asked_steps,
                    ahead_steps=self.ahead_steps,
                    snapshot_trees=self.snapshot_trees, ask_ms=self.ask_ms, phase_ms=self.phase_ms,
                    open_steps=self.open_steps, max_step_s=self.max_step_s, draft_open_s=self.draft_open_s,
                    target_prefill_s=self.target_prefill_s, step_kinds=self.step_kinds,
                    lookup_nodes=self.lookup_nodes, lookup_accepted=self.lookup_accepted,
                    probe_steps=self.probe_steps, mean_tree_nodes=self.mean_tree_nodes,
                    tree_ready_fraction=self.tree_ready_fraction, draft_ahead_depth=self.draft_ahead_depth,
                    transport_ms_per_step=self.transport_ms_per_step,
                    draft_queue_ms_per_step=self.draft_queue_ms_per_step, prepared_steps=self.prepared_steps,
                    fallback=self.fallback, retrieval_s=self.retrieval_s,
                    replayed=self.replayed, draft_s=self.draft_s, verify_s=self.verify_s)
