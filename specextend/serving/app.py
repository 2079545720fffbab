"""The Serve application graph: OpenAIIngress -> SpecExtend (target replica + its draft actor, or with
`draft_in_replica` the draft in the replica's process)."""

from __future__ import annotations

from typing import Any, Union

from ray import serve
from ray.serve import Application

from specextend.serving.api import OpenAIIngress
from specextend.serving.replica import SpecExtendReplica
from specextend.serving.settings import MODEL_CPUS, AppSettings

REPLICA_DEPLOYMENT = "SpecExtend"  # the name YAML `deployments:` overrides refer to
CONTROL_HEADROOM = 8  # ongoing-request slots beyond the sessions and queue: health, metrics calls


def replica_options(s: AppSettings) -> dict[str, Any]:
    """One placement group per replica: bundle 0 the target (the replica itself), bundle 1 the
    draft actor, packed on one node; one bundle where the draft runs in the replica (with the
    draft's share of the GPU). Every bundle has a CPU, or the child actor never schedules."""
    gpus = s.replica_gpus
    bundle = {"CPU": MODEL_CPUS, **({"GPU": gpus} if gpus else {})}
    return dict(
        name=REPLICA_DEPLOYMENT,
        ray_actor_options={"num_cpus": MODEL_CPUS, "num_gpus": gpus},
        placement_group_bundles=[dict(bundle) for _ in range(2 if s.uses_draft and not s.draft_here else 1)],
        placement_group_strategy="STRICT_PACK",
        # Admission (sessions, queue, KV memory) is the replica's own, answering 429 in OpenAI's
        # JSON; Serve's router gets room for 4x that so its back-pressure (a plain-text 503 from
        # the proxy) never fires first.
        max_ongoing_requests=4 * (s.max_concurrent_sessions + s.max_queued_requests) + CONTROL_HEADROOM,
        max_queued_requests=-1,
        health_check_period_s=10,
        health_check_timeout_s=60,
        graceful_shutdown_timeout_s=5,
    )


def build_app(settings: Union[AppSettings, dict]) -> Application:
    s = settings if isinstance(settings, AppSettings) else AppSettings.model_validate(settings)
    args = s.model_dump()
    model_args = {k: v for k, v in args.items() if k != "api_key"}  # only the ingress needs the key
    replica = serve.deployment(SpecExtendReplica, **replica_options(s)).bind(model_args)
    return OpenAIIngress.bind(replica, args)
