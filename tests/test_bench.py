"""`specextend bench` on the tiny pair at a tiny size: the table, the JSON record, the plots, the
results page rebuilt from the record; and the benchmark texts."""

import contextlib
import io
import json

import pytest

from specextend.bench import texts
from specextend.cli import main
from specextend.models.tokenizer import build_byte_tokenizer

MODES = ["ar", "sd", "sd-masked", "specextend", "hf", "hf-assisted"]


@pytest.fixture(scope="module")
def e2e_run(tmp_path_factory):
    """One run of the e2e suite (every mode), shared by the tests below."""
    out = tmp_path_factory.mktemp("results")
    argv = ["bench", "--suite", "e2e", "--device", "cpu", "--pair", "tiny=48", "--docs", "python",
            "--new-tokens", "6", "--threads", "1", "--out", str(out)]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(argv) == 0
    return out, argv, stdout.getvalue()


def test_e2e_suite_writes_table_json_and_plots(e2e_run):
    out, argv, stdout = e2e_run
    assert "| pair | L | mode | prompts | decode tok/s | x ar |" in stdout
    for mode in MODES:
        assert f"| tiny | 48 | {mode} | 1 |" in stdout
    record = json.loads((out / "e2e" / "cpu.json").read_text())
    meta = record["meta"]
    assert meta["suite"] == "e2e" and meta["device"] == "cpu" and meta["command"] == "specextend " + " ".join(argv)
    assert meta["commit"] and meta["date"][:2] == "20"
    assert {r["mode"] for r in record["rows"]} == set(MODES)
    for r in record["rows"]:
        assert r["decode_tokens_per_s"] > 0 and r["ttft_s"] > 0 and not r["replayed"]
    spec = [r for r in record["rows"] if r["mode"] in ("sd", "sd-masked", "specextend")]
    assert all(r["num_steps"] > 0 and r["mean_acceptance_length"] >= 1 for r in spec)
    # the engines decode ar's text (its tokens as reference; none overridden in float32 here)
    assert all(r["reference_overrides"] == 0 for r in spec) and "reference_overrides" not in record["rows"][0]
    summary = {s["mode"]: s for s in record["summary"]}
    assert summary["ar"]["x_ar"] == 1.0 and summary["specextend"]["x_ar"] > 0
    # every other mode's output equals ar's or first differs at a near-tie (float32)
    assert {c["mode"] for c in record["checks"]} == set(MODES) - {"ar"}
    assert all(c["near_tie"] for c in record["checks"])
    for kind in ("tokens_per_s", "step_split", "acceptance", "ttft"):
        png = out / "e2e" / f"cpu-{kind}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_rebuilds_the_page_from_the_record(e2e_run, tmp_path):
    from specextend.bench.report import BEGIN, END

    out, _, _ = e2e_run
    page, readme = tmp_path / "README.md", tmp_path / "TOP.md"
    page.write_text(f"# Results\n\nhand-written\n\n{BEGIN}\nold\n{END}\n\nfooter\n")
    readme.write_text(f"## Performance at a glance\n\n{BEGIN}\n{END}\n")
    sweep = out / "overlap" / "2x-gpu.json"  # a standalone script's record: not a section of the page
    sweep.parent.mkdir(exist_ok=True)
    sweep.write_text(json.dumps(dict(meta=dict(suite="overlap_sweep", device="2x GPU", date="2026-11-26"), rows=[])))
    assert main(["bench", "--report", "--out", str(out), "--page", str(page), "--readme", str(readme)]) == 0
    text = page.read_text()
    assert text.startswith("# Results\n\nhand-written") and text.endswith("footer\n") and "\nold\n" not in text
    assert "### e2e: cpu" in text and "| tiny | 48 | specextend | 1 |" in text
    links = [line for line in text.splitlines() if line.startswith("![")]
    assert links and all((page.parent / link.split("](")[1].split(")")[0]).is_file()
                         for line in links for link in line.split(" "))
    assert "**e2e**, cpu" in readme.read_text() and "specextend" in readme.read_text()
    assert "overlap_sweep" not in text


def test_bench_needs_a_suite_or_report(capsys):
    assert main(["bench"]) == 2
    assert "give --suite" in capsys.readouterr().err


@pytest.mark.parametrize("doc", texts.DOCUMENTS, ids=lambda d: d.name)
def test_each_document_gives_a_prompt_of_the_asked_length(doc):
    tok = build_byte_tokenizer()
    ids = texts.prompt_ids(tok, doc, 300)
    body = tok.decode(ids)
    assert doc.question in body and len(ids) > 300
    assert tok.decode(list(texts._document_ids(tok, doc.name, 300))) in body


def test_window_prompts_are_distinct_windows_of_one_document():
    """Concurrent sessions' prompts (benchmarks/batching.py --docs): windows of the asked length,
    apart where the text is long enough, each then the question; one window is prompt_ids."""
    tok = build_byte_tokenizer()
    doc = texts.BY_NAME["python"]
    prompts = texts.window_prompts(tok, doc, 300, 4)
    whole = texts._ids_upto(tok, doc.name, 4 * 300)
    assert len({tuple(p) for p in prompts}) == 4
    for i, p in enumerate(prompts):
        body = tok.decode(p)
        assert doc.question in body and tok.decode(list(whole[i * 300:(i + 1) * 300])) in body
    one = texts.window_prompts(tok, doc, 300, 1)
    assert one == [texts.prompt_ids(tok, doc, 300)]


def test_nodejs_docs_read_plain_or_gzipped_pages(tmp_path, monkeypatch):
    """Debian's nodejs-doc ships the larger pages as .md.gz; a missing page is a clear error."""
    import gzip

    names = ("fs", "stream", "http", "child_process", "buffer", "crypto", "net", "process", "events",
             "worker_threads", "url", "util")
    for i, name in enumerate(names):
        page = f"# {name}\n"
        if i % 2:
            (tmp_path / f"{name}.md.gz").write_bytes(gzip.compress(page.encode()))
        else:
            (tmp_path / f"{name}.md").write_text(page)
    monkeypatch.setenv("SPECEXTEND_NODEJS_DOCS", str(tmp_path))
    assert texts.BY_NAME["nodejs"].text() == "\n\n".join(f"# {n}\n" for n in names)
    (tmp_path / "url.md").unlink()
    with pytest.raises(texts.TextUnavailable, match="apt-get install nodejs-doc"):
        texts.BY_NAME["nodejs"].text()


@pytest.mark.parametrize("args,message", [
    (["--suite", "e2e", "--modes", "ar,warp"], "unknown modes ['warp']"),
    (["--suite", "e2e", "--device", "cpu", "--modes", "ar,sd-2gpu"], "the -2gpu modes need two GPUs"),
    (["--suite", "e2e", "--pair", "huge=1024"], "unknown pair ['huge']"),
    (["--suite", "e2e", "--pair", "tiny"], "give lengths"),
    (["--suite", "kernels", "--pair", "tiny=64", "--pair", "8b=64"], "one --pair at a time"),
    (["--suite", "serve", "--device", "cpu", "--merge"], "only the e2e and sweep suites' rows merge"),
])
def test_bad_bench_arguments_are_one_clear_line(capsys, args, message):
    assert main(["bench", "--device", "cpu", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_unknown_document_fails_before_loading(capsys):
    assert main(["bench", "--suite", "e2e", "--device", "cpu", "--pair", "tiny=64", "--docs", "poems"]) == 2
    assert "unknown documents ['poems']" in capsys.readouterr().err


def test_a_document_not_installed_fails_before_any_model_runs(capsys, monkeypatch, tmp_path):
    """A missing text stops the run at once with how to install it, not after the earlier
    documents' lengths ran (a GPU sweep lost its first minute so: Shakespeare's package absent)."""
    monkeypatch.setenv("SPECEXTEND_NODEJS_DOCS", str(tmp_path))
    assert main(["bench", "--suite", "sweep", "--device", "cpu", "--pair", "tiny=32", "--docs", "python,nodejs",
                 "--modes", "ar", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "apt-get install nodejs-doc" in err and "tiny L=32" not in err


def test_transformers_anchor_matches_plain_decoding_through_an_eos():
    """The anchor runs our weights: greedy `generate` equals `ar` token for token, here through an
    EOS at position 13 that both emit and continue past (ignore_eos), plain and assisted."""
    from specextend.bench import hf
    from specextend.config import EngineConfig, SamplingParams
    from specextend.engine import Engine
    from specextend.models.loader import load_model

    target = load_model("random:llama-tiny", "target", "float32", "cpu")
    draft = load_model("random:llama-tiny-draft", "draft", "float32", "cpu", vocab_size=target.args.vocab_size,
                       target_weights=target.decoder.w)
    prompt = texts.prompt_ids(target.tokenizer, texts.BY_NAME["nodejs"], 1024)
    ar = Engine(EngineConfig(mode="ar", dtype="float32", device="cpu"), target)
    ref, _, _ = ar.generate(prompt, SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert set(ref) & set(target.args.eos_token_ids), "the case needs an EOS inside the output"
    anchors = hf.anchors(target, draft)
    for name, (model, assistant) in anchors.items():
        out, timing = hf.generate(model, prompt, 16, assistant)
        assert out == ref, name
        assert 0 < timing["ttft_s"] and timing["decode_tokens_per_s"] > 0


@pytest.mark.serve
def test_serve_suite_runs_the_app_and_checks_outputs_against_served_ar(tmp_path, capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["bench", "--suite", "serve", "--device", "cpu", "--pair", "tiny=64", "--docs", "python", "--modes",
            "ar,specextend", "--new-tokens", "8", "--port", str(port), "--out", str(tmp_path),
            "--app-args", '{"stream_interval_ms": 0}']
    assert main(argv[:-1] + ['{"stream_interval_ms": -1}']) != 0  # refused before any model loads
    assert "stream_interval_ms" in capsys.readouterr().err
    assert main(argv) == 0
    assert "| tiny | 64 | specextend-cpu | 1 |" in capsys.readouterr().out
    record = json.loads((tmp_path / "serve" / "cpu.json").read_text())
    assert record["meta"]["app_args"] == {"stream_interval_ms": 0}
    # in-process ar first (the served path's cost within one run), then the served modes
    assert [r["mode"] for r in record["rows"]] == ["ar-in-process", "ar", "specextend-cpu"]
    assert all(r["ttft_s"] > 0 for r in record["rows"])
    assert all(r["tokens"] == 8 for r in record["rows"][1:])
    spec = record["rows"][2]
    assert spec["num_steps"] > 0 and spec["mean_acceptance_length"] >= 1 and spec["verify_ms"] > 0
    for row in record["rows"][1:]:  # each app's start-up by phase, read from its /metrics
        phases = [row[f"startup_{p}_s"] for p in ("target", "draft", "warm_up")]
        assert all(p >= 0 for p in phases) and sum(phases) <= row["startup_s"]
    assert spec["startup_draft_s"] + spec["startup_warm_up_s"] > 0
    assert spec["startup_draft_actor_load_s"] > 0 and "startup_draft_actor_load_s" not in record["rows"][1]
    # the served app decoded served ar's text (its reference tokens, never needed on the CPU in float32)
    assert record["checks"] == [dict(pair="tiny", length=64, doc="python", mode="specextend-cpu", identical=True,
                                     near_tie=True, overrides=0, max_gap=0.0)]
    assert spec["reference_overrides"] == 0 and "reference_overrides" not in record["rows"][1]
    assert (tmp_path / "serve" / "cpu-step_split.png").is_file()
    # each app's late work (graph plans, Triton kernels after its warm-up), from its /metrics: none on the
    # CPU; full garbage collections are counted too (kind "gc"), as many as the interpreter makes
    kinds = ("capture", "kernel")
    assert [(w["mode"], {k: w["first"][k] for k in kinds}, {k: w["timed"][k] for k in kinds})
            for w in record["late_work"]] == [
        (m, {"capture": 0.0, "kernel": 0.0}, {"capture": 0.0, "kernel": 0.0}) for m in ("ar", "specextend-cpu")]
    assert all(set(w["first"]) == {"capture", "kernel", "gc"} for w in record["late_work"])
    assert not [line for line in record["late_work_lines"] if not line.split(" x ", 1)[1].startswith("gc ")]


def test_e2e_modes_state_their_retrieval():
    """`sd` is the draft with its full cache, whatever mode the base config was resolved in."""
    from dataclasses import replace

    from specextend.bench.e2e import MODES
    from specextend.config import EngineConfig

    for base_mode in ("specextend", "sd", "ar"):
        base = EngineConfig(target="random:llama-tiny", draft="random:llama-tiny-draft", mode=base_mode)
        for mode in ("sd", "sd-masked", "specextend"):
            r = replace(base, **MODES[mode]).retrieval
            assert r.enabled == (mode == "specextend"), (base_mode, mode)
            assert r.draft_prefill_window == (512 if mode == "specextend" else 0), (base_mode, mode)


def test_signal_suite_has_every_cell_is_lossless_and_really_stresses_the_signal(tmp_path):
    """The signal suite on the tiny pair (draft over gRPC on 127.0.0.1): every point of the asked
    sweeps in the table and the JSON, every output lossless against `ar`, and the faults visible in
    what the draft received (counters, not timing)."""
    from specextend.bench.signal import CPU_GRID, plan

    sweeps = ["late", "drop", "budget"]
    argv = ["bench", "--suite", "signal", "--device", "cpu", "--pair", "tiny=320", "--docs", "python",
            "--sweeps", ",".join(sweeps), "--new-tokens", "24", "--threads", "1", "--out", str(tmp_path)]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(argv) == 0
    record = json.loads((tmp_path / "signal" / "cpu.json").read_text())
    assert record["meta"]["suite"] == "signal" and record["meta"]["sweeps"] == sweeps
    summary = {(s["sweep"], s["value"], s["baseline"]): s for s in record["summary"]}
    points = plan(CPU_GRID, sweeps)
    assert set(summary) == {(sw, v, b) for sw, v, b, _ in points} and len(summary) == len(points)
    for (sweep, value, baseline), s in summary.items():
        shown = "-" if sweep == "nominal" else value
        assert f"| tiny | 320 | {sweep} | {shown} | {baseline} |" in stdout.getvalue()
        assert s["prompts"] == 1 and s["lossless"] == 1
    assert all(c["lossless"] for c in record["cells"] if c["baseline"] != "ar")
    assert {c["baseline"] for c in record["cells"]} == {
        "ar", "retrieval", "recency", "full"}
    nominal, dropped = summary[("nominal", 0, "retrieval")], summary[("drop", 50, "retrieval")]
    assert nominal["updates_dropped"] == 0 and nominal["updates_delivered"] == nominal["updates_updates"] > 2
    assert 0 < dropped["updates_dropped"] and dropped["updates_delivered"] == dropped["updates_updates"] - dropped[
        "updates_dropped"]
    assert dropped["draft_rebuilds"] < nominal["draft_rebuilds"]  # the draft really got fewer selections
    assert summary[("late", 2, "retrieval")]["updates_late"] > 0 == nominal["updates_late"]
    assert summary[("budget", 4, "retrieval")]["draft_cache_tokens"] < summary[("budget", 16, "retrieval")][
        "draft_cache_tokens"]
    assert nominal["signal_bytes_per_step"] > 0 == summary[("nominal", 0, "full")]["signal_bytes_per_step"]
    assert "0 not." in stdout.getvalue()
    assert {p.name for p in (tmp_path / "signal").glob("*.png")} == {f"cpu-{s}.png" for s in sweeps}


def test_prefix_suite_caches_both_sides_and_checks_every_output(tmp_path):
    """The prefix suite on the tiny pair: three questions over 2,100 document tokens (one whole
    prefill chunk of 2,048 to reuse), the cache off then on: the later questions' chunk cached on
    the target and, in `specextend`, on the draft; every output equal to its uncached twin; table,
    JSON, plot and the results page's section."""
    from specextend.bench import report

    argv = ["bench", "--suite", "prefix", "--device", "cpu", "--pair", "tiny=2100", "--modes", "ar,specextend",
            "--new-tokens", "4", "--threads", "1", "--out", str(tmp_path)]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(argv) == 0
    record = json.loads((tmp_path / "prefix" / "cpu.json").read_text())
    rows, summary = record["rows"], {s["mode"]: s for s in record["summary"]}
    assert len(rows) == 12 and set(summary) == {"ar", "specextend"}
    assert all(r["cached_tokens"] == (2048 if r["cache"] and r["question"] > 0 else 0) for r in rows)
    assert all(r["draft_cached_tokens"] == (2048 if r["mode"] == "specextend" and r["cache"] and r["question"] > 0
                                            else 0) for r in rows)
    assert all(s["same_output"] and s["cached_tokens"] == 2048 for s in summary.values())
    assert "| tiny | 2100 | nodejs | specextend | 2048 / 2048 |" in stdout.getvalue()
    assert (tmp_path / "prefix" / "cpu-ttft.png").is_file()
    page = tmp_path / "page.md"
    page.write_text(f"head\n{report.BEGIN}\n{report.END}\n")
    report.write_pages(tmp_path, page, tmp_path / "no-readme.md")
    assert "### prefix: cpu" in page.read_text() and "| tiny | 2100 | nodejs | ar |" in page.read_text()


def test_gil_placements_lower_the_replicas_switch_interval_and_serve_plain_modes_too(monkeypatch):
    """The serve suite's `-gil` A/B (the replica's and draft actor's switch interval, a served setting): on
    one GPU for the modes without a draft (ar and lookup, named apart from their default rows), on
    two for the draft's; every variant's arguments are valid app settings."""
    import torch

    from specextend.bench import serve
    from specextend.serving.settings import AppSettings

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    spread = {name: extra for name, _, _, extra in serve.placements()}
    assert spread["1gpu-gil"] == spread["2gpu-gil"] == {"switch_interval_ms": 0.05}
    assert spread["2gpu-fixed"] == {"tree_policy": "fixed"}  # every tree asked early: the served ask_ms
    assert spread["2gpu-fixed-gil"] == {"tree_policy": "fixed", "switch_interval_ms": 0.05}
    assert serve.placements()[0][0] == "1gpu"  # where ar and lookup are served by default
    assert serve.ALONE == ("1gpu-gil",)
    for extra in spread.values():
        AppSettings.model_validate(extra)
    with pytest.raises(Exception):
        AppSettings.model_validate({"switch_interval_ms": 0})


def test_served_modes_are_the_in_process_modes():
    """The serve suite's `sd` is a modern server's tree SD (HTA, the draft's full cache) and
    `sd-masked` the paper's masked verification, as in process (e2e.MODES): the app resolves each
    mode's arguments to the same verification and retrieval; an unknown mode fails before anything
    loads."""
    from specextend.bench import e2e, serve
    from specextend.config import EngineConfig
    from specextend.serving.settings import AppSettings

    for mode, spec in e2e.MODES.items():
        served = AppSettings.model_validate(serve.mode_args(mode)).to_config().engine
        local = EngineConfig(**spec)
        assert (served.mode, served.hybrid_attention, served.retrieval.enabled) == \
            (local.mode, local.hybrid_attention, local.retrieval.enabled), mode
    assert serve.mode_args("sd")["hybrid_attention"] is True
    with pytest.raises(ValueError, match="unknown mode"):
        serve.mode_args("sd-2gpu")


@pytest.mark.parametrize("doc", texts.documents(list(texts.BY_NAME)), ids=lambda d: d.name)
def test_the_longest_sweep_prompt_and_its_new_tokens_fit_the_8b_context(doc):
    """"128K" is 130,000 document tokens: with the question (the 8B geometry's byte tokenizer: a
    token a byte, an upper bound for the real tokenizers) and the suite's 128 new tokens it fits
    the 131,072 positions of the preset."""
    from specextend.bench.cli import DEFAULTS, LONG
    from specextend.models.presets import PRESETS

    new_tokens = DEFAULTS["sweep"]["gpu"][1]
    question = len(("\n\n" + doc.question).encode())
    assert LONG[-1] == 130_000 and new_tokens == 128
    assert LONG[-1] + question + new_tokens <= PRESETS["llama-3.1-8b"]["max_position_embeddings"]


def test_the_serve_clients_lines_are_whole_whatever_the_reads():
    """bench/serve._lines (the served suite's stream reader, linear in the bytes where requests'
    iter_lines re-splits a long line at every read): every line whole and in order however the
    bytes arrive (a line across reads, several in one read, a last one with no newline, a long one)."""
    from specextend.bench.serve import _lines

    class Response:
        def __init__(self, reads):
            self.reads = reads

        def iter_content(self, chunk_size=None):
            assert chunk_size is None  # whatever has arrived: a fixed size would hold the tokens back
            return iter(self.reads)

    reads = [b"data: {\"a\"", b": 1}\n\ndata: [1, ", b"2]\n", b"\n", b"data: [DONE]", b"\n\nlast"]
    assert list(_lines(Response(reads))) == [b'data: {"a": 1}', b"", b"data: [1, 2]", b"", b"data: [DONE]", b"",
                                             b"last"]
    text = b"data: " + b"1, " * 400_000  # 1.2 MB: a 130K-token prompt's ids, read 512 bytes at a time
    pieces = [text[i:i + 512] for i in range(0, len(text), 512)] + [b"\n\n"]
    assert list(_lines(Response(pieces))) == [text, b""]
