"""The served application under test (the `serve` suite): the real Ray Serve app (target replica,
its draft actor, gRPC between them) started locally once per mode and placement, streaming
requests over HTTP at each input length (docs/architecture.md, "Deployment").

Placements: on one GPU (`num_gpus=0.5`: the target and the draft share it) and on two
(`num_gpus=1`: the draft on its own GPU, with overlapped drafting, `2gpu`, the same with unready
steps waiting for a drafted tree, `2gpu-wait`, and without overlap, `2gpu-serial`), as the machine
allows (`--placements` picks some); on the CPU, `num_gpus=0`. Tokens/s, time to first token and the per-step split come from
the client's clock and each response's `speculative_decoding` object. Random-weight pairs accept
a constant replayed length (`replay_accept_length`), labelled "replayed". Other pairs' outputs
are compared with served `ar`'s token for token; where they differ, or where ar's tokens (the
reference every app decodes) overrode the target's choice beyond one rounding step, the target is
loaded in this process once the apps are gone and the first difference and those overrides are
checked by the near-tie rule (near_tie.reference_check), as the in-process suites do.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Iterator, Optional, Sequence

import requests
import torch

from specextend.bench.app_wait import wait_ready
from specextend.bench.e2e import PAIRS, TIE_TOLERANCE, kinds_line, summarize
from specextend.near_tie import all_within_rounding, overrides_of
from specextend.bench.texts import documents, prompt_ids

GIL = {"switch_interval_ms": 0.05}  # the `-gil` placements' switch interval, replica and draft actor (0.2 ms before
#                                    2026-11-27's run P, and the replica's only)
ALONE = ("1gpu-gil",)  # placements of the modes without a draft only (ar, lookup), where named
REPLAY_ACCEPT = 3  # accepted draft tokens per step for random-weight pairs (real pairs' traces: 2-6)


def placements() -> list[tuple[str, float, bool, dict]]:
    """(name, num_gpus, draft_overlap, more app arguments): on two GPUs the draft runs with overlap
    (an unready step decoding plainly, the default, or waiting for a drafted tree: `2gpu-wait`) and
    without; `-nolookup`: context lookup off (the app's default: chains of 8 tokens); `-nohandover`:
    the draft's thread not waiting for an answer to be sent before its next work; `-notell`: plain
    steps' tokens sent with the next tree's call, not at once; `-noearly`: a tree step's verdict sent with
    the next step's call, not as soon as it is known; `-snap`: trees walked from pool snapshots; `-gil`: the
    replica's and the draft actor's interpreter switch interval at 0.05 ms (GIL) instead of 5 and 0.2;
    `-fixed`: a tree every step, each asked early (the served `ask_ms`; `-fixed-gil`: with GIL too); `-prep`: the
    draft prepares trees for the likeliest verdicts (`draft_prepare`); `-rows16`: 16 pool nodes a background
    forward (`draft_overlap_rows`, 8 by default); `1gpu-replica`: the draft in the replica's process on the
    same GPU, overlapped on a stream of its own (`draft_in_replica`; `1gpu-replica-serial`: drafting only
    when asked, no thread of its own beside the target's). `ar` and `lookup` are served on the first,
    and on `1gpu-gil` (theirs alone: ALONE) where it is named."""
    gpus = torch.cuda.device_count()
    nolookup = {"lookup_tokens": 0}
    if gpus == 0:
        return [("cpu", 0.0, False, {})]
    two = [("2gpu", 1.0, True, {}), ("2gpu-wait", 1.0, True, {"overlap_miss": "draft"}),
           ("2gpu-serial", 1.0, False, {}), ("2gpu-nolookup", 1.0, True, nolookup),
           ("2gpu-nohandover", 1.0, True, {"draft_handover": False}),
           ("2gpu-notell", 1.0, True, {"draft_tell": False}),
           ("2gpu-noearly", 1.0, True, {"draft_ask_early": False}),
           ("2gpu-snap", 1.0, True, {"draft_snapshots": "on"}),
           ("2gpu-asks", 1.0, True, {"draft_snapshots": "off"}), ("2gpu-gil", 1.0, True, GIL),
           ("2gpu-fixed", 1.0, True, {"tree_policy": "fixed"}),
           ("2gpu-fixed-gil", 1.0, True, {"tree_policy": "fixed", **GIL}),
           ("2gpu-prep", 1.0, True, {"draft_prepare": True}),
           ("2gpu-fixed-prep", 1.0, True, {"tree_policy": "fixed", "draft_prepare": True}),
           ("2gpu-fixed-rows16", 1.0, True, {"tree_policy": "fixed", "draft_overlap_rows": 16})] if gpus >= 2 else []
    here = {"draft_in_replica": True}
    return [("1gpu", 0.5, False, {}), ("1gpu-replica", 0.5, True, here),
            ("1gpu-replica-serial", 0.5, False, here), ("1gpu-nolookup", 0.5, False, nolookup),
            ("1gpu-gil", 0.5, False, GIL)] + two


def mode_args(mode: str) -> dict:
    """The app arguments of a bench mode (e2e.MODES: `sd` with HTA and the draft's full cache, a
    modern server's; `sd-masked` the SpecExtend paper's masked verification), validated."""
    from specextend.bench.e2e import MODES
    from specextend.serving.settings import AppSettings

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} for the serve suite (one of {', '.join(MODES)})")
    spec = MODES[mode]
    args = dict(mode=spec["mode"])
    if spec.get("hybrid_attention") is not None:
        args["hybrid_attention"] = spec["hybrid_attention"]
    if "retrieval" in spec:
        args["retrieval"] = bool(spec["retrieval"].enabled)
    AppSettings.model_validate(args)
    return args


def metric_families(url: str):
    """The app's /metrics, parsed (prometheus_client's families)."""
    from prometheus_client.parser import text_string_to_metric_families

    return text_string_to_metric_families(requests.get(url + "/metrics", timeout=30).text)


def startup_phases(url: str, timeout_s: float = 15.0) -> dict:
    """The replica's start-up by phase from /metrics (specextend_replica_startup_seconds, and its draft
    actor's, specextend_draft_actor_startup_seconds), once the one replica of the app has published
    it (every 2 s); {} if it has not within timeout_s."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        values = {}
        for fam in metric_families(url):
            for sample in fam.samples:
                if fam.name == "specextend_replica_starts":
                    values["starts"] = sample.value
                elif fam.name == "specextend_replica_startup_seconds":
                    values[f"startup_{sample.labels['phase']}_s"] = sample.value
                elif fam.name == "specextend_draft_actor_startup_seconds":
                    values[f"startup_draft_actor_{sample.labels['phase']}_s"] = sample.value
        if values.pop("starts", 0) == 1:
            return values
        time.sleep(0.5)
    return {}


def late_work(url: str) -> dict:
    """The replica's late work so far (specextend_late_work by kind: graph plans and Triton kernels
    met after its warm-up, models/late_work.py), read once its next publication has passed."""
    from specextend.serving.metrics import PUBLISH_EVERY_S

    time.sleep(PUBLISH_EVERY_S + 0.5)
    return {s.labels["kind"]: s.value for fam in metric_families(url) if fam.name == "specextend_late_work"
            for s in fam.samples}


def late_work_lines(limit: int = 40) -> list[str]:
    """The late-work lines (models/late_work.py) every process of this Ray session logged (the
    replicas and the draft actors), each once with its count, most frequent first."""
    from collections import Counter
    from pathlib import Path

    from specextend.models.late_work import MARK

    try:
        import ray._private.worker as rw

        logs = Path(rw._global_node.get_session_dir_path()) / "logs"
    except Exception:  # noqa: BLE001 - a private API: the default session folder instead
        logs = Path("/tmp/ray/session_latest/logs")
    pattern = re.compile(r"(?:capture|kernel|gc) " + re.escape(MARK) + r": .{0,300}")
    seen: Counter = Counter()
    for path in logs.rglob("*"):
        if path.is_file() and path.suffix in (".err", ".out", ".log"):
            with open(path, errors="replace") as f:
                seen.update(m.group(0) for line in f if MARK in line and (m := pattern.search(line)))
    return [f"{n} x {line}" for line, n in seen.most_common(limit)]


def tie_tolerance() -> float:
    """The near-tie tolerance of the apps' target dtype (auto: bfloat16 on a GPU, float32 on the CPU)."""
    return TIE_TOLERANCE[torch.bfloat16 if torch.cuda.is_available() else torch.float32]


def _lines(response) -> Iterator[bytes]:
    """The response's lines as they arrive, in time linear in its bytes. (requests' iter_lines
    re-splits its whole pending text at every 512-byte read: quadratic in a line's length, ~0.3 s
    of client time for the first chunk of a 130K-token prompt's ids, which then read as time to
    the first token and the tokens after it as arriving at once.)"""
    parts: list[bytes] = []
    for data in response.iter_content(chunk_size=None):  # whatever has arrived
        if b"\n" not in data:
            parts.append(data)
            continue
        head, *mid, tail = data.split(b"\n")
        yield b"".join(parts) + head
        yield from mid
        parts = [tail]
    if any(parts):
        yield b"".join(parts)


def one_request(url: str, model: str, prompt: list[int], max_tokens: int,
                reference: Optional[list[int]] = None) -> dict:
    """One streamed completion: client-side tokens/s and TTFT, the server's per-step split;
    `reference`: the tokens every step emits where the target's choice differs (served ar's)."""
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, stream=True,
                stream_options={"include_usage": True}, return_token_ids=True)
    if reference is not None:
        body["speculative_decoding"] = {"reference_token_ids": reference}
    t0 = time.perf_counter()
    ttft, spec, ids = None, {}, []
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=1800) as r:
        r.raise_for_status()
        for line in _lines(r):
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                got = choice.get("token_ids") or []
                if ttft is None and got:
                    ttft = time.perf_counter() - t0
                ids += got
            spec = chunk.get("speculative_decoding") or spec
    wall = time.perf_counter() - t0
    ttft, n = ttft or wall, len(ids)
    out = dict(token_ids=ids, tokens=n, tokens_per_s=n / wall, decode_tokens_per_s=(n - 1) / max(wall - ttft, 1e-9), ttft_s=ttft)
    steps = spec.get("num_steps") or 0
    if steps:
        # the split of an average step (plain ones included): the server's figures are per step that
        # verified a tree (verify) or asked for one (wait, transport), so they are scaled to all steps
        unready = spec.get("unready_steps") or 0
        total = steps + (spec.get("plain_steps") or 0) + unready + (spec.get("open_steps") or 0)
        asked = (steps + unready) / total
        wait = spec.get("target_wait_ms_per_step", 0.0) * asked
        verify = spec.get("verify_ms_per_step", 0.0) * steps / total
        step_ms = 1e3 * (wall - ttft) / total
        out.update(mean_acceptance_length=spec.get("mean_acceptance_length", 1.0), num_steps=steps,
                   step_ms=step_ms, draft_wait_ms=wait, verify_ms=verify, other_ms=max(step_ms - wait - verify, 0.0),
                   tree_ready_fraction=spec.get("tree_ready_fraction", 0.0), unready_steps=spec.get("unready_steps", 0),
                   transport_ms=spec.get("transport_ms_per_step", 0.0) * asked,
                   draft_queue_ms=spec.get("draft_queue_ms_per_step", 0.0) * asked,
                   prepared_fraction=spec.get("prepared_fraction", 0.0), plain_steps=spec.get("plain_steps", 0),
                   lookup_steps=spec.get("lookup_steps", 0), lookup_accepted=spec.get("lookup_accepted", 0),
                   told_steps=spec.get("told_steps", 0), asked_steps=spec.get("asked_steps", 0),
                   snapshot_trees=spec.get("snapshot_trees", 0), open_steps=spec.get("open_steps", 0),
                   draft_ahead_depth=spec.get("draft_ahead_depth", 0.0), mean_tree_nodes=spec.get("mean_tree_nodes", 0.0),
                   probe_steps=spec.get("probe_steps", 0))
    if "reference_overrides" in spec:
        out.update(reference_overrides=spec["reference_overrides"], reference_max_gap=spec["reference_max_gap"],
                   reference_max_gap_steps=spec.get("reference_max_gap_steps"),
                   reference_override_at=spec.get("reference_override_at"))
    out.update(max_step_ms=spec.get("max_step_ms", 0.0), step_kinds=spec.get("step_kinds", {}),  # every mode
               ahead_steps=spec.get("ahead_steps", 0),
               predicted_tok_per_s=spec.get("predicted_tok_per_s", {}), ask_ms=spec.get("ask_ms", {}),
               phase_ms=spec.get("phase_ms", {}),
               draft_open_ms=spec.get("draft_open_ms", 0.0), target_prefill_ms=spec.get("target_prefill_ms", 0.0))
    return out


def run(pairs: dict[str, list[int]], modes: list[str], new_tokens: int, docs: dict[str, list[str]], port: int = 8000,
        progress=print, tree_policy: str = "fixed", app_args: dict | None = None,
        only: Optional[Sequence[str]] = None) -> dict:
    """Every mode served on each placement (`only`: those named; `ar` on the first always)."""
    from specextend.serving.settings import AppSettings

    AppSettings.model_validate(app_args or {})  # a bad argument fails here, not inside Serve
    by_mode = {mode: mode_args(mode) for mode in modes}  # (and a bad mode)
    rows = _in_process_ar(pairs, modes, new_tokens, docs, tree_policy, progress)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from deploy.app import specextend
    from specextend.models.loader import read_meta

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    checks, refs, differing, late_log, late_lines = [], {}, [], [], []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        for pair_name, lengths in pairs.items():
            pair = PAIRS[pair_name]
            tokenizer = read_meta(pair.target, "target").tokenizer
            for mode in modes:
                alone = mode in ("ar", "lookup")  # no draft: served as `ar` is, by its mode's name
                spread = ([p for i, p in enumerate(placements()) if i == 0 or (only and p[0] in only and p[0] in ALONE)]
                          if alone else [p for p in placements() if (not only or p[0] in only) and p[0] not in ALONE])
                for where, gpus, overlap, extra in spread:
                    # (every request prefills its whole prompt: the prefix cache has its own suite)
                    args = dict(target=pair.target, draft=pair.draft, num_gpus=gpus, tree_policy=tree_policy,
                                draft_overlap=overlap, benchmark_references=True,
                                prefix_cache_gb=0) | by_mode[mode] | extra | (app_args or {})
                    if pair.replayed and not alone:
                        args["replay_accept_length"] = REPLAY_ACCEPT
                    t0 = time.perf_counter()
                    serve.run(specextend(args), name="bench", blocking=False)
                    wait_ready(url, 1800, progress=progress)
                    startup = time.perf_counter() - t0
                    phases = startup_phases(url)
                    progress(f"served {mode} ({where}) ready in {startup:.1f} s: "
                             + ", ".join(f"{k[8:-2]} {v:.1f} s" for k, v in phases.items()))
                    model = requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
                    name = mode if alone and where == placements()[0][0] else f"{mode}-{where}"
                    warm, late_first = False, {}
                    for length in lengths:
                        for doc in documents(docs[pair_name]):
                            prompt = prompt_ids(tokenizer, doc, length)
                            if not warm:  # the app's first long request pays one-off costs: not timed
                                first = one_request(url, model, prompt, 16)
                                late_first = late_work(url)
                                progress(f"served {name}: first request (untimed) {first['decode_tokens_per_s']:.1f} "
                                         f"decode tok/s, TTFT {first['ttft_s']:.3f} s, late work {late_first}"
                                         + kinds_line(first))  # (its steps: the costs the next requests start from)
                                warm = True
                            key = (pair_name, length, doc.name)
                            # every app decodes served ar's text: its outputs part from ar's only at
                            # near-ties, where the text, and so the speed, would differ (verify.Reference)
                            reference = refs.get(key) if name != "ar" and not pair.replayed else None
                            r = one_request(url, model, prompt, new_tokens, reference)
                            ids = r.pop("token_ids")
                            if name == "ar":
                                refs[key] = ids
                            elif key in refs and not pair.replayed:
                                same = ids == refs[key]  # served greedy output against served ar's
                                overrides = overrides_of(r)  # where the reference overrode it: [position, gap, steps, token]
                                near = all_within_rounding(overrides, tie_tolerance())
                                checks.append(dict(pair=pair_name, length=length, doc=doc.name, mode=name,
                                                   identical=same and not overrides, near_tie=same and near,
                                                   overrides=r.get("reference_overrides", 0),
                                                   max_gap=r.get("reference_max_gap") or 0.0))
                                if not (same and near):  # settled by the near-tie rule once the apps are gone
                                    differing.append((checks[-1], pair, prompt, refs[key], ids, overrides))
                            rows.append(dict(pair=pair_name, length=length, prompt_tokens=len(prompt), doc=doc.name,
                                             mode=name, replayed=pair.replayed and not alone,
                                             startup_s=startup, **phases, **r))
                            progress(f"served {pair_name} L={length} {doc.name} {name}: "
                                     f"{r['decode_tokens_per_s']:.1f} decode tok/s, TTFT {r['ttft_s']:.3f} s"
                                     + kinds_line(r) + (f"; ar's tokens overrode {r['reference_overrides']} (gap "
                                                        f"<= {r['reference_max_gap']:.3f})" if r.get("reference_overrides") else ""))
                    late = late_work(url)
                    late_log.append(dict(mode=name, first=late_first, timed={k: v - late_first.get(k, 0.0)
                                                                             for k, v in late.items()}))
                    progress(f"served {name}: late work in the timed requests {late_log[-1]['timed']}")
                    serve.delete("bench")
        late_lines = late_work_lines()  # what the processes logged, named
        for line in late_lines:
            progress(f"late work: {line}")
    finally:
        serve.shutdown()
        ray.shutdown()
    _settle(differing, progress)
    return dict(rows=rows, checks=checks, summary=summarize(rows), late_work=late_log,
                late_work_lines=late_lines)


def _in_process_ar(pairs, modes, new_tokens, docs, tree_policy, progress) -> list[dict]:
    """`ar` in this process on the same prompts first (mode `ar-in-process`), so that the served
    path's own cost is a ratio within one run (its x ar column is in-process over served `ar`):
    two runs of the same in-process `ar` minutes apart differed by 7% on one host."""
    if "ar" not in modes:
        return []
    from specextend.bench import e2e

    device = "cuda" if torch.cuda.is_available() else "cpu"  # where the served app runs
    result = e2e.run(pairs, ["ar"], new_tokens, docs, "auto", tree_policy, device, progress=progress)
    for r in result["rows"]:
        r["mode"] = "ar-in-process"
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result["rows"]


def _settle(differing: list, progress=print, loaded: Optional[dict] = None) -> None:
    """Checks each served output that differs from served `ar`'s, or whose reference overrides
    ([position, gap, steps, token] each, near_tie.overrides_of) are not all within one rounding step,
    by the near-tie rule (near_tie.reference_check: an override beyond a step is settled by the two
    tokens' float32 logits against the target's rounding noise there), with its target loaded here (the GPU memory of
    the apps is free again; `loaded`: decoders by target name already at hand)."""
    from specextend.config import EngineConfig
    from specextend.models.loader import load_model
    from specextend.near_tie import check_line, reference_check
    from specextend.builder import read_pair

    loaded = {} if loaded is None else loaded
    for check, pair, prompt, ref, ids, overrides in differing:
        if pair.target not in loaded:
            loaded.clear()  # one target at a time
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
            meta, _ = read_pair(EngineConfig(target=pair.target, draft=pair.draft, device=device))
            loaded[pair.target] = load_model(meta, "target", "auto", device).decoder
        decoder = loaded[pair.target]
        check.update(reference_check(decoder, prompt, ref, ids, overrides, TIE_TOLERANCE.get(decoder.dtype, 0.125)))
        progress(f"served {check['pair']} L={check['length']} {check['doc']} {check['mode']}: {check_line(check)}")
