"""Where a draft actor's spawn goes (issue 17's start time; docs/architecture.md, "Deployment"): the
seconds from a Ray actor's creation to its constructor, and to its first answer, for an empty actor
(CPU, then one GPU), for one that also imports what the draft actor's module imports, torch and
a CUDA context, and for an empty one created by another actor (the replica's shape: `nested`, in a
placement group of two bundles or not), idle or working `--busy` seconds of Python after creating
it. Prints one line per kind and writes JSON with --json.

    python benchmarks/actor_spawn.py [--gpus 1] [--reps 2] [--json out.json]
    python benchmarks/actor_spawn.py --draft-actor [--gpus 0] [--dtype float32]  # its spawn, load, warm-up

The served two-GPU apps recorded 13-15 s of `draft_actor_spawn` on two H100s (2026-11-28, run U)."""

from __future__ import annotations

import argparse
import json
import time

import ray


class Empty:
    def __init__(self, created: float) -> None:
        self.started = time.time() - created

    def ready(self) -> float:
        return self.started


class Heavy(Empty):
    def __init__(self, created: float) -> None:
        super().__init__(created)
        t = time.time()
        import specextend.serving.draft_actor  # noqa: F401 - what the draft actor's module imports
        import torch

        self.imports = time.time() - t
        t = time.time()
        if torch.cuda.is_available():
            torch.zeros(1, device="cuda")  # the CUDA context
        self.cuda = time.time() - t

    def ready(self) -> dict:
        return dict(spawn_s=self.started, imports_s=self.imports, cuda_s=self.cuda)


class Parent:
    """A replica's shape: it creates the child actor (in its own placement group's second bundle,
    when it has one) as its constructor's first thing, then works `busy_s` seconds of pure Python
    (the replica's imports and the target's load hold the interpreter lock meanwhile)."""

    def spawn_child(self, num_gpus: float, busy_s: float) -> dict:
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = get_current_placement_group()
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=1) if pg else None
        created = time.time()
        child = ray.remote(Empty).options(num_cpus=1, num_gpus=num_gpus, scheduling_strategy=strategy).remote(created)
        t = time.time()
        while time.time() - t < busy_s:  # the interpreter lock held, as by imports and loading
            sum(range(1000))
        started = ray.get(child.ready.remote())
        out = dict(spawn_s=started, first_answer_s=time.time() - created, busy_s=busy_s, placement_group=pg is not None)
        ray.kill(child)
        return out


def nested(num_gpus: float, busy_s: float, in_pg: bool) -> dict:
    """The child's spawn when a Parent creates it (in a placement group of two bundles or not)."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg, opts = None, {}
    if in_pg:
        pg = placement_group([{"CPU": 1, "GPU": num_gpus} if num_gpus else {"CPU": 1}] * 2)
        ray.get(pg.ready())
        opts = dict(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0,
                                                                         placement_group_capture_child_tasks=False))
    parent = ray.remote(Parent).options(num_cpus=1, num_gpus=num_gpus, **opts).remote()
    out = ray.get(parent.spawn_child.remote(num_gpus, busy_s))
    ray.kill(parent)
    if pg is not None:
        remove_placement_group(pg)
    return out


def draft_actor(num_gpus: float, dtype: str) -> dict:
    """The draft actor itself, on the default pair (the model cache warm), created from the driver."""
    from specextend.config import EngineConfig
    from specextend.serving.draft_actor import DraftActor

    cfg = EngineConfig(device="cuda" if num_gpus else "cpu", dtype=dtype)
    created = time.time()
    actor = ray.remote(DraftActor).options(num_cpus=1, num_gpus=num_gpus).remote(cfg, "token", step_transport="zmq")
    st = ray.get(actor.info.remote(), timeout=900)["startup"]
    out = dict(spawn_s=st["started_at"] - created, load_s=st["load_s"], warm_up_s=st["warm_up_s"],
               first_answer_s=time.time() - created)
    ray.kill(actor)
    return out


def spawn(cls, num_gpus: float) -> dict:
    created = time.time()
    actor = ray.remote(cls).options(num_cpus=1, num_gpus=num_gpus).remote(created)
    out = ray.get(actor.ready.remote())
    total = time.time() - created
    ray.kill(actor)
    out = out if isinstance(out, dict) else dict(spawn_s=out)
    return dict(out, first_answer_s=total)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=float, default=1.0, help="num_gpus of the GPU kinds (0: CPU only)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--busy", type=float, default=5.0, help="seconds the parent works after creating its child")
    ap.add_argument("--draft-actor", action="store_true", help="the draft actor on the default pair instead")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json")
    args = ap.parse_args()
    t = time.time()
    ray.init(include_dashboard=False, log_to_driver=False)
    rows = [dict(kind="ray.init", first_answer_s=time.time() - t)]
    kinds = [("empty-cpu", Empty, 0.0), ("heavy-cpu", Heavy, 0.0)]
    if args.gpus:
        kinds += [("empty-gpu", Empty, args.gpus), ("heavy-gpu", Heavy, args.gpus)]
    gpus = args.gpus or 0.0
    if args.draft_actor:
        kinds = []
    for rep in range(args.reps):
        if args.draft_actor:
            rows.append(dict(kind="draft-actor", rep=rep, **draft_actor(gpus, args.dtype)))
            continue
        for name, cls, g in kinds:
            rows.append(dict(kind=name, rep=rep, **spawn(cls, g)))
        for busy in (0.0, args.busy):
            for in_pg in (False, True):
                rows.append(dict(kind=f"nested{'-pg' if in_pg else ''}", rep=rep, **nested(gpus, busy, in_pg)))
    for r in rows:
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, date=time.strftime("%Y-%m-%d %H:%M")), f, indent=1)
    ray.shutdown()


if __name__ == "__main__":
    main()
