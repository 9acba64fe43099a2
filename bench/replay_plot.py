"""Hit ratio against G2 capacity as a PNG (matplotlib), for ``bench/replay.py``."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {
    "lru": ("tab:red", "o"),
    "arc": ("tab:orange", "s"),
    "naive": ("tab:purple", "v"),
    "naive-unbounded": ("tab:pink", "^"),
    "session": ("tab:blue", "D"),
    "opt": ("tab:green", "*"),
}


def series(runs: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """policy -> [(g2 blocks, token hit ratio)], sorted by capacity."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in runs:
        if r["policy"] == "opt":
            # the reference for G2 = n has G1 + G2 = 1.25 n blocks
            g2 = round(r["total_capacity_blocks"] / 1.25)
        else:
            g2 = r["g2_blocks"]
        out.setdefault(r["policy"], []).append((g2, r["token_hit_ratio"]))
    return {p: sorted(v) for p, v in out.items()}


def write_plot(path: str, runs: list[dict], title: str = "") -> str:
    """Plot token hit ratio against G2 capacity; returns a line naming the file."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p, pts in series(runs).items():
        color, marker = STYLE.get(p, ("black", "x"))
        ax.plot(
            [x for x, _ in pts],
            [y for _, y in pts],
            marker=marker,
            color=color,
            label=p + (" (offline reference, G1 + G2)" if p == "opt" else ""),
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("G2 capacity per engine (512-token blocks; G1 = G2 / 4)")
    ax.set_ylabel("token hit ratio (hit prompt tokens / prompt tokens)")
    ax.set_ylim(bottom=0)
    ax.set_title(title or "trace replay")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return f"plot: {path}"
