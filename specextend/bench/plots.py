"""PNG plots of a run's summary rows (matplotlib, the `bench` extra): tokens/s against input length
per mode, the step split (wait for the draft / verify / other), acceptance against length, time to
first token; step times against length for the kernels suite; acceptance against each swept
variable of the signal suite. One figure per kind, one panel per pair (and length for the signal
suite); files `<stem>-<kind>.png`."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _panels(plt, pairs: list[str], title: str):
    fig, axes = plt.subplots(1, len(pairs), figsize=(6 * len(pairs), 4.2), squeeze=False)
    fig.suptitle(title)
    return fig, dict(zip(pairs, axes[0]))


def _style(ax, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _lines(summary: list[dict], key: str, ylabel: str, title: str, path: Path, modes=None) -> Path:
    plt = _pyplot()
    pairs = sorted({s["pair"] for s in summary})
    fig, axes = _panels(plt, pairs, title)
    for pair, ax in axes.items():
        rows = [s for s in summary if s["pair"] == pair and key in s and (modes is None or modes(s))]
        for mode in dict.fromkeys(s["mode"] for s in rows):
            pts = sorted((s["length"], s[key], s.get(key + "_std", 0.0), s["replayed"])
                         for s in rows if s["mode"] == mode)
            label = mode + (" (replayed)" if any(p[3] for p in pts) else "")
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o",
                        capsize=3, label=label)
        ax.set_xscale("log", base=2)
        _style(ax, "input length (document tokens)", ylabel, pair)
    return _save(plt, fig, path)


def _split(summary: list[dict], title: str, path: Path) -> Path:
    plt = _pyplot()
    pairs = sorted({s["pair"] for s in summary})
    fig, axes = _panels(plt, pairs, title)
    # the wait without its transport, then the transport (DraftTree.server_s; 0 in runs from before it)
    parts = ((lambda s: s.get("draft_wait_ms", 0.0) - s.get("transport_ms", 0.0), "wait for the draft"),
             (lambda s: s.get("transport_ms", 0.0), "transport (the wait beyond the draft's own time)"),
             (lambda s: s.get("verify_ms", 0.0), "verify"), (lambda s: s.get("other_ms", 0.0), "other (plain steps, commit, host)"))
    for pair, ax in axes.items():
        rows = [s for s in summary if s["pair"] == pair and "step_ms" in s]
        labels = [f"{s['length']}\n{s['mode']}" for s in rows]
        bottom = [0.0] * len(rows)
        for part, name in parts:
            vals = [part(s) for s in rows]
            ax.bar(range(len(rows)), vals, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(range(len(rows)), labels, fontsize=6, rotation=90)
        ax.set_ylabel("ms per step")
        ax.set_title(pair)
        ax.legend(fontsize=7)
    return _save(plt, fig, path)


def decode_plots(summary: list[dict], stem: Path, title: str) -> list[Path]:
    """The four plots of an end-to-end or served run."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    return [
        _lines(summary, "decode_tokens_per_s", "decode tokens/s", f"{title}: decode tokens/s",
               Path(f"{stem}-tokens_per_s.png")),
        _split(summary, f"{title}: step time split", Path(f"{stem}-step_split.png")),
        _lines(summary, "mean_acceptance_length", "mean acceptance length (tokens/step)",
               f"{title}: acceptance", Path(f"{stem}-acceptance.png"),
               modes=lambda s: s["mode"] not in ("ar", "hf") and "step_ms" in s),
        _lines(summary, "ttft_s", "time to first token (s)", f"{title}: time to first token",
               Path(f"{stem}-ttft.png")),
    ]


def step_time_plot(rows: list[dict], stem: Path, title: str) -> list[Path]:
    """Kernels suite: each step's time against the committed length, with the memory floor."""
    plt = _pyplot()
    stem.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = (("ar_step_ms", "AR step"), ("verify_hta_ms", "verify, HTA"), ("verify_masked_ms", "verify, masked"),
            ("floor_ms", "verify memory floor"), ("draft_step_full_ms", "draft step, full cache"),
            ("draft_step_cmr_ms", "draft step, retrieval cache"))
    rows = sorted(rows, key=lambda r: r["length"])
    for key, name in keys:
        ax.plot([r["length"] for r in rows], [r[key] for r in rows], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    _style(ax, "committed tokens", "ms", title)
    return [_save(plt, fig, Path(f"{stem}-step_times.png"))]


def sweep_plots(summary: list[dict], stem: Path, title: str, key: str = "mean_acceptance_length") -> list[Path]:
    """Signal suite: `key` against each swept variable, one panel per pair and length, one line per
    baseline; a baseline not swept (the full cache; the recency window under faults) is drawn flat
    at its nominal value. Files `<stem>-<sweep>.png`."""
    from specextend.bench.signal import XLABELS

    plt = _pyplot()
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for sweep in dict.fromkeys(s["sweep"] for s in summary if s["sweep"] != "nominal"):
        rows = [s for s in summary if s["sweep"] == sweep]
        xs = sorted({s["value"] for s in rows})
        panels = list(dict.fromkeys(f"{s['pair']} pair, {s['length']} tokens" for s in rows))
        fig, axes = _panels(plt, panels, f"{title}: acceptance against {XLABELS[sweep]}")
        for panel, ax in axes.items():
            here = [s for s in summary if f"{s['pair']} pair, {s['length']} tokens" == panel]
            for baseline in ("retrieval", "recency", "full"):
                pts = sorted((s["value"], s[key], s[key + "_std"]) for s in here
                             if s["sweep"] == sweep and s["baseline"] == baseline)
                flat = [s for s in here if s["sweep"] == "nominal" and s["baseline"] == baseline]
                style = "-"
                if not pts and flat:
                    pts = [(x, flat[0][key], flat[0][key + "_std"]) for x in xs]
                    baseline, style = baseline + " (not swept)", "--"
                if pts:
                    ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o",
                                capsize=3, label=baseline, linestyle=style)
            if sweep in ("every", "budget", "chunk"):
                ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            _style(ax, XLABELS[sweep], "mean acceptance length (tokens/step)", panel)
        paths.append(_save(plt, fig, Path(f"{stem}-{sweep}.png")))
    return paths
