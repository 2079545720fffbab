"""Application settings: the validated boundary between Serve arguments / YAML and the engine.

The names are the flat names of the configuration tree (config.py, derived by schema.py).
`serve run deploy.app:specextend key=value ...` passes strings; pydantic's lax mode coerces them
("0" -> 0). Unknown, removed and out-of-range names raise pydantic.ValidationError naming the
field, before anything is deployed.
"""

from __future__ import annotations

from typing import Optional

from specextend.config import AppConfig, EngineConfig
from specextend.schema import FlatSettings, flat_model

# Logical CPUs reserved per model actor (target replica, draft actor) and by the ingress: the whole
# app fits a 2-core machine; they are reservations for scheduling, not limits.
MODEL_CPUS = 0.5
INGRESS_CPUS = 0.25


class _AppSettingsBase(FlatSettings):
    def to_engine_config(self) -> EngineConfig:
        return self.to_config().engine

    @property
    def uses_draft(self) -> bool:
        return self.mode in ("sd", "specextend")

    @property
    def gpus_per_replica(self) -> float:
        return self.num_gpus * (2 if self.uses_draft else 1)

    @property
    def draft_here(self) -> bool:
        """The draft runs in the replica's process (draft_in_replica), not in an actor."""
        return bool(self.draft_in_replica) and self.uses_draft

    @property
    def replica_gpus(self) -> float:
        """The replica actor's GPUs: its target's, and its draft's where the draft runs there."""
        return self.num_gpus * (2 if self.draft_here else 1)


# The Serve arguments: the flat view of config.AppConfig (specextend.schema), nothing declared here.
AppSettings = flat_model("AppSettings", AppConfig, "serve", base=_AppSettingsBase)


class InsufficientGPUsError(RuntimeError):
    """The cluster cannot ever place one replica's GPUs (fail fast instead of pending forever)."""


def check_gpus(settings: AppSettings, node_gpus: list[float], autoscaler_max_gpus: Optional[float]) -> None:
    """Raises InsufficientGPUsError unless one node (STRICT_PACK) has the GPUs of a replica.

    node_gpus: GPUs of each alive node; autoscaler_max_gpus: the most GPUs the autoscaler's node
    groups can add (None: no autoscaler), in which case the replica may wait for a new node."""
    need = settings.gpus_per_replica
    if need <= 0 or any(g >= need for g in node_gpus):
        return
    if autoscaler_max_gpus is not None and autoscaler_max_gpus >= need:
        return
    what = "target + draft" if settings.uses_draft else "target"
    have = max(node_gpus, default=0)
    raise InsufficientGPUsError(
        f"num_gpus={settings.num_gpus:g} needs {need:g} GPU(s) on one node "
        f"per replica ({what}), but the Ray cluster's largest node has {have:g} "
        f"(total {sum(node_gpus):g}); replicas would stay pending forever. "
        f"Pass num_gpus=0 to run on CPU, or add GPU nodes.")


def check_cluster_gpus(settings: AppSettings) -> None:
    """check_gpus against the connected Ray cluster (alive nodes + autoscaler node groups)."""
    import ray

    if settings.gpus_per_replica <= 0:
        return
    node_gpus = [float(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")]
    autoscaler = None
    try:
        from ray._private.state import state  # the same source Ray Train and Ray Data use

        limits = state.get_max_resources_from_cluster_config()
        if limits is not None:
            autoscaler = float(limits.get("GPU", 0))
    except Exception:  # noqa: BLE001 - no autoscaler information: judge by the nodes alone
        pass
    check_gpus(settings, node_gpus, autoscaler)
