"""The decode loop: prefill, then draft -> verify -> commit steps (or plain autoregressive steps).
The target drives. The draft is reached only through DraftBackend (in-process or gRPC); any
DraftError switches the request to plain decoding on the target, which stays lossless."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from functools import partial
from typing import Generator, Iterator, Optional, Sequence, Union

import torch

from specextend.config import EngineConfig, SamplingParams, TreeConfig
from specextend.controller import AlwaysSpeculate, TreeController
from specextend.ladder import ladder
from specextend.draft.base import DraftBackend, DraftSessionParams
from specextend.engine_carry import EngineCarry
from specextend.engine_steps import EngineSteps, SessionState
from specextend.draft_link import DraftLink, Lane, start_ask
from specextend.emit import Emitter, StepEvent
from specextend.lookup import ContextIndex, RequestLookup
from specextend.models.args import ModelArgs
from specextend.models.loader import LoadedModel
from specextend.models.batch import ForwardCall
from specextend.sampling import make_generator, next_token
from specextend.snapshot import SNAPSHOT_BOUND, SNAPSHOT_NODES, DraftFeed
from specextend.stats import RequestStats
from specextend.session_calls import DraftCall, Load, OwnShare, drive_alone, metered
from specextend.plain_ahead import plain_ahead_co
from specextend.prefix_cache import PrefixCache
from specextend.request_limits import RequestLimits
from specextend.target import TargetSession
from specextend.verify import Reference

Session = Generator[Union[ForwardCall, DraftCall, "StepEvent"], object, None]  # see Engine.session


class Engine(RequestLimits, DraftLink, EngineCarry, EngineSteps):
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
        load = load or Load()
        load.max_tokens = params.max_new_tokens  # (a batching driver's governor: how long its batch lasts, from
        # the round the session joins: scheduler.Batcher.life)
        return self._session(prompt_ids, params, session_id, replay, speculate, max_tree_nodes, load,
                             replay_bonus == "draft",
                             None if reference is None else Reference(list(reference), dtype=self.target.decoder.dtype))

    @torch.inference_mode()
    def _session(self, prompt_ids, params, session_id, replay, speculate, max_tree_nodes, load, draft_bonus,
                 ref) -> Session:
        """The request's set-up (its draft's open, the prefill, the first token, the context lookup),
        then its decode steps (engine_steps.EngineSteps) until it finishes; its draft session closed
        after, whatever happened."""
        cfg = self.config
        sid = session_id or uuid.uuid4().hex
        stats = RequestStats(prompt_tokens=len(prompt_ids), replayed=replay is not None)
        stats.keep_reference(ref)
        target = TargetSession(self.target.decoder, self.capacity(len(prompt_ids), params.max_new_tokens),
                               hybrid=cfg.hybrid_attention, pool=load.kv_pool)
        tree_cfg = cfg.tree if max_tree_nodes is None else replace(cfg.tree, nodes=min(max_tree_nodes, cfg.tree.nodes))
        ctl = self.new_controller(tree_cfg)
        stats.predicted = ctl.predicted  # (filled as it chooses)
        s = SessionState(sid, params, len(prompt_ids), stats, Emitter(params, self.target.args.eos_token_ids, stats),
                         make_generator(params.seed), target, ctl, Lane(self._tells), load,
                         partial(metered, load=load, record=ctl.record_forward),  # every step's forward: ctl's cost line
                         ref, replay, draft_bonus, use_draft=cfg.uses_draft and speculate and not self.draft_never_pays)
        self._prime(ctl, s.use_draft)  # (the costs carried: engine_carry.py)
        snap = False  # it walks snapshots (SnapshotChoice)
        try:
            t0 = time.perf_counter()
            snap = (s.use_draft and cfg.overlap and cfg.overlap_miss == "plain" and not cfg.draft_prepare
                    and self.snapshots.use())  # (prepared outcomes are the other way to skip the call)
            if s.use_draft:  # the draft prefills beside the target, unless deferred (snapshots: SNAPSHOT_NODES)
                draft_tree = replace(tree_cfg, nodes=max(tree_cfg.nodes, SNAPSHOT_NODES)) if snap else tree_cfg
                s.open_now = partial(self._open_draft, sid, prompt_ids, DraftSessionParams(
                    draft_tree, cfg.retrieval, params.max_new_tokens, cfg.lookup_tokens if replay is None else 0))
                deferred = self.defers_open(ctl, len(prompt_ids), held=self.held_plain(ctl, load))
                s.opening = None if deferred else s.open_now()  # (a deferred open: open_due)
            capture = s.use_draft and cfg.retrieval.enabled and cfg.retrieval.select == "attention"  # (1st selection)
            share = OwnShare()  # (its own forwards' share of the device: a deferred open's prior below)
            logits = yield from metered(target.prefill_co(prompt_ids, cfg.prefill_chunk, capture, self.prefix_cache), load,
                                        ctl.record_prefill, share)  # (the prefill's own cost line)
            stats.cached_prompt_tokens = target.cached_tokens
            s.target_prefill_s = time.perf_counter() - t0
            # chains alone (mode lookup): plain or lookup steps. The prompt's index (~7 ms at 16K on the host)
            # is built while the device still runs the prefill, not in the decode's first gap
            alone = speculate and (cfg.mode == "lookup" or self.draft_never_pays)
            index = (ContextIndex(prompt_ids, self.target.args.vocab_size,
                                  capacity=len(prompt_ids) + params.max_new_tokens + 1)
                     if cfg.lookup_tokens and replay is None and (s.use_draft or alone) else None)
            token = next_token(logits, params, s.gen)
            token = token if ref is None else ref.pick(logits.view(1, -1), 0, token, 0)
            stats.prefill_s = time.perf_counter() - t0
            deferred = s.use_draft and s.opening is None  # (what a trees window's open would cost: the governor's;
            load.open_s = self.open_prior(len(prompt_ids), share.seconds()) if deferred else 0.0  # token read: done)
            s.t1 = time.perf_counter()
            yield s.out.emit([token])  # the first token needs nothing from the draft: not its open either
            # the draft joins once its open (its prefill) is done: with the adaptive policy the target decodes
            # plainly meanwhile; the fixed policy waits for it here (docs/architecture.md, "Adaptive speculation")
            s.opening_pending = s.opening is not None
            if s.opening_pending and s.out.finish is None and (cfg.tree_policy != "adaptive" or not self.join_early):
                s.use_draft = yield from self._join(s.opening, ctl, s.target_prefill_s, stats, sid)
                s.opening_pending = False
            if index is not None and (s.use_draft or alone):  # (a draft that failed to join: plain steps)
                index.extend([token])
                s.lookup = RequestLookup(index, cfg.lookup_tokens, **ctl.chain_pricing(),  # chains where they pay
                                         gate=self._carried_gate())
            if cfg.plain_ahead and not s.use_draft and s.lookup is None and ref is None:  # ("Plain steps ahead")
                return (yield from plain_ahead_co(target, token, s.out, stats, s.t1, s.gen))
            retrieving = s.use_draft and cfg.retrieval.enabled
            s.retrieval = target.timed_selection(-1, cfg.retrieval, stats) if retrieving else None  # (prefill's chunks)
            stats.retrieval_refreshes += s.retrieval is not None
            s.committed, s.pending = [token], [token]
            s.prepare = s.use_draft and self.draft.supports_prepare and not snap
            s.ready_only = cfg.overlap_miss == "plain"
            s.refresh_due = cfg.retrieval.every
            s.tell = s.use_draft and cfg.overlap and s.ready_only and cfg.draft_tell
            s.ask_early = s.tell and cfg.draft_ask_early
            if snap:  # every step's tokens to the draft at once, trees walked from its answers ("Pool snapshots")
                s.asks, s.tell, s.ask_early = (s.tell, s.ask_early), False, False  # (back where snapshots give way)
                s.feed = DraftFeed(lambda n, toks, retr: start_ask(self.draft, s.lane, sid, n, toks, retr, SNAPSHOT_BOUND),
                                   len(prompt_ids))  # (one call in flight: the lane is idle, begun on this thread)
                s.feed.commit([token], s.retrieval)
                s.pending, s.retrieval = [], None
            while s.out.finish is None:
                yield from self._decode_step_co(s)
        finally:
            self._hand_on(ctl, s.lookup, s.use_draft)  # (the next request's costs and gate)
            if snap and s.use_draft:
                self.snapshots.record(stats)
            self._release(sid, s.lane, s.feed, s.opening)  # (the draft session's close, in order)
            stats.priced = ctl.priced() if self.config.uses_draft else {}  # (benchmarks' rows)
