"""One decode step of a request (Engine._session's loop, docs/architecture.md, "Layers"): the draft's
join and the step's rung, then a tree step (ask the draft, verify, commit) or a step without a tree
(a plain step, or a run of plain or lookup steps ahead), then its event. `SessionState` is what a
request carries from step to step; the engine's `_session` sets it up (prefill, first token)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable, Optional

from specextend.config import SamplingParams
from specextend.controller import TreeController
from specextend.draft.base import DraftError, DraftTree
from specextend.draft_link import Lane, RunTells, ask_ahead, prepared_tree, send_prepare, settled, start_ask
from specextend.emit import Emitter
from specextend.governor import OPENING, PLAIN, TREES
from specextend.ladder import Rung, prefix_accepts
from specextend.lookup import RequestLookup, drafted_prefix
from specextend.lookup_ahead import run_ahead
from specextend.plain_step import plain_step_co
from specextend.retrieval import launch_scoring
from specextend.session_calls import DraftCall, Load
from specextend.snapshot import DraftFeed
from specextend.stats import RequestStats
from specextend.target import TargetSession
from specextend.verify import Reference, verify_tree


@dataclass(eq=False)
class SessionState:
    """A request's state between its decode steps."""

    sid: str
    params: SamplingParams
    prompt_tokens: int
    stats: RequestStats
    out: Emitter
    gen: Any  # the request's torch.Generator (None: greedy)
    target: TargetSession
    ctl: TreeController
    lane: Lane  # tells and early asks, in order, none waited for by the step that sends it
    load: Load  # where a batching driver tells the session about the forwards it shares
    timed: Callable  # every step's forward into the policy's cost line (session_calls.metered)
    ref: Optional[Reference]  # (benchmarks) the tokens to emit where the target's choice differs
    replay: Optional[list]  # acceptance replay: each step's accepted length, cycled (not lossless)
    draft_bonus: bool  # (replay) the bonus token is the draft's second choice
    use_draft: bool
    open_now: Optional[Callable[[], Future]] = None  # starts the draft's open (a deferred one: when due)
    opening: Optional[Future] = None  # the draft's open (its prefill), None: not started
    opening_pending: bool = False  # started and not joined yet
    target_prefill_s: float = 0.0
    t1: float = 0.0  # the decode's start (after the first token)
    lookup: Optional[RequestLookup] = None  # the request's tokens ("Context lookup")
    feed: Optional[DraftFeed] = None  # with snapshots: the draft's latest answer and the call in flight
    asks: tuple = (False, False)  # (tell, ask_early) where snapshots give way
    tell: bool = False  # an overlapping draft is told each plain step's tokens while the next forward runs
    ask_early: bool = False  # a tree step's verdict goes to the draft once known (ask_ahead)
    prepare: bool = False  # the draft prepares the next trees while the target verifies ("Prepared outcomes")
    ready_only: bool = False  # an overlapping draft's unready step: a plain one instead
    step: int = 0  # the draft's step number
    committed: list = field(default_factory=list)  # the last step's tokens
    pending: list = field(default_factory=list)  # committed tokens the draft has not seen yet (it catches up lazily)
    retrieval: Any = None  # a selection not yet sent to the draft
    refresh_due: int = 1  # the verification (1-based) of the next retrieval selection
    held: bool = False  # plain steps' tokens held back by the lane's backlog, not yet sent
    asked: Optional[Future] = None  # a verdict sent early (ask_early), in the lane: the next tree step's answer
    chosen: Optional[Rung] = None  # the next step's rung, chosen at the step before (ask_ahead)
    prepared: Optional[Future] = None  # the draft's trees for the verdicts of the tree being verified
    ready: Optional[DraftTree] = None  # the next tree, found among them at the verdict (with early asks)
    verify_ema: float = 0.0  # seconds from a prepare's issue to the verdict it prepares for
    late_ema: float = 0.0  # seconds the target then waited for the prepare's answer (due that much sooner)
    late: list = field(default_factory=list)  # (with early asks) how long after their verdicts late answers came
    t_back: Optional[float] = None  # when the last step's event came back (stats.between_s)


class EngineSteps:
    """Engine's decode step (a mixin: the draft link, snapshots and carried costs are the engine's)."""

    def _decode_step_co(self, s: SessionState):
        """One step of `s`: its forwards, draft calls and event (none where the step fell back or ran
        ahead: the loop goes on)."""
        trees_held = s.ctl.governed and s.load.held in (TREES, OPENING)  # (the batch's governor asks for trees: open now)
        # held to plain steps, no tree comes before the hold ends: a deferred open waits for it (on one GPU an
        # open is a draft prefill of the prompt beside the batch's forwards, which it slows)
        if s.use_draft and s.opening is None and not self.held_plain(s.ctl, s.load) and self.open_due(  # (deferred)
                s.ctl, s.prompt_tokens, s.params.max_new_tokens - s.stats.num_generated, now=trees_held):
            s.opening, s.opening_pending, s.load.open_s = s.open_now(), True, 0.0
        if s.opening_pending and s.use_draft and (s.opening.done() or not self.join_early):  # (joins at once)
            s.use_draft = yield from self._join(s.opening, s.ctl, s.target_prefill_s, s.stats, s.sid)
            s.opening_pending = False
            if s.feed is not None and s.use_draft:  # the draft catches up at once
                s.feed.send()
        s.load.opening = s.opening if s.use_draft and s.opening_pending else None  # (the driver's: Batcher.opening)
        if s.feed is not None and s.feed.error is not None:  # a call failed: plain decoding from here
            s.use_draft, s.feed = self._fall_back(s.stats, s.sid, s.feed.error), None
        if s.feed is not None and self.snapshots.gives_up(s.stats):  # early asks from here ("Pool snapshots")
            (s.pending, unsent, s.step, s.asked), s.feed, (s.tell, s.ask_early) = s.feed.handover(), None, s.asks
            s.retrieval = s.retrieval if s.retrieval is not None else unsent
        if s.use_draft and s.chosen is not None:  # (at the step before: ask_ahead)
            rung = s.chosen
        elif s.use_draft and not s.opening_pending and s.opening is not None:
            s.ctl.see_chain(s.lookup, len(s.pending) - len(s.committed))  # (what a step without a tree would verify now)
            held = s.load.held if s.ctl.governed else None  # (the batch's governor: governor.py)
            if held is None:
                rung = s.ctl.choose_noted(s.load.sessions)
            elif held in (PLAIN, OPENING):
                rung = s.ctl.plain_unchosen()
            else:  # (TREES)
                rung = s.ctl.tree_unchosen(s.load.sessions)
        else:
            rung = s.ctl.plain_unchosen()
        s.chosen = None
        t_step = time.perf_counter()  # the step's wall time teaches the controller its host work
        if s.t_back is not None:
            s.stats.between_s += t_step - s.t_back
        if not rung.plain:
            done = yield from self._tree_step_co(s, rung, t_step)
        else:
            done = yield from self._plain_step_co(s, t_step)
        if done is None:
            return
        kind, split, clock = done
        ev = s.out.emit(s.committed)
        end = clock("books")  # (the stats, the policy's record, the emit; the step's end)
        s.stats.decode_s = end - s.t1
        s.stats.step_done(kind, len(ev.token_ids), end - t_step, *split)
        yield ev
        s.t_back = time.perf_counter()

    def _tree_step_co(self, s: SessionState, rung: Rung, t_step: float):
        """A step with a tree: the draft's answer (walked from a snapshot, asked early, prepared, or
        asked now), grafted lookup chains, the verify, the commit, the next selection. -> (kind,
        split, clock) for the step's event, or None where it emitted its own (unready) or fell back."""
        try:
            ts = time.perf_counter()
            tree, applied = None, True  # applied: this step's call carries the verdict
            from_ask = s.asked is not None  # (then the lane's last call)
            if not from_ask and s.feed is None:  # this step's call goes after the lane's (the
                yield from settled(s.lane.tail)  # feed's own call in flight there is not waited for)
            if s.feed is not None:  # the latest snapshot, walked to here: no call
                tree = yield from s.feed.tree_co(s.step, rung.nodes, s.stats)
            elif from_ask:  # asked at the last verdict (its step number taken then)
                tree = yield DraftCall(future=s.asked)
                s.stats.ask_done(s.asked, ts, tree)  # (its way's times)
                s.asked = None
            elif s.ready is not None:  # prepared for the last verdict: no call (it goes with the next)
                tree, s.ready, applied = s.ready, None, False
            elif s.prepared is not None:  # (without early asks: read here, waited for)
                outs, s.prepared = (yield DraftCall(future=s.prepared)), None
                s.late_ema = 0.7 * s.late_ema + 0.3 * (time.perf_counter() - ts)
                tree = outs.get(s.pending) if outs.step == s.step else None
                applied = tree is None
            caught_up = (behind := len(s.pending) - len(s.committed)) > 0  # it forwards plain steps' tokens too
            if tree is None:  # ready_only only where the draft's pool can hold this verdict: not
                # the first step, nor after plain steps (the draft was not told about them)
                # (ready from the pool still, where only the lane's backlog held them back)
                bound = replace(rung.bound, ready_only=s.ready_only and s.step > 0 and (s.held or not caught_up))
                s.held = False
                launch_scoring(s.retrieval)  # (here: the call may run on another thread)
                tree = yield DraftCall(fn=partial(self.draft.step, s.sid, s.step, s.pending, s.retrieval, bound))
            draft_s = time.perf_counter() - ts
            refreshed = s.retrieval is not None
        except DraftError as e:
            s.use_draft, s.feed = self._fall_back(s.stats, s.sid, e), None
            return None
        if not tree.tokens:  # nothing ready (the draft applied the step and catches up): one
            # plain token now; to the policy an unready step (its ready share falls)
            s.stats.unready_steps += 1
            s.stats.unready_wait_s += draft_s
            s.stats.unready_split.append((draft_s, tree.server_s, tree.queued_s))
            s.stats.unready_refreshes += s.retrieval is not None and not from_ask and s.feed is None  # (its call)
            s.committed = s.pending = yield from plain_step_co(s.target, s.committed[-1], s.params, s.gen, s.timed,
                                                            s.lookup, s.stats, reference=s.ref)
            s.step, s.retrieval = s.step + (not from_ask), (s.retrieval if from_ask or s.feed is not None else None)
            if s.feed is not None:  # (with a selection held since the last verdict)
                s.feed.push(s.committed, s.retrieval)
                s.pending, s.retrieval = [], None
            s.ctl.record_unready(rung, draft_s - s.load.take_shared(), step_s=s.load.wall(t_step),
                               lookup=len(s.committed) - 1)
            if s.ask_early and not s.out.ends(s.committed):  # the next step chosen now: a tree's ask goes
                s.chosen, s.asked, s.step, s.pending, s.retrieval = ask_ahead(
                    self.draft, s.lane, s.ctl, s.lookup, s.load.sessions, s.sid, s.step, s.pending, s.retrieval)
            s.stats.probe_steps = s.ctl.probe_steps
            s.stats.decode_s = time.perf_counter() - s.t1
            ev = s.out.emit(s.committed)
            s.stats.step_done("unready", len(ev.token_ids), time.perf_counter() - t_step, draft_s,
                            s.ctl.last_forward_s)
            yield ev
            s.t_back = time.perf_counter()
            return None
        s.stats.draft_s += draft_s
        clock = s.stats.clock("tree", t_step)  # where the step's time goes (stats.phase_ms)
        clock("wait")
        # best first: a prefix is the best smaller tree (a draft that ignores the bound may send more)
        tokens, parents = tree.tokens[:rung.nodes], tree.parents[:rung.nodes]  # [N], [N]
        drafted = len(tokens)  # the draft's nodes; a lookup chain's new ones follow them
        if s.lookup is not None:
            tokens, parents, grafted = s.lookup.graft(tokens, parents)
            s.stats.lookup_nodes += grafted
        ts = time.perf_counter()
        # every `every` verifications (not step numbers, which tells, asks and unready steps advance)
        refresh = self.config.retrieval.enabled and s.stats.num_steps + 1 >= s.refresh_due
        s.refresh_due = s.stats.num_steps + 1 + self.config.retrieval.every if refresh else s.refresh_due
        scored = refresh and self.config.retrieval.select == "attention"
        clock("graft")
        logits = yield from s.timed(s.target.verify_co(s.committed[-1], tokens, parents, capture=scored))
        clock("verify")  # (queued: from here the device runs it)
        launch_scoring(s.retrieval)  # a selection not yet scored: in this forward's shadow
        clock("scoring")
        if s.prepare and s.use_draft:  # queued: the draft prepares the next trees while it runs
            t_prep = time.perf_counter()
            s.prepared, s.late_ema = send_prepare(self.draft, s.lane if s.ask_early else None, s.sid, s.step,
                                              () if applied else s.pending, None if applied else s.retrieval,
                                              s.verify_ema, s.late_ema, s.late)
        forced = s.replay[s.step % len(s.replay)] if s.replay else None
        verdict = verify_tree(logits, tokens, parents, s.params, s.gen, forced, s.draft_bonus, s.ref,
                              s.stats.num_generated)
        clock("verdict")
        if s.prepared is not None:
            dt = time.perf_counter() - t_prep
            s.verify_ema = dt if not s.verify_ema else 0.7 * s.verify_ema + 0.3 * dt
        s.committed = s.pending = verdict.tokens
        s.step += not from_ask
        if s.ask_early and s.use_draft and not s.out.ends(s.committed):  # at once, before the commit and
            # the retrieval scoring (a selection made below goes with the next call; its error: the next step's)
            s.ready, s.prepared = prepared_tree(s.prepared, s.committed, s.step, s.late), None  # (a hit: no ask)
            if s.ready is None:
                s.asked = start_ask(self.draft, s.lane, s.sid, s.step, s.pending, s.retrieval if from_ask else None,
                                  replace(s.ctl.top.bound, ready_only=True))  # (else this step's call had it)
                s.step, s.retrieval, s.pending = s.step + 1, None, []
        clock("ask")
        s.target.commit(verdict.accepted)
        clock("commit")
        row = verdict.accepted[-1] + 1 if verdict.accepted else 0
        prev = s.retrieval  # (with snapshots: scored in this forward's shadow, it goes with this verdict)
        fresh = s.target.timed_selection(row, self.config.retrieval, s.stats) if refresh else None
        clock("retrieval")
        s.stats.retrieval_refreshes += fresh is not None
        # (a step that made no call keeps a selection not yet sent)
        s.retrieval = fresh if fresh is not None else (s.retrieval if from_ask else None)
        s.stats.verify_s += time.perf_counter() - ts
        if s.feed is not None:  # the verdict to the draft at once; a selection made at this step
            s.feed.push(s.committed, prev)  # is scored in the next forward's shadow, sent after it
            s.pending, s.retrieval = [], fresh
        own = drafted_prefix(verdict.accepted, drafted)  # the path inside the draft's nodes
        s.stats.lookup_accepted += verdict.accept_length - len(own)
        s.stats.tree_step(verdict.accept_length, s.target.cache.length, drafted, len(tokens), tree, draft_s,
                        prepared=not applied, refreshed=refreshed)
        if s.lookup is not None:
            s.lookup.commit(s.committed)
        one_off = self._first_tree or s.stats.num_steps == 1  # (one-offs: docs, "Adaptive speculation")
        self._first_tree = False
        waited = None if one_off else draft_s - s.load.take_shared()  # (caught up: the catch-up's line)
        s.ctl.record_spec(rung, None if caught_up else waited, prefix_accepts(own, parents[:drafted], rung, s.ctl.rungs),
                        step_s=s.load.wall(t_step), catchup=(behind, waited) if caught_up and waited is not None else None,
                        lookup=verdict.accept_length - len(own) if s.lookup is None or s.lookup.found else None)
        s.stats.probe_steps = s.ctl.probe_steps
        kind, split = "tree", (draft_s, s.ctl.last_forward_s)  # (the step's wait, its forward)
        return kind, split, clock

    def _plain_step_co(self, s: SessionState, t_step: float):
        """A step without a tree: a run ahead of the host ("Plain steps ahead", "Lookup runs ahead";
        -> None, its events emitted) or one plain step (-> (kind, split, clock)); an overlapping
        draft is told the tokens."""
        s.asked = s.ready = None  # (an ask in flight: a tell after all, its answer unused)
        # an overlapping draft hears the tokens so far: a plain step's once its forward is queued (the
        # call's host work while the device runs: start_ask), a run's as read; after the lane's calls, unwaited
        tells = RunTells(self.draft, s.lane, s.sid, s.step, s.pending, s.retrieval, s.held, s.stats) if s.tell else None
        # (its run ends when the batch's governor changes its hold; a draft's session or a context lookup's)
        governed = (s.use_draft or s.lookup is not None) and s.ctl.governed
        # held to plain steps by the batch's governor: no lookup chain either, the steps run ahead as `ar`'s
        # (one session's host step reads its token before the next forward, and the whole round waits)
        plain_held = governed and s.load.held in (PLAIN, OPENING)
        run = (self.config.plain_ahead and not s.opening_pending
               and run_ahead(s.target, s.committed[-1], s.out, s.stats, s.t1, s.gen, s.ctl, s.lookup,
                             s.use_draft and not plain_held, s.load,
                             self.lookup_ahead, s.feed.push if s.feed is not None else tells, s.ref, governed,
                             chains=not plain_held))  # ("Plain
        send, scoring = None, s.retrieval  # steps ahead", "Lookup runs ahead"; scoring: once the forward is queued)
        if run:
            if s.feed is not None:  # (a selection held goes with the run's first tokens)
                s.retrieval = s.feed.take(s.retrieval)
            s.committed = yield from run
        elif tells is not None and not s.opening_pending:
            send = tells.due()
        if tells is not None:
            s.step, s.pending, s.retrieval, s.held = tells.state()
            if tells.error is not None:
                s.use_draft = s.tell = self._fall_back(s.stats, s.sid, tells.error)
        if run:
            s.pending = s.pending if tells is not None or s.feed is not None else s.pending + s.committed  # (told)
            if s.tell and s.ask_early and not s.out.ends(s.committed):  # (as after a plain step)
                s.chosen, s.asked, s.step, s.pending, s.retrieval = ask_ahead(
                    self.draft, s.lane, s.ctl, s.lookup, s.load.sessions, s.sid, s.step, s.pending, s.retrieval)
                s.held = s.held and s.asked is None
            s.t_back, s.load.others_wait_s = time.perf_counter(), 0.0
            return None  # (waits shared during the run are not the next step's: Load.wall)
        chains = s.stats.lookup_steps
        s.committed = yield from plain_step_co(s.target, s.committed[-1], s.params, s.gen, s.timed, s.lookup, s.stats,
                                             send, s.ref, scoring, teach_host=not s.opening_pending,
                                             chains=not plain_held)
        t_plain = time.perf_counter()
        if s.feed is not None:  # (with a selection held, scored in this forward's shadow)
            s.feed.push(s.committed, s.retrieval, send=not s.opening_pending)
            s.retrieval = None
        kind = ("open" if s.use_draft and s.opening_pending
                else "lookup" if s.stats.lookup_steps > chains else "plain")
        split = (0.0, 0.0)
        if s.use_draft or s.lookup is not None:  # (mode lookup: the forwards into the gate's cost line)
            s.ctl.record_plain(step_s=None if s.opening_pending else s.load.wall(t_step),  # (an open's
                             lookup=len(s.committed) - 1, contended=s.opening_pending)  # steps: no price)
            split = (0.0, s.ctl.last_forward_s)
        if s.use_draft:
            s.pending = [] if s.feed is not None else s.pending + s.committed
            if s.opening_pending:
                s.stats.open_steps += 1
            else:
                s.stats.plain_steps += 1
                if s.ask_early and not s.out.ends(s.committed):  # (as after an unready step)
                    s.chosen, s.asked, s.step, s.pending, s.retrieval = ask_ahead(
                        self.draft, s.lane, s.ctl, s.lookup, s.load.sessions, s.sid, s.step, s.pending, s.retrieval)
                    s.held = s.held and s.asked is None
        clock = s.stats.clock(kind, t_step)
        clock.add("step", t_plain - t_step)  # its forward, verdict and commit (plain_step_co)
        return kind, split, clock
