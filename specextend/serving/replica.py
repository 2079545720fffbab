"""The SpecExtend Serve replica: it IS the target actor (docs/architecture.md, "Deployment").

It loads the target, starts its draft actor on bundle 1 of its own placement group (or, with
`draft_in_replica`, runs the draft's worker in its own process), and runs
Engine.stream for each request. The engine is synchronous torch code: every step of every request
runs on one worker thread (GPU work serialized), one `next()` at a time, so sessions interleave
step by step. Tokenization, detokenization and stop strings are done here (request_params.py,
textstream.py); the ingress only speaks HTTP.

Draft failures: the engine falls back to plain decoding (lossless) and marks stats.fallback. The
replica then serves new requests with its AR engine (fallback) while it restores the draft in the
background: it asks the draft actor for its address (which waits through a Ray restart), or
starts a new draft actor when the old one is dead for good, and reconnects its gRPC client
(draft_recovery.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time
import uuid
from typing import AsyncIterator, Optional

import ray

from specextend.config import SamplingParams
from specextend.governor import Governor
from specextend.models import late_work
from specextend.rpc.auth import new_token
from specextend.serving import metrics as m
from specextend.serving.admission import CPU_KV_FRACTION, GPU_KV_FRACTION, Admission, kv_budget
from specextend.serving.draft_actor import DraftActor, draft_client
from specextend.serving.draft_recovery import DRAFT_START_TIMEOUT_S, DraftRecovery
from specextend.serving.errors import APIError, BadRequestError
from specextend.serving.items import WHOLE_WAKE_S, item_wait, merged, short_prompt
from specextend.serving.protocol import spec_decoding
from specextend.serving.request_params import sampling_params, speculation, tokenize_prompt
from specextend.serving.settings import MODEL_CPUS, AppSettings
from specextend.serving.textstream import TextStream

log = logging.getLogger(__name__)

# The engine side (torch, transformers: seconds of imports) is imported by the constructor after it has started
# its draft actor, so that the two processes' imports overlap (docs/architecture.md, "Deployment").
Engine = RequestError = RequestStats = Batcher = EngineThread = SessionPump = warm_up = warm_long = None


def import_engine_side() -> None:
    global Engine, RequestError, RequestStats, Batcher, EngineThread, SessionPump, warm_up, warm_long
    from specextend.engine import Engine
    from specextend.request_limits import RequestError
    from specextend.stats import RequestStats
    from specextend.scheduler import Batcher
    from specextend.serving.pump import EngineThread, SessionPump
    from specextend.warmup import warm_long, warm_up

DRAFT_MAX_RESTARTS = 3  # Ray restarts of one draft actor; after that a new actor is started


class SpecExtendReplica(DraftRecovery):
    def __init__(self, settings: dict) -> None:
        from specextend.builder import load_pair, read_pair

        t0 = time.perf_counter()
        self.settings = s = AppSettings.model_validate(settings)
        self.cfg = cfg = s.to_engine_config()
        self.draft_actor = None
        self._draft_token = new_token()  # this replica's draft accepts only this replica (*Wire protocol*)

        self.draft_here = s.draft_here  # the draft in this process (draft_in_replica)
        if s.uses_draft and not self.draft_here:
            # first thing: the draft actor's process starts, imports, checks the pair again and loads while this
            # one loads the target (the app builder refused a mismatched pair; docs/architecture.md, "Deployment")
            self._draft_created_at = time.time()
            self.draft_actor = self._start_draft_actor()
        import_engine_side()
        metas = read_pair(cfg, light=("draft",))  # (the draft's from its light record: its size, its vocabulary)
        self.target, draft_model = load_pair(cfg, roles=("target", "draft") if self.draft_here else ("target",),
                                             metas=metas)
        t_target = time.perf_counter()
        self.tokenizer = self.target.tokenizer
        self.model_name = s.served_model_name or self.target.name
        self.ar_engine = Engine(dataclasses.replace(cfg, mode="ar"), self.target)
        # mode lookup: context lookup alone, no draft to reach, nothing to fall back from
        self.engine, self.draft = Engine(cfg, self.target) if cfg.mode == "lookup" else self.ar_engine, None
        if self.draft_here:  # a worker thread on its own stream (docs/architecture.md, "Overlapped drafting")
            from specextend.builder import draft_worker

            self.draft = draft_worker(cfg, draft_model)
        elif s.uses_draft:
            address = ray.get(self.draft_actor.address.remote(), timeout=DRAFT_START_TIMEOUT_S)
            self.draft = draft_client(s, address, self._draft_token)
        if self.draft is not None:
            self.engine = Engine(cfg, self.target, self.draft, draft_args=metas[1].args if metas[1] else None)
        t_draft = time.perf_counter()
        self.draft_ok = self.draft is not None or cfg.mode == "lookup"  # self.engine is usable
        self._restoring: Optional[asyncio.Task] = None
        self.draft_epoch = 0  # restores so far: a request's fallback blames only the draft it started on
        if s.switch_interval_ms is not None:  # (docs/architecture.md, "Serving surface")
            sys.setswitchinterval(s.switch_interval_ms / 1e3)
        self.metrics = m.ReplicaMetrics()
        self.publisher = m.Publisher(self._replica_key(), self.metrics)
        warm = self._warm_up()
        late_work.mark_ready(lambda kind: self.metrics.inc("specextend_late_work", kind=kind))
        if self.draft_actor is not None:
            self.draft_actor.warmed.remote()  # its own late work is logged from now on
        self.admission = Admission(s.max_concurrent_sessions, s.max_queued_requests, self._kv_budget(),
                                   self.engine.prefix_cache)
        # streams running, and the seconds between items that the replica's items a second give each
        self._streams, self._item_s = 0, 1.0 / s.stream_items_per_s if s.stream_items_per_s else 0.0
        self.draft_ok = (self.draft is not None and not warm.fallback) or cfg.mode == "lookup"
        # every session's steps from here on: one thread, batched rounds (docs/architecture.md, "Batched steps")
        self.engine_thread = EngineThread(Batcher(self.target.decoder, s.max_batch_sessions, max_tokens=s.max_batch_tokens,
                                                  on_forward=self.metrics.record_forward,
                                                  governor=Governor() if s.batch_governor else None,
                                                  on_held=self.metrics.record_held_round,
                                                  wait_opens=self.draft_here))
        t_ready = time.perf_counter()
        # where a (re)start's time goes: the target's weights, then waiting for the draft actor, then warm-up
        self.metrics.record_start(t_target - t0, t_draft - t_target, t_ready - t_draft)  # published within 2 s
        if self.draft_actor is not None:
            self._record_draft_start()
        log.info("replica ready in %.1f s (target loaded %.1f s, draft ready %.1f s later, warm-up %.1f s): "
                 "target %s, draft %s (steps over %s), KV budget %.0f MiB", t_ready - t0, t_target - t0,
                 t_draft - t_target, t_ready - t_draft,
                 self.target.name, "in process" if self.draft_here else self.draft.address if self.draft else "none",
                 "-" if self.draft_here or not self.draft else self.draft.step_endpoint or "gRPC",
                 self.admission.budget_bytes / 2**20)

    # ------------------------------------------------------------------ set-up

    def _start_draft_actor(self):
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        s, cfg = self.settings, self.cfg
        pg = get_current_placement_group()
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=1) if pg else None
        actor_cls = ray.remote(DraftActor)
        # max_task_retries: an (idempotent) control call meeting a restart is retried after it, not taken
        # for a death (a second actor was started once); steps do not go through Ray
        return actor_cls.options(num_cpus=MODEL_CPUS, num_gpus=s.num_gpus, max_restarts=DRAFT_MAX_RESTARTS,
                                 max_task_retries=DRAFT_MAX_RESTARTS,
                                 scheduling_strategy=strategy).remote(cfg, self._draft_token,
                                                                      step_transport=s.step_transport,
                                                                      switch_interval_ms=s.switch_interval_ms)

    def _record_draft_start(self) -> None:
        try:
            info = ray.get(self.draft_actor.info.remote(), timeout=DRAFT_START_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a metric is not worth failing a start over
            log.warning("draft actor start-up not recorded: %s", e)
            return
        self.metrics.record_draft_start(self._draft_created_at, info["startup"])

    def _replica_key(self) -> str:
        try:
            from ray import serve

            ctx = serve.get_replica_context()
            return f"{ctx.app_name}:{ctx.deployment}:{ctx.replica_id.unique_id}"
        except Exception:  # noqa: BLE001 - outside Serve (tests)
            return uuid.uuid4().hex

    def _warm_up(self) -> RequestStats:
        """One short request through the whole path (draft RPCs included) before traffic; with CUDA
        graphs, every forward shape a request can take (warmup.py)."""
        ids = self.tokenizer.encode("Hello, world.", add_special_tokens=False) or [0]
        if self.target.decoder.graphs is not None:
            stats = warm_up(self.engine, ids * 8, self.settings.max_batch_sessions)
            if self.cfg.uses_draft and not stats.fallback:
                warm_long(self.engine, ids)  # what only a long prompt meets (warmup.py)
        else:
            _, _, stats = self.engine.generate(ids, SamplingParams(max_new_tokens=4, ignore_eos=True))
        self.engine.forget_text()  # (a synthetic text: what its chains did says nothing of the traffic's)
        if stats.fallback:
            log.warning("warm-up fell back to plain decoding: the draft is not reachable")
        return stats

    def _kv_budget(self) -> int:
        if self.settings.kv_cache_memory_gb is not None:
            return int(self.settings.kv_cache_memory_gb * 2**30)
        import torch

        shared = self.engine.config.uses_draft and self.settings.num_gpus < 1  # the draft on this device too
        if self.target.decoder.device.type == "cuda":
            return kv_budget(torch.cuda.mem_get_info()[0], GPU_KV_FRACTION, self.engine.config.prefix_cache_gb, shared)
        import psutil

        return kv_budget(psutil.virtual_memory().total, CPU_KV_FRACTION, self.engine.config.prefix_cache_gb, shared)

    # ------------------------------------------------------------------ requests

    async def generate(self, req: dict) -> AsyncIterator[dict]:
        """Serve streaming method. Yields {text, token_ids, finish_reason}; the first item adds
        prompt_token_ids if req["return_prompt_ids"] (as vLLM's first chunk does: known at the
        start, so a long prompt's ids never delay the last tokens), the last (with a finish_reason)
        prompt_tokens, completion_tokens and speculative_decoding. A request refused before it starts (4xx)
        yields one item {"error": ...} instead (serving/errors.py)."""
        t_arrival = time.perf_counter()
        try:
            engine, prompt_ids, params, spec, need = await self._admit(req)
        except APIError as e:
            yield {"error": e.body()["error"]}
            return
        self.metrics.set("specextend_num_requests_running", self.admission.active)
        try:
            fallback = engine is self.ar_engine and self.draft is not None
            async for item in self._run(engine, req, prompt_ids, params, spec, t_arrival, fallback):
                yield item
        finally:
            self.admission.release(need)
            self.metrics.set("specextend_num_requests_running", self.admission.active)
            self.publisher.soon()  # after the release

    async def _admit(self, req: dict) -> tuple:
        """Tokenizes, checks and admits a request: (engine, prompt ids, params, speculation, KV bytes)."""
        if short_prompt(req):  # on the loop: a thread's round trip is two waits for the interpreter lock
            prompt_ids = tokenize_prompt(self.tokenizer, req)
        else:
            prompt_ids = await asyncio.to_thread(tokenize_prompt, self.tokenizer, req)
        params = sampling_params(req, len(prompt_ids), self.settings.max_new_tokens, self.target.max_context)
        spec = speculation(req, self.settings.benchmark_references, self.cfg.tree.nodes)  # a 400 before admission
        engine = self.engine if self.draft_ok else self.ar_engine
        try:
            engine.check_request(prompt_ids, params, spec.get("reference_token_ids"))
        except RequestError as e:
            raise BadRequestError(str(e), e.param) from e
        need = engine.kv_bytes(len(prompt_ids), params.max_new_tokens)
        self.metrics.set("specextend_num_requests_waiting", self.admission.waiting + 1)
        try:
            await self.admission.acquire(need)
        finally:
            self.metrics.set("specextend_num_requests_waiting", self.admission.waiting)
        return engine, prompt_ids, params, spec, need

    async def _run(self, engine: Engine, req: dict, prompt_ids: list[int], params: SamplingParams, spec: dict,
                   t_arrival: float, fallback: bool) -> AsyncIterator[dict]:
        loop = asyncio.get_running_loop()
        epoch = self.draft_epoch
        text = TextStream(self.tokenizer, prompt_ids, req.get("stop") or ())
        replay = [self.settings.replay_accept_length] if self.settings.replay_accept_length is not None else None
        # the batcher tells the session's policy how many share its forwards, and lends it a cache slot
        load = self.engine_thread.batcher.new_load()
        session = engine.session(prompt_ids, params, session_id=req.get("request_id"), replay=replay,
                                 speculate=spec["enabled"], max_tree_nodes=spec["max_tree_nodes"], load=load,
                                 replay_bonus=self.settings.replay_bonus, reference=spec.get("reference_token_ids"))
        stats, finish, last = None, None, None
        # a request answered whole (not streamed) yields one item, at the finish: every item is a
        # Ray object the ingress awaits (docs/architecture.md, "Serving surface")
        whole, held = req.get("stream") is False, None
        # a whole response without stop strings has nothing to look at before its finish: after the
        # first token (its time to first token) the loop wakes every WHOLE_WAKE_S (a draft's failure
        # is noticed then) or at the finish, and its steps never pause
        hold_all = whole and not req.get("stop")
        pump = SessionPump(self.engine_thread.batcher, session, loop, load=load,  # steps ahead of the streaming
                           **({"max_ahead": params.max_new_tokens + 1} if hold_all else {}))
        interval, sent = self.settings.stream_interval_ms / 1e3, None  # docs/architecture.md, "Serving surface"
        if hold_all:
            interval = WHOLE_WAKE_S
        self._streams += not whole
        try:
            while finish is None:
                tokens, reason, ended = [], None, False
                # every step ready now, and those that come within the stream interval (longer where
                # many streams share the replica's items a second), in one item
                wait = interval if whole else item_wait(interval, self._streams, self._item_s)
                for ev in await pump.events(until=0.0 if sent is None else sent + wait):
                    if ev is None:
                        ended = True
                        break
                    stats = ev.stats
                    stats.fallback |= fallback
                    self._blame_draft(stats, engine, epoch)  # now, not once the request ends: /health sees it
                    tokens += ev.token_ids
                    if ev.finish_reason is not None:
                        reason = ev.finish_reason
                        break
                if not tokens and reason is None:  # ended with no new token (every event carries one)
                    break
                now = time.perf_counter()
                if last is None:
                    self.metrics.observe("specextend_time_to_first_token_seconds", now - t_arrival)
                else:
                    for _ in tokens:  # tokens that arrive together share the gap
                        self.metrics.observe("specextend_inter_token_latency_seconds", (now - last) / len(tokens))
                last = now
                delta = text.push(tokens)
                finish = "stop" if delta.stopped else reason
                item = {"text": delta.text, "token_ids": delta.token_ids, "finish_reason": finish}
                if finish:
                    item["text"] += text.finish()
                    item.update(prompt_tokens=len(prompt_ids), completion_tokens=len(text.token_ids),
                                cached_tokens=stats.cached_prompt_tokens, speculative_decoding=spec_decoding(stats))
                if sent is None and req.get("return_prompt_ids"):
                    item["prompt_token_ids"] = list(prompt_ids)
                if item["text"] or item["token_ids"] or finish:
                    if whole and not finish:  # a whole response: its tokens wait for the finish
                        held = merged(held, item)
                    else:
                        yield merged(held, item)
                        held = None
                    sent = loop.time()
                if ended:
                    break
            if held is not None:  # the steps ended with no finish: what was held still goes
                yield held
        finally:
            self._streams -= not whole
            # No more steps; then, on the engine thread, the engine's `finally` closes the draft session.
            pump.stop()
            if stats is not None:
                self.metrics.record_request(stats, finish)
                self._blame_draft(stats, engine, epoch)  # (one whose last event came before its fallback)

    # ------------------------------------------------------------------ control

    async def health(self) -> dict:
        draft = "off" if self.draft is None else ("ok" if self.draft_ok else "restoring")
        return {"ready": True, "model": self.model_name, "draft": draft, "draft_restores": self.draft_epoch,
                "active_sessions": self.admission.active, "queued_requests": self.admission.waiting}

    async def model_info(self) -> dict:
        return {"id": self.model_name, "max_model_len": self.target.max_context,
                "max_prompt_tokens": self.engine.max_prompt_tokens,
                "max_new_tokens": self.settings.max_new_tokens}

    async def draft_step_endpoint(self) -> Optional[str]:
        """Where steps go now: the draft's ZeroMQ step channel, or None (gRPC) (tests, operators)."""
        return self.draft.step_endpoint if self.draft is not None and not self.draft_here else None

    async def draft_actor_handle(self):
        """The current draft actor (tests, operators)."""
        return self.draft_actor

    async def draft_sessions(self) -> Optional[int]:
        """Sessions open on the draft server (None: no draft or unreachable)."""
        if self.draft is None:
            return None
        if self.draft_here:
            return self.draft.num_sessions
        try:
            return (await asyncio.to_thread(self.draft.server_health)).sessions
        except Exception:  # noqa: BLE001
            return None

    async def metrics_text(self) -> str:
        return self.metrics.exposition()

    def __del__(self) -> None:
        """Serve's replica shutdown: drop this replica's published metrics, close the channel
        (the draft actor, a child of this actor, goes with it)."""
        try:
            self.publisher.stop()
            self.engine_thread.shutdown()
            if self.draft is not None:
                self.draft.shutdown()
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass
