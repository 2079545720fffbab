"""What a step measured, into the adaptive controller's cost lines and averages: the recording half
of controller.TreeController, whose fields these methods update (docs/architecture.md, "Adaptive
speculation"). The choosing half, and the fields, are in controller.py."""

from __future__ import annotations

from typing import Optional

from specextend.ladder import Rung
from specextend.timing import seconds_of

# a tree size's own price (TreeController.rows_price): the newest verification's weight in its residual,
# and the verifications of that size measured before the residual prices it (forward_seconds)
ROW_ALPHA, ROW_MIN = 0.3, 2
PROBE_RETRIES = 1  # a probe that met an unready answer asks once more before it counts as done
SWITCH_ALPHA = 0.1  # with overlap, the newest step's weight in the ready share and the switch's averages
#                     (runs of unready answers come in clusters: a faster average leaves trees that pay)


class Recording:
    """TreeController's record_* methods (a mixin: the state is the controller's dataclass fields)."""

    def record_forward(self, rows: int, seconds) -> None:
        """A target forward that carried this session's call: all its `rows` (every session's, when
        shared) and its duration, in seconds or as a timing.Span (on a GPU, the device's time,
        read once the step has read the forward's output: `_settle`)."""
        self._pending.append((rows, seconds, self.forward))

    def record_prefill(self, rows: int, seconds) -> None:
        """A forward of the session's prefill: into the prefill's own line, which prices the steps
        only until their forwards tell a line of their own (the slope especially: on an H200 the 8B
        geometry's 100-row tail chunk after a prefix-cache hit took 27-36 ms eagerly against 5.3 ms
        for a 5-row verify and 6.2 ms for 33 rows, and as a point of the steps' line it set a slope
        of 0.26 ms a row that kept every tree at 4 nodes, 2026-11-29)."""
        self._pending.append((rows, seconds, self.prefill))

    def _settle(self, treeless: bool = False, lines: bool = True) -> None:
        """The recorded forwards' durations into their cost lines (and the step's forward time);
        `treeless`: a step without a tree's, into the chain steps' line too (`chains`); not `lines`:
        the step's forward time only (forwards that shared the device with a draft's open)."""
        for rows, span, line in self._pending:
            seconds = seconds_of(span)
            if lines and line is self.forward and not treeless and self.sessions <= 1:
                self._price_rows(rows, seconds)  # (before the line learns the point: its clip's reference)
            if lines:
                line.add(rows, seconds)
            if lines and treeless and line is self.forward:
                self.chains.add(rows, seconds)
            self._forward_s += seconds
            self._rows += rows
        self._pending.clear()

    def _price_rows(self, rows: int, seconds: float) -> None:
        """A verification forward of `rows` alone into that row count's residual over the line
        (rows_price), once the line has points, a one-off clipped as the line clips it."""
        if not self.forward.known:
            return
        price = self.rows_price.setdefault(rows, [None, 0])
        residual = self.forward.clipped(rows, seconds) - self.forward(rows)
        price[0], price[1] = self._average(price[0], residual, ROW_ALPHA), price[1] + 1

    def _average(self, old: Optional[float], new: float, alpha: Optional[float] = None) -> float:
        a = self.alpha if alpha is None else alpha
        return new if old is None else (1 - a) * old + a * new

    @property
    def _ready_alpha(self) -> float:
        return SWITCH_ALPHA if self.overlap else self.alpha

    def record_plain(self, step_s: Optional[float] = None, lookup: int = 0, contended: bool = False) -> None:
        """A plain step; `step_s`: its wall time, when the driver measured it; `lookup`: the tokens a
        context-lookup chain added to it; `contended`: its forward shared the device with the draft's
        open (a prefill beside it), so its time prices nothing (the tiny pair on a CPU: open steps'
        forwards took 0.8-2 ms against 0.7 alone, and as plain_forward's readings, carried from
        request to request, they priced plain steps at 1.1-1.7 ms, so that trees that could never
        pay looked close enough to probe every few hundred steps; 2026-11-30)."""
        self._settle(treeless=True, lines=not contended)
        self._measuring_top = False
        self.lookup_plain = (1 - self.alpha) * self.lookup_plain + self.alpha * lookup
        if step_s is not None:
            self.extra_plain = self._average(self.extra_plain, max(step_s - self._forward_s, 0.0))
        recheck = self.recheck.plain_step()  # (a recheck's reading replaces the one it rechecks)
        if self._forward_s and self.sessions <= 1 and not contended:  # (a chain's rows beyond the first: the slope)
            one = self._forward_s - self.chains.line()[1] * max(self._rows - 1, 0)  # (chain_now prices them)
            if one > 0 or self._rows <= 1:  # (else the slope says the rows beyond the first cost more than the
                # whole forward took: a line a one-off set, which this reading cannot split; it prices nothing)
                self.plain_forward = self._average(self.plain_forward, max(one, 0.0), 1.0 if recheck else None)
        self._end_step()
        self.plain_steps += 1
        self.since_probe += 1
        self.in_run = self.asking = False
        if recheck:
            self.recheck.after(self)

    def record_plain_run(self, n: int, step_s: Optional[float] = None) -> None:
        """`n` plain steps of a run ahead (plain_ahead.plain_run_co), counted as `n` record_plain()
        calls count them (their twin, tested), priced by one reading: `step_s`, a step of the run's
        whole cost (forward and host together; None: unpriced). One call a run, not a
        token: on a CPU the tiny pair's run tokens cost ~8 us of bookkeeping each (0.7 ms steps)."""
        if n <= 0:
            return
        if step_s is not None:
            self.record_forward(1, step_s)
        self.record_plain(step_s=step_s)
        k = n - 1  # (the rest: no chain, no reading)
        self.lookup_plain *= (1 - self.alpha) ** k
        self.plain_steps += k
        self.since_probe += k

    def record_spec(self, rung: Rung, draft_s: Optional[float], accepts: dict, step_s: Optional[float] = None,
                    lookup: Optional[int] = 0, catchup: Optional[tuple[int, float]] = None) -> None:
        """A speculative step of `rung`: the wait for its tree (None when the draft first caught up
        on plain steps' tokens: a one-off of switching, not what a speculative step costs),
        prefix_accepts' counts, and the step's wall time when the driver measured it (the first
        speculative step's is not used: it carries one-off costs); `lookup`: the accepted tokens
        that only a context-lookup chain proposed (None: the step had no chain to graft, which
        leaves their average, the tree steps' with a chain, as it was); `catchup`: (tokens, wait) of a
        tree whose draft first forwarded the tokens of steps without a tree (its `draft_s` None): the
        wait beyond the levels' line, into the catch-up's."""
        if catchup is not None and self.draft.known:
            tokens, wait = catchup
            self.catchup.add(tokens, max(wait - self.draft_seconds(rung.depth), 0.0))
        self._settle()
        self.asking = True
        if self.overlap and not self.in_run:  # a run's first tree: its own averages, not the run's
            self._switched(1.0 + accepts.get(rung, 0) + (lookup or 0), step_s, began=True)
            self.spec_steps += 1
            self.since_probe += 1
            self.in_run = True  # (a probe goes on: its next tree measures the run)
            return
        if lookup is not None:
            self.lookup_spec = (1 - self.alpha) * self.lookup_spec + self.alpha * lookup
        if draft_s is not None:
            self.draft.add(rung.depth, draft_s)
            if step_s is not None and self.spec_steps:
                self.extra_spec = self._average(self.extra_spec, max(step_s - self._forward_s - draft_s, 0.0))
        self._end_step()
        now = self.spec_steps + self.plain_steps
        for r, n in accepts.items():
            old = self.accepted.get(r, 0.0)
            w = 1 - (1 - self.alpha) ** (now - self.measured_at.get(r, -10**6))  # 1 when never measured
            self.accepted[r], self.measured_at[r] = (1 - w) * old + w * n, now
        self.ready = self._average(self.ready, 1.0, self._ready_alpha)
        self.spec_steps += 1
        self.since_probe += 1
        if self._measuring_top and rung == self.top and not self._probing:  # a warm-up's full tree, verified:
            # it measured what a probe of the top measures (a primed session's first tree, carrying the
            # last session's count, could be followed by a probe a few steps later; docs/architecture.md,
            # "Adaptive speculation")
            self.since_probe = 0
        self._measuring_top = False
        self.recheck.tree_step()
        self.in_run, self.steady = True, self.steady or self.overlap
        if self._probing:
            self._end_probe(rung)

    def record_unready(self, rung: Rung, draft_s: Optional[float], step_s: Optional[float] = None,
                       lookup: int = 0) -> None:
        """A step that asked for a tree of `rung` and got none (an overlapping draft with nothing
        ready; the step decoded plainly, `lookup` tokens from a chain): the ready share falls; the
        acceptance averages stay (nothing was verified: an empty answer says nothing about how much
        of a tree the target would take). A probe that met one asks again on the next step, once."""
        self._settle(treeless=True)  # (it decoded plainly)
        self._measuring_top = False
        self.asking = True
        if self.overlap and not self.in_run:  # a run's first ask, which began none: the switch's cost
            self._switched(1.0 + lookup, step_s, began=False)
        else:
            self.ready = self._average(self.ready, 0.0, self._ready_alpha)
            self.lookup_plain = (1 - self.alpha) * self.lookup_plain + self.alpha * lookup
            if draft_s is not None:
                self.draft.add(rung.depth, draft_s)
            if step_s is not None:
                self.extra_plain = self._average(self.extra_plain,
                                                 max(step_s - self._forward_s - (draft_s or 0.0), 0.0))
            self._end_step()
        self.in_run = False
        self.unready_steps += 1
        self.since_probe += 1
        self.recheck.tree_step()
        if self._probing:
            self._probe_misses += 1
            if self._probe_misses > PROBE_RETRIES:
                self._end_probe(rung)

    def _switched(self, tokens: float, step_s: Optional[float], began: bool) -> None:
        """(overlap) A run's first ask: its tokens and wall seconds into the switch's averages (a step
        without its wall time, its forwards), and whether a tree came (the run `began`) into the
        misses in a row."""
        seconds = step_s if step_s is not None else self._forward_s
        self.switch_misses = 0 if began else self.switch_misses + 1
        self.switch_tokens = self._average(self.switch_tokens, tokens, SWITCH_ALPHA)
        self.switch_s = self._average(self.switch_s, seconds, SWITCH_ALPHA)
        self._end_step()

    def _end_probe(self, rung: Rung) -> None:
        self._probing, self._probe_misses = False, 0
        self.probe_steps += 1
        self.since_probe = 0
        # a probe that found a larger rung best, where a rung larger than its own is left unmeasured,
        # is followed by probes worked out anew (a larger tree pays: maybe a larger one still); a
        # probe of the top rung measured every rung at once, so it doubles whatever it found. Two
        # rungs a hair apart (4 and 8 nodes 3 deep, acceptance replayed at 3 on the 8B geometry:
        # one node's cost against a miss now and then) trade places after many probes, and each
        # trade reset the schedule to a probe of the full tree every ~5 steps at ~1.5 steps' cost
        # (H200, 2026-11-30; docs/architecture.md, "Adaptive speculation")
        best = self.best()
        moved_up = self.rungs.index(best) > self.rungs.index(self._best) and rung != self.top
        # a prior-priced probe (the smallest tree) is followed by probes whose interval is worked
        # out anew from the costs just measured, not doubled from its own
        again = moved_up or self._probe_by_prior
        if again:
            self.probe_every = 0
        else:  # doubled, and never below what the costs now give (interval: what a probe could win);
            # the schedule set early, while a context lookup's runs were still learning their yield,
            # kept doubling from 8 steps after no tree could beat them (the real pair at 16K: five
            # probes of ~11 ms in 256 tokens against 2 ms steps; H200, 2026-12-01); within the cap
            # in seconds (costs.probe_cap), so that doubling never outlasts costs that changed since
            self.probe_every = self.interval(best, self._probe_rung(best), at_least=2 * self.probe_every)
