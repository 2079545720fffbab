"""PNG plots of a run's summary rows (matplotlib, the `bench` extra): tokens/s against input length
per mode, the step split (wait for the draft / verify / other), acceptance against length, time to
first token; and step times against length for the kernels suite. One figure per kind, one panel
per pair; files `<stem>-<kind>.png`."""

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
        ax.set_xlabel("input length (document tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(pair)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _split(summary: list[dict], title: str, path: Path) -> Path:
    plt = _pyplot()
    pairs = sorted({s["pair"] for s in summary})
    fig, axes = _panels(plt, pairs, title)
    parts = (("draft_wait_ms", "wait for the draft (incl. transport)"), ("verify_ms", "verify"),
             ("other_ms", "other (plain steps, commit, host)"))
    for pair, ax in axes.items():
        rows = [s for s in summary if s["pair"] == pair and "step_ms" in s]
        labels = [f"{s['length']}\n{s['mode']}" for s in rows]
        bottom = [0.0] * len(rows)
        for key, name in parts:
            vals = [s.get(key, 0.0) for s in rows]
            ax.bar(range(len(rows)), vals, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(range(len(rows)), labels, fontsize=6, rotation=90)
        ax.set_ylabel("ms per step")
        ax.set_title(pair)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
    ax.set_xlabel("committed tokens")
    ax.set_ylabel("ms")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(f"{stem}-step_times.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
