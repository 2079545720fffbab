"""What a benchmark run records (specextend.bench.record): the commit it names, and a grid run in
parts (`--merge`) kept as one record, shown on the results page."""

import json

from specextend.cli import main


def test_a_sweep_run_in_parts_merges_into_one_record(tmp_path, capsys):
    """`--merge`: a second part (another length, and one length again) adds its rows to the first's
    record and replaces the rows it ran again; the summary, table and meta cover both parts; a part
    that measures something else (another tree policy's file is another record; new tokens differ)
    is refused."""
    def sweep(lengths, *more, tokens="4"):
        return main(["bench", "--suite", "sweep", "--device", "cpu", "--docs", "python", "--modes", "ar,specextend",
                     "--new-tokens", tokens, "--threads", "1", "--out", str(tmp_path), "--pair", f"tiny={lengths}", *more])

    assert sweep("32,48") == 0
    path = tmp_path / "sweep" / "cpu.json"
    first = json.loads(path.read_text())
    capsys.readouterr()
    assert sweep("48,64", "--merge") == 0
    merged = json.loads(path.read_text())
    keys = sorted((r["length"], r["mode"]) for r in merged["rows"])
    assert keys == [(L, m) for L in (32, 48, 64) for m in ("ar", "specextend")]
    assert [r for r in merged["rows"] if r["length"] == 32] == [r for r in first["rows"] if r["length"] == 32]
    rerun = {r["mode"]: r["ttft_s"] for r in merged["rows"] if r["length"] == 48}
    assert rerun != {r["mode"]: r["ttft_s"] for r in first["rows"] if r["length"] == 48}  # the second part's
    assert sorted((s["length"], s["mode"]) for s in merged["summary"]) == keys
    assert {(c["length"], c["mode"]) for c in merged["checks"]} == {(L, "specextend") for L in (32, 48, 64)}
    meta = merged["meta"]
    assert meta["pairs"] == {"tiny": [32, 48, 64]} and len(meta["parts"]) == 2 and meta["docs"] == {"tiny": ["python"]}
    assert meta["parts"][0]["command"] == first["meta"]["command"] and "--merge" in meta["parts"][1]["command"]
    out = capsys.readouterr().out
    assert "| tiny | 32 | ar | 1 |" in out and "| tiny | 64 | specextend | 1 |" in out  # the table: both parts
    assert sweep("32", "--merge", tokens="3") == 2
    err = capsys.readouterr().err
    assert "--merge: the recorded run differs in new_tokens (4 there, 3 here)" in err
    assert "tiny L=32" not in err  # refused before anything ran
    assert json.loads(path.read_text()) == merged  # the refused part wrote nothing
    from specextend.bench import report

    page = tmp_path / "page.md"
    page.write_text(f"{report.BEGIN}\n{report.END}\n")
    report.write_pages(tmp_path, page, tmp_path / "no-readme.md")
    assert f"in 2 parts: {first['meta']['date']}, commit" in page.read_text()


def test_the_recorded_commit_is_the_checkouts_unless_named(monkeypatch):
    """A run names its commit; $SPECEXTEND_COMMIT overrides the checkout's (a tree carried to a GPU
    host may hold stale git metadata: a 2026-11-23 H200 run was labelled with an older commit)."""
    import subprocess

    from specextend.bench import record

    monkeypatch.delenv("SPECEXTEND_COMMIT", raising=False)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert record.commit().split("-")[0] == head
    monkeypatch.setenv("SPECEXTEND_COMMIT", "abc1234")
    assert record.commit() == "abc1234"
