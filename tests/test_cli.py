"""The command line on the tiny pair: JSON output, trace record/replay, clear errors."""

import json
import subprocess
import sys

import pytest

from specextend.cli import main

TINY = ["--target", "random:llama-tiny", "--draft", "random:llama-tiny-draft", "--dtype", "float64"]


def run_json(capsys, *args):
    assert main(["generate", *TINY, "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_json_sd_equals_ar(capsys):
    common = ["--prompt", "The quick brown fox", "--max-new-tokens", "24", "--ignore-eos"]
    ar = run_json(capsys, "--mode", "ar", *common)
    for mode in ("sd", "specextend"):
        out = run_json(capsys, "--mode", mode, *common, "--tree-nodes", "10", "--tree-depth", "4")
        assert out["token_ids"] == ar["token_ids"]
        assert out["num_generated"] == 24 and out["num_steps"] > 0
        for key in ("text", "mean_acceptance_length", "prefill_s", "decode_s", "tokens_per_s",
                    "retrieval_refreshes", "draft_cache_tokens", "fallback"):
            assert key in out


def test_record_and_replay_trace(capsys, tmp_path):
    trace = tmp_path / "trace.json"
    common = ["--prompt", "abc" * 10, "--max-new-tokens", "30", "--ignore-eos", "--tree-depth", "4"]
    rec = run_json(capsys, "--record-trace", str(trace), "--tree-policy", "fixed", *common)  # (every step a tree)
    saved = json.loads(trace.read_text())
    assert saved["accepted_per_step"] and len(saved["accepted_per_step"]) == rec["num_steps"]
    (tmp_path / "forced.json").write_text(json.dumps({"accepted_per_step": [3]}))
    # every step the full tree (depth 4): under the adaptive policy which steps verify a tree, and how
    # large, depends on measured times, and a replayed step accepts no more than its tree's best
    # branch is deep (a 4-node rung may stop at depth 2: one fresh-clone CI run read a mean of 3.5)
    rep = run_json(capsys, "--replay-trace", str(tmp_path / "forced.json"), "--tree-policy", "fixed", *common)
    assert rep["replayed"] and rep["mean_acceptance_length"] == 4.0
    # ...and no deeper than the best branch of the tree verified
    small = run_json(capsys, "--replay-trace", str(tmp_path / "forced.json"), "--tree-policy", "fixed",
                     "--tree-nodes", "1", *common)
    assert small["replayed"] and small["mean_acceptance_length"] == 2.0


@pytest.mark.parametrize("args,message", [
    (["--prompt-file", "/no/such/file"], "prompt file not found"),
    (["--prompt", "x", "--draft", "./missing-model"], "model path not found"),
    (["--prompt", "x" * 9000], "the limit is"),
    (["--prompt", "x", "--tree-depth", "0"], "tree_depth: Input should be greater than or equal to 1"),
    (["--prompt", "x", "--replay-trace", "/no/trace.json"], "cannot read trace"),
])
def test_bad_input_is_one_clear_line(capsys, args, message):
    base = [a for a in TINY]
    if "--draft" in args:
        base = base[:2] + base[4:]
    assert main(["generate", *base, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_console_script_exits_non_zero():
    r = subprocess.run([sys.executable, "-m", "specextend.cli", "generate", "--prompt"], capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr


def test_tokenizer_mismatch_is_refused(tiny_models):
    from types import SimpleNamespace

    from specextend.builder import IncompatibleModels, check_pair

    target, draft = tiny_models("float64")
    other = SimpleNamespace(get_vocab=lambda: {"a": 0})
    with pytest.raises(IncompatibleModels, match="tokenizer mismatch"):
        check_pair(target, SimpleNamespace(name="other", tokenizer=other, args=draft.args))
    check_pair(target, draft)
