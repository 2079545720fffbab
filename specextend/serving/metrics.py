"""Per-replica metrics: Ray's metrics API (exported on Ray's metrics port) and a prometheus_client
registry with the same families, whose exposition the ingress merges over replicas for
`GET /metrics` on the HTTP port.

Names follow Prometheus conventions with vLLM's meanings (docs/architecture.md, "Metrics"). Counters are declared
without `_total`; both exporters append it. Ray prefixes its copies with `ray_`.

Replicas publish their exposition text to Ray's internal KV under KV_PREFIX (on every finished
request, after its admission slot is released, and every PUBLISH_EVERY_S from a thread); the
ingress reads every fresh entry and sums samples with equal names and labels (histogram buckets
are equal across replicas: same code). An entry not refreshed for STALE_AFTER_S is a replica that
died without unpublishing (killed): it is left out and deleted.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Iterable, Sequence

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from specextend.models import late_work

log = logging.getLogger(__name__)

KV_PREFIX = "specextend:metrics:"
KV_NAMESPACE = "specextend"
PUBLISH_EVERY_S = 2.0
PUBLISH_MIN_GAP_S = 0.25  # at most one publish this often for requests that end
STALE_AFTER_S = 10.0  # an entry not refreshed for this long belongs to a replica that is gone

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # seconds
TREE_NODES_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # nodes (tree_nodes <= 1024)
SESSIONS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # sessions a forward carried (max_batch_sessions <= 256)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 10.0)  # seconds

# name -> (kind, help, label names)
FAMILIES = {
    "specextend_spec_decode_num_drafts": ("counter", "Verification steps with a draft tree.", ()),
    "specextend_spec_decode_num_draft_tokens": ("counter", "Draft tokens proposed.", ()),
    "specextend_spec_decode_num_accepted_tokens": ("counter", "Draft tokens accepted.", ()),
    "specextend_spec_decode_num_accepted_tokens_per_pos": (
        "counter", "Accepted draft tokens by position in the accepted path (0 = first).", ("position",)),
    "specextend_spec_decode_num_ready_drafts": (
        "counter", "Draft trees that were ready when the target asked (drafted while it verified).", ()),
    "specextend_spec_decode_target_wait_seconds": (
        "counter", "Time the target waited for draft trees (divide by num_drafts for per step).", ()),
    "specextend_spec_decode_transport_seconds": (
        "counter", "Of the target's wait, the round trip to the draft: beyond the draft's own time on the "
        "step, over the steps whose draft reported it.", ()),
    "specextend_spec_decode_draft_queue_seconds": (
        "counter", "Of the target's wait, time the steps waited for the draft's thread.", ()),
    "specextend_spec_decode_ahead_depth": (
        "counter", "Sum over steps of the depth drafted ahead of the new root (divide by num_drafts).", ()),
    "specextend_spec_decode_num_plain_steps": (
        "counter", "Plain decoding steps taken because speculation did not pay (tree_policy=adaptive).", ()),
    "specextend_spec_decode_num_unready_steps": (
        "counter", "Plain decoding steps taken because the overlapping draft had no tree ready "
        "(overlap_miss=plain); the draft caught up meanwhile.", ()),
    "specextend_spec_decode_num_probe_steps": (
        "counter", "Steps with the largest tree taken to re-measure it (tree_policy=adaptive).", ()),
    "specextend_spec_decode_num_lookup_steps": (
        "counter", "Steps without a draft tree that verified a context-lookup chain instead of decoding one token.",
        ()),
    "specextend_spec_decode_num_lookup_accepted_tokens": (
        "counter", "Accepted tokens that only a context-lookup chain proposed (lookup_tokens).", ()),
    "specextend_spec_decode_num_told_steps": (
        "counter", "Plain steps whose tokens went to the overlapping draft at once (draft_tell).", ()),
    "specextend_spec_decode_num_ahead_steps": (
        "counter", "Steps decoded ahead of the host: queued before the step before was read (plain steps ahead, "
        "lookup runs).", ()),
    "specextend_spec_decode_num_asked_steps": (
        "counter", "Tree steps whose tree was asked for as soon as the verdict before was known (draft_ask_early).", ()),
    "specextend_spec_decode_num_snapshot_trees": (
        "counter", "Tree steps whose tree came from the draft's latest pool snapshot, no call (draft_snapshots).", ()),
    "specextend_spec_decode_num_open_steps": (
        "counter", "Plain steps decoded while the draft still prefilled the prompt (it joined after them).", ()),
    "specextend_spec_decode_draft_open_seconds": (
        "counter", "The drafts' opens (their prefills of the prompts), as the target timed them.", ()),
    "specextend_spec_decode_tree_nodes": (
        "histogram", "Draft nodes verified per speculative step (the tree sizes the policy chose).", ()),
    "specextend_prompt_tokens": ("counter", "Prompt tokens prefilled.", ()),
    "specextend_prefix_cache_hit_tokens": (
        "counter", "Prompt tokens whose K/V came from the prefix cache (not forwarded).", ()),
    "specextend_generation_tokens": ("counter", "Tokens generated.", ()),
    "specextend_request_success": ("counter", "Finished requests by finish reason.", ("finish_reason",)),
    "specextend_draft_fallbacks": ("counter", "Requests that fell back to plain decoding.", ()),
    "specextend_time_to_first_token_seconds": ("histogram", "Time to first token.", ()),
    "specextend_inter_token_latency_seconds": ("histogram", "Time between streamed tokens.", ()),
    "specextend_replica_starts": ("counter", "Replica starts that reached ready (the first and every restart).", ()),
    "specextend_replica_startup_seconds": (
        "counter", "Seconds from a replica's start to ready, by phase: target (the engine's imports, the pair's "
        "check, its weights), draft (then "
        "waiting for the draft actor), warm_up (every shape captured, kernels compiled); divide by replica_starts.",
        ("phase",)),
    "specextend_draft_actor_startup_seconds": (
        "counter", "Seconds of the draft actor's starts, by phase: spawn (from its creation to its constructor: a "
        "new process and its imports), load (the draft's weights), warm_up (captures), serve (its servers).",
        ("phase",)),
    "specextend_late_work": (
        "counter", "Work the warm-up should have done, met on a request's path by the target's process: CUDA-graph "
        "plans captured (capture), Triton kernels compiled or loaded (kernel) and full garbage collections (gc); "
        "each stalls every request of the replica. Expected 0 for capture and kernel (the replica's log names each "
        "and a collection's pause).", ("kind",)),
    "specextend_forward_sessions": (
        "histogram", "Sessions whose steps one target forward carried (at most max_batch_sessions).", ()),
    "specextend_rounds_held": (
        "counter", "Batched rounds whose sessions the batch's governor held, by regime: to plain steps or to trees, "
        "where it measured that regime decoding more tokens per second than the sessions' own choices "
        "(batch_governor; docs/architecture.md, \"Adaptive speculation\").", ("regime",)),
    "specextend_num_requests_running": ("gauge", "Active sessions.", ()),
    "specextend_num_requests_waiting": ("gauge", "Requests queued for admission.", ()),
}
_BUCKETS = {"specextend_time_to_first_token_seconds": TTFT_BUCKETS,
            "specextend_inter_token_latency_seconds": ITL_BUCKETS,
            "specextend_spec_decode_tree_nodes": TREE_NODES_BUCKETS,
            "specextend_forward_sessions": SESSIONS_BUCKETS}


class ReplicaMetrics:
    """Both exporters behind one recording API."""

    def __init__(self, use_ray: bool = True) -> None:
        disable_created_metrics()  # `_created` series: noise for counters summed over replicas
        self.registry = CollectorRegistry(auto_describe=True)
        self._prom, self._ray = {}, {}
        prom_cls = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
        for name, (kind, doc, labels) in FAMILIES.items():
            kw = {"buckets": _BUCKETS[name]} if kind == "histogram" else {}
            self._prom[name] = prom_cls[kind](name, doc, labels, registry=self.registry, **kw)
        for kind in late_work.KINDS:  # exported at 0 from the start: a rate of 0 is the expected reading
            self._prom["specextend_late_work"].labels(kind=kind)
        if use_ray:
            from ray.util import metrics as rm

            ray_cls = {"counter": rm.Counter, "gauge": rm.Gauge, "histogram": rm.Histogram}
            for name, (kind, doc, labels) in FAMILIES.items():
                kw = {"boundaries": list(_BUCKETS[name])} if kind == "histogram" else {}
                self._ray[name] = ray_cls[kind](name, description=doc, tag_keys=labels, **kw)

    def _apply(self, name: str, op: str, value: float, **labels: str) -> None:
        prom = self._prom[name].labels(**labels) if labels else self._prom[name]
        getattr(prom, op)(value)
        if name in self._ray:
            ray_op = {"inc": "inc", "set": "set", "observe": "observe"}[op]
            getattr(self._ray[name], ray_op)(value, tags=labels or None)

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        if value:
            self._apply(name, "inc", value, **labels)

    def set(self, name: str, value: float) -> None:
        self._apply(name, "set", value)

    def observe(self, name: str, value: float) -> None:
        self._apply(name, "observe", value)

    def record_start(self, target_s: float, draft_s: float, warm_up_s: float) -> None:
        self.inc("specextend_replica_starts")
        for phase, seconds in (("target", target_s), ("draft", draft_s), ("warm_up", warm_up_s)):
            self.inc("specextend_replica_startup_seconds", seconds, phase=phase)

    def record_draft_start(self, created_at: float, startup: dict) -> None:
        """The draft actor's start: `startup` as DraftActor.info() gives it, `created_at` the
        replica's wall clock when it created the actor (same node)."""
        phases = dict(spawn=max(0.0, startup["started_at"] - created_at), load=startup["load_s"],
                      warm_up=startup["warm_up_s"], serve=startup["serve_s"])
        for phase, seconds in phases.items():
            self.inc("specextend_draft_actor_startup_seconds", seconds, phase=phase)

    def record_forward(self, sessions: int) -> None:
        """A target forward of the replica's batcher, carrying `sessions` sessions' steps (its thread)."""
        self.observe("specextend_forward_sessions", sessions)

    def record_held_round(self, regime: str) -> None:
        """A batched round the governor held to `regime` ("plain", "trees"; the batcher's thread)."""
        self.inc("specextend_rounds_held", regime=regime)

    def record_request(self, stats, finish_reason: str | None) -> None:
        """Per-request counters from a RequestStats (finished, stopped or cancelled)."""
        self.inc("specextend_prompt_tokens", stats.prompt_tokens)
        self.inc("specextend_prefix_cache_hit_tokens", stats.cached_prompt_tokens)
        self.inc("specextend_generation_tokens", stats.num_generated)
        self.inc("specextend_spec_decode_num_drafts", stats.num_steps)
        self.inc("specextend_spec_decode_num_draft_tokens", stats.draft_tokens)
        self.inc("specextend_spec_decode_num_accepted_tokens", sum(stats.accepted_per_step))
        for pos, n in enumerate(accepted_per_position(stats.accepted_per_step)):
            self.inc("specextend_spec_decode_num_accepted_tokens_per_pos", n, position=str(pos))
        self.inc("specextend_spec_decode_num_ready_drafts", stats.ready_steps)
        self.inc("specextend_spec_decode_target_wait_seconds", stats.draft_s + stats.unready_wait_s)
        self.inc("specextend_spec_decode_transport_seconds", stats.transport_s)
        self.inc("specextend_spec_decode_draft_queue_seconds", stats.draft_queue_s)
        self.inc("specextend_spec_decode_ahead_depth", stats.ahead_depth_sum)
        self.inc("specextend_spec_decode_num_plain_steps", stats.plain_steps)
        self.inc("specextend_spec_decode_num_unready_steps", stats.unready_steps)
        self.inc("specextend_spec_decode_num_probe_steps", stats.probe_steps)
        self.inc("specextend_spec_decode_num_lookup_steps", stats.lookup_steps)
        self.inc("specextend_spec_decode_num_lookup_accepted_tokens", stats.lookup_accepted)
        self.inc("specextend_spec_decode_num_told_steps", stats.told_steps)
        self.inc("specextend_spec_decode_num_ahead_steps", stats.ahead_steps)
        self.inc("specextend_spec_decode_num_asked_steps", stats.asked_steps)
        self.inc("specextend_spec_decode_num_snapshot_trees", stats.snapshot_trees)
        self.inc("specextend_spec_decode_num_open_steps", stats.open_steps)
        self.inc("specextend_spec_decode_draft_open_seconds", stats.draft_open_s)
        for nodes in stats.nodes_per_step:
            self.observe("specextend_spec_decode_tree_nodes", nodes)
        self.inc("specextend_draft_fallbacks", int(stats.fallback))
        self.inc("specextend_request_success", 1, finish_reason=finish_reason or "abort")

    def exposition(self) -> str:
        return generate_latest(self.registry).decode()


def accepted_per_position(accepted_per_step: Sequence[int]) -> list[int]:
    """[P] count of steps that accepted at least p+1 draft tokens, for p = 0 .. max-1."""
    top = max(accepted_per_step, default=0)
    return [sum(1 for a in accepted_per_step if a > p) for p in range(top)]


# ------------------------------------------------------------------ publishing and merging

def publish(key: str, text: str) -> None:
    from ray.experimental import internal_kv

    value = json.dumps({"ts": time.time(), "text": text}).encode()
    internal_kv._internal_kv_put(KV_PREFIX + key, value, overwrite=True, namespace=KV_NAMESPACE)


def unpublish(key: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(KV_PREFIX + key, namespace=KV_NAMESPACE)


class Publisher:
    """Publishes one replica's exposition every `every_s` from a daemon thread (the replica's event
    loop may be busy), and soon after a request ends (`soon`): at once where the last publish is
    `min_gap_s` old, else that long after it, so that many requests ending together publish once
    (an exposition and a GCS write cost a couple of milliseconds of the replica's interpreter);
    `stop` unpublishes."""

    def __init__(self, key: str, metrics: ReplicaMetrics, every_s: float = PUBLISH_EVERY_S,
                 min_gap_s: float = PUBLISH_MIN_GAP_S) -> None:
        self.key, self.metrics, self.every_s, self.min_gap_s = key, metrics, every_s, min_gap_s
        self.published = 0  # publishes made (tests)
        self._stop = threading.Event()
        self._wake = threading.Condition()
        self._due = False  # a request ended since the last publish
        self._last = time.monotonic()
        threading.Thread(target=self._loop, name="metrics-publisher", daemon=True).start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._wake:
                at = self._last + (self.min_gap_s if self._due else self.every_s)
                left = at - time.monotonic()
                if left > 0:
                    self._wake.wait(left)
                    continue
                self._due = False
            self.publish()

    def soon(self) -> None:
        """A request ended: publish within `min_gap_s` (never on the caller's thread)."""
        with self._wake:
            if not self._due:
                self._due = True
                self._wake.notify()

    def publish(self) -> None:
        """Now; a failure (the GCS briefly unreachable, or no Ray at all: a replica built in
        process) waits for the next period, logged at debug level."""
        if self._stop.is_set():
            return
        self._last = time.monotonic()
        try:
            publish(self.key, self.metrics.exposition())
            self.published += 1
        except Exception as e:  # noqa: BLE001
            log.debug("metrics not published (%s); next period", e)

    def stop(self) -> None:
        self._stop.set()
        with self._wake:
            self._wake.notify()
        unpublish(self.key)


def collect_published(now: float | None = None) -> list[str]:
    """Exposition texts of replicas that published within STALE_AFTER_S (older entries: deleted)."""
    from ray.experimental import internal_kv

    now = time.time() if now is None else now
    texts = []
    for key in internal_kv._internal_kv_list(KV_PREFIX, namespace=KV_NAMESPACE):
        raw = internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)
        if raw is None:
            continue
        entry = json.loads(raw)
        if now - entry["ts"] <= STALE_AFTER_S:
            texts.append(entry["text"])
        else:
            internal_kv._internal_kv_del(key, namespace=KV_NAMESPACE)
    return texts


class _Merged:
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def merge_expositions(texts: Sequence[str]) -> str:
    """Sums samples of equal name and labels over several Prometheus text expositions."""
    merged: dict[str, Metric] = {}
    sums: dict[str, dict[tuple, float]] = {}
    for text in texts:
        for fam in text_string_to_metric_families(text):
            if fam.name.endswith("_created"):  # creation timestamps do not add up
                continue
            if fam.name not in merged:
                merged[fam.name] = Metric(fam.name, fam.documentation, fam.type)
                sums[fam.name] = {}
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                sums[fam.name][key] = sums[fam.name].get(key, 0.0) + s.value
    for name, metric in merged.items():
        for (sample, labels), value in sums[name].items():
            metric.add_sample(sample, dict(labels), value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(merged.values()))
    return generate_latest(registry).decode()
