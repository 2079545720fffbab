"""The decode loop: prefill, then draft -> verify -> commit steps (or plain autoregressive steps).
The target drives. The draft is reached only through DraftBackend (in-process or gRPC); any
DraftError switches the request to plain decoding on the target, which stays lossless."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import Future
from dataclasses import replace
from functools import partial
from typing import Generator, Iterator, Optional, Sequence, Union

import torch

from specextend.config import EngineConfig, SamplingParams, TreeConfig
from specextend.controller import AlwaysSpeculate, TreeController
from specextend.ladder import ladder, prefix_accepts
from specextend.draft.base import DraftBackend, DraftError, DraftSessionParams, DraftTree
from specextend.engine_carry import EngineCarry
from specextend.draft_link import DraftLink, Lane, RunTells, ask_ahead, prepared_tree, send_prepare, settled, start_ask
from specextend.emit import Emitter, StepEvent
from specextend.lookup import ContextIndex, RequestLookup, drafted_prefix
from specextend.models.args import ModelArgs
from specextend.models.loader import LoadedModel
from specextend.models.batch import ForwardCall
from specextend.sampling import make_generator, next_token
from specextend.snapshot import SNAPSHOT_BOUND, SNAPSHOT_NODES, DraftFeed
from specextend.stats import RequestStats
from specextend.session_calls import DraftCall, Load, drive_alone, metered
from specextend.lookup_ahead import run_ahead
from specextend.plain_ahead import plain_ahead_co
from specextend.plain_step import plain_step_co
from specextend.prefix_cache import PrefixCache
from specextend.request_limits import RequestLimits
from specextend.retrieval import launch_scoring
from specextend.target import TargetSession
from specextend.verify import Reference, verify_tree

Session = Generator[Union[ForwardCall, DraftCall, "StepEvent"], object, None]  # see Engine.session


class Engine(RequestLimits, DraftLink, EngineCarry):
    join_early = True  # adaptive policy: plain steps until the draft's open (prefill) is done ("Adaptive speculation")
    lookup_ahead: Optional[bool] = None  # lookup runs ahead of the host: None where the forward allows (tests: True)

    def __init__(self, config: EngineConfig, target: LoadedModel, draft: Optional[DraftBackend] = None,
                 draft_args: Optional[ModelArgs] = None):
        self.config = config
        self.target = target
        self.draft = draft
        self._start_carrying(config.draft_snapshots)  # what sessions hand on to the next (engine_carry.py)
        self.prefix_cache = PrefixCache.of(config)  # recent prompts' K/V ("Prefix caching"; None: off)
        if self.config.uses_draft and draft is None:
            raise ValueError(f"mode {self.config.mode!r} needs a draft backend")
        self._start_link(draft_args)

    def new_controller(self, tree: TreeConfig) -> TreeController:
        """Per request: the step-by-step choice of the tree, none included, within `tree` (controller.py)."""
        policy = TreeController if self.config.tree_policy == "adaptive" else AlwaysSpeculate
        return policy(ladder(tree), overlap=self.config.overlap)  # (overlap: trees come in runs)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams, **kw) -> tuple[list[int], str, RequestStats]:
        tokens, finish, stats = [], None, RequestStats()
        for ev in self.stream(prompt_ids, params, **kw):
            tokens += ev.token_ids
            finish, stats = ev.finish_reason, ev.stats
        return tokens, finish, stats

    @torch.inference_mode()
    def stream(self, prompt_ids: Sequence[int], params: SamplingParams, **kw) -> Iterator[StepEvent]:
        """One request run alone (`session`'s forwards and draft calls made in place, one at a time):
        a StepEvent per target forward, the last with a finish_reason; its draft session closed on return."""
        sid = kw.pop("session_id", None) or uuid.uuid4().hex
        yield from drive_alone(self.session(prompt_ids, params, session_id=sid, **kw), self.target.decoder)
        self.wait_closed(sid)

    def session(self, prompt_ids: Sequence[int], params: SamplingParams, session_id: Optional[str] = None,
                replay: Optional[Sequence[int]] = None, speculate: bool = True, max_tree_nodes: Optional[int] = None,
                load: Optional[Load] = None, replay_bonus: str = "target",
                reference: Optional[Sequence[int]] = None) -> Session:
        """One request as a coroutine (docs/architecture.md, "Batched steps"): it yields the target
        forwards it needs (ForwardCall, answered with the forward's result), the draft calls
        (DraftCall, answered with the call's value or its exception thrown in) and its StepEvents.
        A driver runs it alone (`stream`) or batched with other sessions (scheduler.Batcher).

        `replay` (acceptance replay, not lossless) forces each step's accepted length, cycled;
        `replay_bonus="draft"`: its bonus token is the draft's second choice (verify.verify_tree).
        Each prefill chunk is its own forward (a batched driver runs other sessions' steps between).
        `speculate=False` decodes plainly (no draft session); `max_tree_nodes` bounds this request's
        trees (per-request control). `load` is where a batching driver tells the session's policy
        about the forwards it shares (session_calls.Load). `reference` (benchmarks, greedy): the tokens to
        emit where the target's choice differs (verify.Reference; its gaps in stats.reference_gaps)."""
        self.check_request(prompt_ids, params, reference)
        return self._session(prompt_ids, params, session_id, replay, speculate, max_tree_nodes, load or Load(),
                             replay_bonus == "draft",
                             None if reference is None else Reference(list(reference), dtype=self.target.decoder.dtype))

    @torch.inference_mode()
    def _session(self, prompt_ids, params, session_id, replay, speculate, max_tree_nodes, load, draft_bonus,
                 ref) -> Session:
        cfg = self.config
        sid = session_id or uuid.uuid4().hex
        stats = RequestStats(prompt_tokens=len(prompt_ids), replayed=replay is not None)
        stats.keep_reference(ref)
        out = Emitter(params, self.target.args.eos_token_ids, stats)
        gen = make_generator(params.seed)
        target = TargetSession(self.target.decoder, self.capacity(len(prompt_ids), params.max_new_tokens),
                               hybrid=cfg.hybrid_attention, pool=load.kv_pool)
        use_draft = cfg.uses_draft and speculate and not self.draft_never_pays
        tree_cfg = cfg.tree if max_tree_nodes is None else replace(cfg.tree, nodes=min(max_tree_nodes, cfg.tree.nodes))
        opening: Optional[Future] = None
        lane = Lane(self._tells)  # tells and early asks, in order, none waited for by the step that sends it
        held = False  # plain steps' tokens held back by the lane's backlog, not yet sent
        asked: Optional[Future] = None  # a verdict sent early (ask_early), in the lane: the next tree step's answer
        chosen = None  # the next step's rung, chosen at the step before (ask_ahead)
        feed: Optional[DraftFeed] = None  # with snapshots: the draft's latest answer and the call in flight
        ctl = self.new_controller(tree_cfg)
        stats.predicted = ctl.predicted  # (filled as it chooses)
        self._prime(ctl, use_draft)  # (the costs carried: engine_carry.py)
        timed = partial(metered, load=load, record=ctl.record_forward)  # every step's forward feeds ctl's cost line
        lookup, snap = None, False  # the request's tokens ("Context lookup"); it walks snapshots (SnapshotChoice)
        try:
            t0 = time.perf_counter()
            snap = (use_draft and cfg.overlap and cfg.overlap_miss == "plain" and not cfg.draft_prepare
                    and self.snapshots.use())  # (prepared outcomes are the other way to skip the call)
            if use_draft:  # the draft prefills beside the target, unless deferred (snapshots: SNAPSHOT_NODES)
                draft_tree = replace(tree_cfg, nodes=max(tree_cfg.nodes, SNAPSHOT_NODES)) if snap else tree_cfg
                open_now = partial(self._open_draft, sid, prompt_ids, DraftSessionParams(
                    draft_tree, cfg.retrieval, params.max_new_tokens, cfg.lookup_tokens if replay is None else 0))
                opening = None if self.defers_open(ctl, len(prompt_ids)) else open_now()  # (a deferred open)
            capture = use_draft and cfg.retrieval.enabled and cfg.retrieval.select == "attention"  # (1st selection)
            logits = yield from metered(target.prefill_co(prompt_ids, cfg.prefill_chunk, capture, self.prefix_cache), load,
                                        ctl.record_prefill)  # (the prefill's own cost line)
            stats.cached_prompt_tokens = target.cached_tokens
            target_prefill_s = time.perf_counter() - t0
            # chains alone (mode lookup): plain or lookup steps. The prompt's index (~7 ms at 16K on the host)
            # is built while the device still runs the prefill, not in the decode's first gap
            alone = speculate and (cfg.mode == "lookup" or self.draft_never_pays)
            index = (ContextIndex(prompt_ids, self.target.args.vocab_size,
                                  capacity=len(prompt_ids) + params.max_new_tokens + 1)
                     if cfg.lookup_tokens and replay is None and (use_draft or alone) else None)
            token = next_token(logits, params, gen)
            token = token if ref is None else ref.pick(logits.view(1, -1), 0, token, 0)
            stats.prefill_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            yield out.emit([token])  # the first token needs nothing from the draft: not its open either
            # the draft joins once its open (its prefill) is done: with the adaptive policy the target decodes
            # plainly meanwhile; the fixed policy waits for it here (docs/architecture.md, "Adaptive speculation")
            opening_pending = opening is not None
            if opening_pending and out.finish is None and (cfg.tree_policy != "adaptive" or not self.join_early):
                use_draft, opening_pending = (yield from self._join(opening, ctl, target_prefill_s, stats, sid)), False
            if index is not None and (use_draft or alone):  # (a draft that failed to join: plain steps)
                index.extend([token])
                lookup = RequestLookup(index, cfg.lookup_tokens, **ctl.chain_pricing(),  # chains where they pay
                                       gate=self._carried_gate())
            if cfg.plain_ahead and not use_draft and lookup is None and ref is None:  # ("Plain steps ahead")
                return (yield from plain_ahead_co(target, token, out, stats, t1, gen))
            retrieving = use_draft and cfg.retrieval.enabled
            retrieval = target.timed_selection(-1, cfg.retrieval, stats) if retrieving else None  # (prefill's chunks)
            stats.retrieval_refreshes += retrieval is not None
            step, committed = 0, [token]
            pending = [token]  # committed tokens the draft has not seen yet (it catches up lazily)
            prepare = use_draft and self.draft.supports_prepare and not snap
            ready_only = cfg.overlap_miss == "plain"  # an overlapping draft's unready step: a plain one instead
            refresh_due = cfg.retrieval.every  # the verification (1-based) of the next retrieval selection
            prepared: Optional[Future] = None  # the draft's trees for the verdicts of the tree being verified
            ready: Optional[DraftTree] = None  # the next tree, found among them at the verdict (with early asks)
            # an overlapping draft is told each plain step's tokens while the next forward runs ("Overlapped drafting")
            tell = use_draft and cfg.overlap and ready_only and cfg.draft_tell
            ask_early = tell and cfg.draft_ask_early  # a tree step's verdict to the draft once known (ask_ahead)
            if snap:  # every step's tokens to the draft at once, trees walked from its answers ("Pool snapshots")
                asks, tell, ask_early = (tell, ask_early), False, False  # (back where snapshots give way)
                feed = DraftFeed(lambda n, toks, retr: start_ask(self.draft, lane, sid, n, toks, retr, SNAPSHOT_BOUND),
                                 len(prompt_ids))  # (one call in flight: the lane is idle, begun on this thread)
                feed.commit([token], retrieval)
                pending, retrieval = [], None
            verify_ema = 0.0  # seconds from a prepare's issue to the verdict it prepares for
            late_ema = 0.0  # seconds the target then waited for the prepare's answer (due that much sooner)
            late: list[float] = []  # (with early asks) how long after their verdicts late answers came
            t_back = None  # when the last step's event came back (stats.between_s)
            while out.finish is None:
                if use_draft and opening is None and self.open_due(  # (a deferred open)
                        ctl, len(prompt_ids), params.max_new_tokens - stats.num_generated):
                    opening, opening_pending = open_now(), True
                if opening_pending and use_draft and (opening.done() or not self.join_early):  # (joins at once)
                    use_draft = yield from self._join(opening, ctl, target_prefill_s, stats, sid)
                    opening_pending = False
                    if feed is not None and use_draft:  # the draft catches up at once
                        feed.send()
                if feed is not None and feed.error is not None:  # a call failed: plain decoding from here
                    use_draft, feed = self._fall_back(stats, sid, feed.error), None
                if feed is not None and self.snapshots.gives_up(stats):  # early asks from here ("Pool snapshots")
                    (pending, unsent, step, asked), feed, (tell, ask_early) = feed.handover(), None, asks
                    retrieval = retrieval if retrieval is not None else unsent
                if use_draft and chosen is not None:  # (at the step before: ask_ahead)
                    rung = chosen
                elif use_draft and not opening_pending and opening is not None:
                    ctl.see_chain(lookup, len(pending) - len(committed))  # (what a step without a tree would verify now)
                    rung = ctl.choose_noted(load.sessions)
                else:
                    rung = ctl.plain_unchosen()
                chosen = None
                t_step = time.perf_counter()  # the step's wall time teaches the controller its host work
                if t_back is not None:
                    stats.between_s += t_step - t_back
                if not rung.plain:
                    try:
                        ts = time.perf_counter()
                        tree, applied = None, True  # applied: this step's call carries the verdict
                        from_ask = asked is not None  # (then the lane's last call)
                        if not from_ask and feed is None:  # this step's call goes after the lane's (the
                            yield from settled(lane.tail)  # feed's own call in flight there is not waited for)
                        if feed is not None:  # the latest snapshot, walked to here: no call
                            tree = yield from feed.tree_co(step, rung.nodes, stats)
                        elif from_ask:  # asked at the last verdict (its step number taken then)
                            tree = yield DraftCall(future=asked)
                            stats.ask_done(asked, ts, tree)  # (its way's times)
                            asked = None
                        elif ready is not None:  # prepared for the last verdict: no call (it goes with the next)
                            tree, ready, applied = ready, None, False
                        elif prepared is not None:  # (without early asks: read here, waited for)
                            outs, prepared = (yield DraftCall(future=prepared)), None
                            late_ema = 0.7 * late_ema + 0.3 * (time.perf_counter() - ts)
                            tree = outs.get(pending) if outs.step == step else None
                            applied = tree is None
                        caught_up = (behind := len(pending) - len(committed)) > 0  # it forwards plain steps' tokens too
                        if tree is None:  # ready_only only where the draft's pool can hold this verdict: not
                            # the first step, nor after plain steps (the draft was not told about them)
                            # (ready from the pool still, where only the lane's backlog held them back)
                            bound = replace(rung.bound, ready_only=ready_only and step > 0 and (held or not caught_up))
                            held = False
                            launch_scoring(retrieval)  # (here: the call may run on another thread)
                            tree = yield DraftCall(fn=partial(self.draft.step, sid, step, pending, retrieval, bound))
                        draft_s = time.perf_counter() - ts
                        refreshed = retrieval is not None
                    except DraftError as e:
                        use_draft, feed = self._fall_back(stats, sid, e), None
                        continue
                    if not tree.tokens:  # nothing ready (the draft applied the step and catches up): one
                        # plain token now; to the policy an unready step (its ready share falls)
                        stats.unready_steps += 1
                        stats.unready_wait_s += draft_s
                        stats.unready_split.append((draft_s, tree.server_s, tree.queued_s))
                        stats.unready_refreshes += retrieval is not None and not from_ask and feed is None  # (its call)
                        committed = pending = yield from plain_step_co(target, committed[-1], params, gen, timed,
                                                                        lookup, stats, reference=ref)
                        step, retrieval = step + (not from_ask), (retrieval if from_ask or feed is not None else None)
                        if feed is not None:  # (with a selection held since the last verdict)
                            feed.push(committed, retrieval)
                            pending, retrieval = [], None
                        ctl.record_unready(rung, draft_s - load.take_shared(), step_s=load.wall(t_step),
                                           lookup=len(committed) - 1)
                        if ask_early and not out.ends(committed):  # the next step chosen now: a tree's ask goes
                            chosen, asked, step, pending, retrieval = ask_ahead(
                                self.draft, lane, ctl, lookup, load.sessions, sid, step, pending, retrieval)
                        stats.probe_steps = ctl.probe_steps
                        stats.decode_s = time.perf_counter() - t1
                        ev = out.emit(committed)
                        stats.step_done("unready", len(ev.token_ids), time.perf_counter() - t_step, draft_s,
                                        ctl.last_forward_s)
                        yield ev
                        t_back = time.perf_counter()
                        continue
                    stats.draft_s += draft_s
                    clock = stats.clock("tree", t_step)  # where the step's time goes (stats.phase_ms)
                    clock("wait")
                    # best first: a prefix is the best smaller tree (a draft that ignores the bound may send more)
                    tokens, parents = tree.tokens[:rung.nodes], tree.parents[:rung.nodes]  # [N], [N]
                    drafted = len(tokens)  # the draft's nodes; a lookup chain's new ones follow them
                    if lookup is not None:
                        tokens, parents, grafted = lookup.graft(tokens, parents)
                        stats.lookup_nodes += grafted
                    ts = time.perf_counter()
                    # every `every` verifications (not step numbers, which tells, asks and unready steps advance)
                    refresh = cfg.retrieval.enabled and stats.num_steps + 1 >= refresh_due
                    refresh_due = stats.num_steps + 1 + cfg.retrieval.every if refresh else refresh_due
                    scored = refresh and cfg.retrieval.select == "attention"
                    clock("graft")
                    logits = yield from timed(target.verify_co(committed[-1], tokens, parents, capture=scored))
                    clock("verify")  # (queued: from here the device runs it)
                    launch_scoring(retrieval)  # a selection not yet scored: in this forward's shadow
                    clock("scoring")
                    if prepare and use_draft:  # queued: the draft prepares the next trees while it runs
                        t_prep = time.perf_counter()
                        prepared, late_ema = send_prepare(self.draft, lane if ask_early else None, sid, step,
                                                          () if applied else pending, None if applied else retrieval,
                                                          verify_ema, late_ema, late)
                    forced = replay[step % len(replay)] if replay else None
                    verdict = verify_tree(logits, tokens, parents, params, gen, forced, draft_bonus, ref,
                                          stats.num_generated)
                    clock("verdict")
                    if prepared is not None:
                        dt = time.perf_counter() - t_prep
                        verify_ema = dt if not verify_ema else 0.7 * verify_ema + 0.3 * dt
                    committed = pending = verdict.tokens
                    step += not from_ask
                    if ask_early and use_draft and not out.ends(committed):  # at once, before the commit and
                        # the retrieval scoring (a selection made below goes with the next call; its error: the next step's)
                        ready, prepared = prepared_tree(prepared, committed, step, late), None  # (a hit: no ask)
                        if ready is None:
                            asked = start_ask(self.draft, lane, sid, step, pending, retrieval if from_ask else None,
                                              replace(ctl.top.bound, ready_only=True))  # (else this step's call had it)
                            step, retrieval, pending = step + 1, None, []
                    clock("ask")
                    target.commit(verdict.accepted)
                    clock("commit")
                    row = verdict.accepted[-1] + 1 if verdict.accepted else 0
                    prev = retrieval  # (with snapshots: scored in this forward's shadow, it goes with this verdict)
                    fresh = target.timed_selection(row, cfg.retrieval, stats) if refresh else None
                    clock("retrieval")
                    stats.retrieval_refreshes += fresh is not None
                    # (a step that made no call keeps a selection not yet sent)
                    retrieval = fresh if fresh is not None else (retrieval if from_ask else None)
                    stats.verify_s += time.perf_counter() - ts
                    if feed is not None:  # the verdict to the draft at once; a selection made at this step
                        feed.push(committed, prev)  # is scored in the next forward's shadow, sent after it
                        pending, retrieval = [], fresh
                    own = drafted_prefix(verdict.accepted, drafted)  # the path inside the draft's nodes
                    stats.lookup_accepted += verdict.accept_length - len(own)
                    stats.tree_step(verdict.accept_length, target.cache.length, drafted, len(tokens), tree, draft_s,
                                    prepared=not applied, refreshed=refreshed)
                    if lookup is not None:
                        lookup.commit(committed)
                    one_off = self._first_tree or stats.num_steps == 1  # (one-offs: docs, "Adaptive speculation")
                    self._first_tree = False
                    waited = None if one_off else draft_s - load.take_shared()  # (caught up: the catch-up's line)
                    ctl.record_spec(rung, None if caught_up else waited, prefix_accepts(own, parents[:drafted], rung, ctl.rungs),
                                    step_s=load.wall(t_step), catchup=(behind, waited) if caught_up and waited is not None else None,
                                    lookup=verdict.accept_length - len(own) if lookup is None or lookup.found else None)
                    stats.probe_steps = ctl.probe_steps
                    kind, split = "tree", (draft_s, ctl.last_forward_s)  # (the step's wait, its forward)
                else:
                    asked = ready = None  # (an ask in flight: a tell after all, its answer unused)
                    # an overlapping draft hears the tokens so far: a plain step's once its forward is queued (the
                    # call's host work while the device runs: start_ask), a run's as read; after the lane's calls, unwaited
                    tells = RunTells(self.draft, lane, sid, step, pending, retrieval, held, stats) if tell else None
                    run = (cfg.plain_ahead and not opening_pending
                           and run_ahead(target, committed[-1], out, stats, t1, gen, ctl, lookup, use_draft, load,
                                         self.lookup_ahead, feed.push if feed is not None else tells, ref))  # ("Plain
                    send, scoring = None, retrieval  # steps ahead", "Lookup runs ahead"; scoring: once the forward is queued)
                    if run:
                        if feed is not None:  # (a selection held goes with the run's first tokens)
                            retrieval = feed.take(retrieval)
                        committed = yield from run
                    elif tells is not None and not opening_pending:
                        send = tells.due()
                    if tells is not None:
                        step, pending, retrieval, held = tells.state()
                        if tells.error is not None:
                            use_draft = tell = self._fall_back(stats, sid, tells.error)
                    if run:
                        pending = pending if tells is not None or feed is not None else pending + committed  # (told)
                        if tell and ask_early and not out.ends(committed):  # (as after a plain step)
                            chosen, asked, step, pending, retrieval = ask_ahead(
                                self.draft, lane, ctl, lookup, load.sessions, sid, step, pending, retrieval)
                            held = held and asked is None
                        t_back, load.others_wait_s = time.perf_counter(), 0.0
                        continue  # (waits shared during the run are not the next step's: Load.wall)
                    chains = stats.lookup_steps
                    committed = yield from plain_step_co(target, committed[-1], params, gen, timed, lookup, stats,
                                                         send, ref, scoring, teach_host=not opening_pending)
                    t_plain = time.perf_counter()
                    if feed is not None:  # (with a selection held, scored in this forward's shadow)
                        feed.push(committed, retrieval, send=not opening_pending)
                        retrieval = None
                    kind = ("open" if use_draft and opening_pending
                            else "lookup" if stats.lookup_steps > chains else "plain")
                    split = (0.0, 0.0)
                    if use_draft or lookup is not None:  # (mode lookup: the forwards into the gate's cost line)
                        ctl.record_plain(step_s=None if opening_pending else load.wall(t_step),  # (an open's
                                         lookup=len(committed) - 1, contended=opening_pending)  # steps: no price)
                        split = (0.0, ctl.last_forward_s)
                    if use_draft:
                        pending = [] if feed is not None else pending + committed
                        if opening_pending:
                            stats.open_steps += 1
                        else:
                            stats.plain_steps += 1
                            if ask_early and not out.ends(committed):  # (as after an unready step)
                                chosen, asked, step, pending, retrieval = ask_ahead(
                                    self.draft, lane, ctl, lookup, load.sessions, sid, step, pending, retrieval)
                                held = held and asked is None
                    clock = stats.clock(kind, t_step)
                    clock.add("step", t_plain - t_step)  # its forward, verdict and commit (plain_step_co)
                ev = out.emit(committed)
                end = clock("books")  # (the stats, the policy's record, the emit; the step's end)
                stats.decode_s = end - t1
                stats.step_done(kind, len(ev.token_ids), end - t_step, *split)
                yield ev
                t_back = time.perf_counter()
        finally:
            self._hand_on(ctl, lookup, use_draft)  # (the next request's costs and gate)
            if snap and use_draft:
                self.snapshots.record(stats)
            self._release(sid, lane, feed, opening)  # (the draft session's close, in order)
            stats.priced = ctl.priced() if self.config.uses_draft else {}  # (benchmarks' rows)
