"""Hit ratio against G2 capacity as a PNG, for ``bench/replay.py``.

matplotlib when the venv has it; otherwise a small raster written with numpy
and zlib (no labels: axes, one coloured line per policy, and a legend of
coloured squares in the order of ``COLORS``, which the caller prints), so the
bench needs no plotting dependency.
"""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np

COLORS = {"lru": (214, 39, 40), "arc": (255, 127, 14), "session": (31, 119, 180),
          "opt": (44, 160, 44), "naive": (148, 103, 189)}


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


def write_png(path: str, rgb: np.ndarray) -> None:
    """Write an (h, w, 3) uint8 array as a PNG."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    with open(path, "wb") as f:
        f.write(png)


def _line(img: np.ndarray, x0, y0, x1, y1, color, width=2) -> None:
    n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    for t in np.linspace(0.0, 1.0, n):
        x, y = int(round(x0 + t * (x1 - x0))), int(round(y0 + t * (y1 - y0)))
        img[max(0, y - width // 2):y + width // 2 + 1, max(0, x - width // 2):x + width // 2 + 1] = color


def raster_plot(path: str, data: dict[str, list[tuple[int, float]]]) -> None:
    """The dependency-free plot: log2 capacity on x, hit ratio 0..max on y."""
    W, H, M = 640, 420, 40
    img = np.full((H, W, 3), 255, np.uint8)
    xs = [x for v in data.values() for x, _ in v]
    lo, hi = math.log2(min(xs)), math.log2(max(xs))
    top = max(y for v in data.values() for _, y in v) * 1.1 or 1.0
    px = lambda x: M + (math.log2(x) - lo) / max(hi - lo, 1e-9) * (W - 2 * M)  # noqa: E731
    py = lambda y: H - M - y / top * (H - 2 * M)  # noqa: E731
    _line(img, M, H - M, W - M, H - M, (0, 0, 0), 1)
    _line(img, M, M, M, H - M, (0, 0, 0), 1)
    for x in sorted(set(xs)):
        _line(img, px(x), H - M, px(x), H - M + 6, (0, 0, 0), 1)
    for k in range(1, 5):          # gridlines at quarters of the y range
        _line(img, M, py(top * k / 5), W - M, py(top * k / 5), (220, 220, 220), 1)
    for j, (p, color) in enumerate(COLORS.items()):
        pts = data.get(p)
        if not pts:
            continue
        for (xa, ya), (xb, yb) in zip(pts, pts[1:]):
            _line(img, px(xa), py(ya), px(xb), py(yb), color, 2)
        for x, y in pts:
            cx, cy = int(px(x)), int(py(y))
            img[cy - 3:cy + 4, cx - 3:cx + 4] = color
        img[8:18, M + 20 * j:M + 20 * j + 10] = color          # legend square
    write_png(path, img)


def write_plot(path: str, runs: list[dict]) -> str:
    """Plot token hit ratio against G2 capacity; returns a line saying how."""
    data = series(runs)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raster_plot(path, data)
        legend = ", ".join(f"{p}=rgb{c}" for p, c in COLORS.items() if p in data)
        return (f"plot: {path} (matplotlib not installed: plain raster, x = G2 blocks on a "
                f"log scale, y = token hit ratio from 0; legend squares left to right: {legend})")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p, pts in data.items():
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p,
                color=[c / 255 for c in COLORS.get(p, (0, 0, 0))])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("G2 capacity (512-token blocks)")
    ax.set_ylabel("token hit ratio")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return f"plot: {path}"
