"""Work counted, not timed: the Python lines a call runs in given modules.

Tests that a cost does not grow with some size (pins, sessions) compare
these counts at two sizes in one run: every loop iteration is one line, and
machine noise changes nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout (devtools/ runs from it)


def lines_run(fn: Callable[[], object], files: tuple[str, ...]) -> int:
    """Python lines executed in the files ``files`` names while ``fn()`` runs:
    a name ending in ``.py`` is a file path's end, one ending in ``/`` a
    folder of this checkout (``"engine/"``: every file under it). Each must name a loaded
    module's file, so that a renamed file fails the count instead of
    counting nothing."""
    ends = tuple(f for f in files if not f.endswith("/"))
    folders = tuple(f"{ROOT}/{f}" for f in files if f.endswith("/"))

    def ours(path: str) -> bool:
        return path.endswith(ends) or path.startswith(folders)

    loaded = [getattr(m, "__file__", None) or "" for m in list(sys.modules.values())]
    unknown = [f for f in files if not any(ours(p) and (f in p) for p in loaded)]
    if unknown:
        raise ValueError(f"lines_run: no loaded module's file is in {unknown}")
    n = 0

    def tracer(frame, event, arg):
        nonlocal n
        if not ours(frame.f_code.co_filename):
            return None
        if event == "line":
            n += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return n
