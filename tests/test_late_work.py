"""models/late_work.py: graph plans and Triton kernels met after a process's warm-up are counted,
logged with what they were, and reported; before it they are not logged."""

import logging

import pytest

from specextend.config import SamplingParams, TreeConfig
from specextend.models import late_work
from specextend.models.graphs import StepGraphs
from specextend.warmup import warm_up

from helpers import make_engine
from test_batched_graphs import float32_pair


@pytest.fixture(autouse=True)
def fresh():
    late_work.reset()
    yield
    late_work.reset()


def test_work_is_late_only_after_the_warm_up_and_each_is_logged_and_reported(caplog):
    seen = []
    with caplog.at_level(logging.WARNING, logger="specextend.models.late_work"):
        late_work.record("capture", "during warm-up")
        assert not caplog.records
        late_work.mark_ready(seen.append)
        late_work.record("kernel", "prefix_partials[num_warps=4](M: i32)")
        late_work.record("capture", "ShapeKey(t=9)")
    counts = {k: late_work.counts(late=False)[k] for k in ("capture", "kernel")}  # (a full collection
    assert counts == {"capture": 1, "kernel": 0}  # may come at any time: its own test below)
    assert {k: late_work.counts()[k] for k in ("capture", "kernel")} == {"capture": 1, "kernel": 1}
    assert [k for k in seen if k != "gc"] == ["kernel", "capture"]
    assert [r.getMessage() for r in caplog.records if not r.getMessage().startswith("gc ")] == [
        "kernel after warm-up, on a request's path: prefix_partials[num_warps=4](M: i32)",
        "capture after warm-up, on a request's path: ShapeKey(t=9)"]


def test_a_request_after_the_warm_up_builds_no_plan_and_a_new_shape_is_caught(caplog):
    """The step graphs' plans of a warmed engine (built, not captured, on the CPU: the same keys;
    verifies are graphed with HTA): a request builds none; a tree larger than the warm-up's ladder
    builds its verify's plan late."""
    t, d = float32_pair()
    t.decoder.graphs = StepGraphs(t.decoder, capture=False)
    engine = make_engine((t, d), "sd", tree=TreeConfig(8, 3, 2), prefill_chunk=64, lookup_tokens=0,
                         hybrid_attention=True)
    prompt = list(range(3, 60))
    warm_up(engine, prompt)
    assert late_work.counts(late=False)["capture"] == len(t.decoder.graphs.plans) > 0
    late_work.mark_ready()
    engine.generate(list(range(9, 70)), SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert late_work.counts()["capture"] == 0
    bigger = make_engine((t, d), "sd", tree=TreeConfig(12, 3, 4), prefill_chunk=64, lookup_tokens=0,
                         hybrid_attention=True)
    with caplog.at_level(logging.WARNING, logger="specextend.models.late_work"):
        bigger.generate(prompt, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert late_work.counts()["capture"] > 0
    assert any("StepGraphs" in r.getMessage() and "t=13" in r.getMessage() for r in caplog.records)


def test_the_end_of_warm_up_freezes_what_the_process_holds_and_a_full_collection_after_it_is_late(caplog):
    import gc

    garbage = [[]]
    garbage[0].append(garbage)  # a cycle left by warm-up: collected, not frozen
    del garbage
    seen = []
    late_work.mark_ready(seen.append)
    assert gc.get_freeze_count() > 0
    assert late_work.counts()["gc"] == 0
    with caplog.at_level(logging.WARNING, logger="specextend.models.late_work"):
        gc.collect(1)  # a young collection is not a full one
        gc.collect()
    assert late_work.counts()["gc"] == 1 and seen == ["gc"]
    assert "gc after warm-up, on a request's path: a full collection: " in caplog.records[-1].getMessage()
    late_work.reset()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert late_work.counts()["gc"] == 0  # (reset: not timed any more)


def test_the_triton_hook_counts_compiles_and_leaves_another_hook_alone():
    knobs = pytest.importorskip("triton").knobs
    saved = knobs.runtime.jit_post_compile_hook
    try:
        knobs.runtime.jit_post_compile_hook = None
        assert late_work.install_triton_hook() and late_work.install_triton_hook()  # idempotent
        late_work.mark_ready()
        knobs.runtime.jit_post_compile_hook(key=(), repr="rope_scatter[num_warps=1](T: constexpr)", fn=None,
                                            compile={}, is_manual_warmup=False, already_compiled=False)
        assert late_work.counts()["kernel"] == 1
        knobs.runtime.jit_post_compile_hook = other = lambda **kw: None
        assert not late_work.install_triton_hook() and knobs.runtime.jit_post_compile_hook is other
    finally:
        knobs.runtime.jit_post_compile_hook = saved


def test_the_serve_suite_finds_every_process_s_late_lines_in_the_ray_session_logs(tmp_path, monkeypatch):
    import types

    import ray._private.worker as rw

    from specextend.bench.serve import late_work_lines

    logs = tmp_path / "logs" / "serve"
    logs.mkdir(parents=True)
    line = "capture after warm-up, on a request's path: StepGraphs of a 24-layer model: ShapeKey(t=9)"
    (logs / "replica_bench.log").write_text(f"WARNING 2026-11-27 07:00:01 pid=7 late_work.py:41 -- {line}\nok\n")
    (tmp_path / "logs" / "worker-1.err").write_text(
        f"WARNING 07:00:02 {line}\n:actor_name:DraftActor\n"
        "W 07:00:03 kernel after warm-up, on a request's path: tree_combine[num_warps=4](T: constexpr = 9)\n"
        f"{line}\n")
    (tmp_path / "logs" / "raylet.bin").write_bytes(line.encode())  # not a log file
    monkeypatch.setattr(rw, "_global_node", types.SimpleNamespace(get_session_dir_path=lambda: str(tmp_path)),
                        raising=False)
    assert late_work_lines() == [f"3 x {line}", "1 x kernel after warm-up, on a request's path: "
                                                  "tree_combine[num_warps=4](T: constexpr = 9)"]


@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_prompts_last_chunk_runs_eagerly_whatever_its_length(role):
    """A prompt's last prefill chunk (after the first) has any length up to the graphs' largest:
    replayed as a graph, each new length was a capture on the request's path (two H200s,
    2026-11-27: captures of 46, 47 and 49 tokens, the 16K prompts' remainders past 2048-token
    chunks). Prefill chunks run eagerly, on the target and on the draft."""
    from specextend.models.full_graphs import FullStepGraphs

    t, d = float32_pair()
    model = (t if role == "target" else d).decoder
    model.graphs = FullStepGraphs(model, capture=False)
    from specextend.draft.worker import DraftWorker

    engine = make_engine((t, d), "sd", draft_backend=DraftWorker(d.decoder, prefill_chunk=64), tree=TreeConfig(8, 3, 2),
                         prefill_chunk=64, lookup_tokens=0, hybrid_attention=True)
    warm_up(engine, list(range(3, 60)))
    late_work.mark_ready()
    for rest in (9, 23, 46):  # prompts of 64 + rest tokens: a last chunk of `rest`
        engine.generate(list(range(5, 5 + 64 + rest)), SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert late_work.counts()["capture"] == 0
    model.graphs = None


def test_mode_lookup_warms_every_chain_size():
    """mode=lookup: the warm-up verifies a chain of every size once (each its own graph), so chains
    met later build no plan."""
    from specextend.config import EngineConfig
    from specextend.engine import Engine
    from specextend.models.full_graphs import FullStepGraphs

    t, _ = float32_pair()
    t.decoder.graphs = FullStepGraphs(t.decoder, capture=False)
    engine = Engine(EngineConfig(mode="lookup", lookup_tokens=6, prefill_chunk=64), t)
    warm_up(engine, list(range(3, 60)))
    assert {k.t for k in t.decoder.graphs.plans} >= set(range(1, 8))  # a plain step, chains of 1..6
    late_work.mark_ready()
    looked = 0
    for start in (5, 17):  # prompts that repeat themselves: the index finds chains
        ids = [start + (i % 23) for i in range(120)]
        looked += engine.generate(ids, SamplingParams(max_new_tokens=24, ignore_eos=True))[2].lookup_steps
    assert looked > 0 and late_work.counts()["capture"] == 0
    t.decoder.graphs = None
