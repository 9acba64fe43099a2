"""Work counted, not timed: the Python lines a call runs in given modules.

Tests that a cost does not grow with some size (pins, sessions) compare
these counts at two sizes in one run: every loop iteration is one line, and
machine noise changes nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


def lines_run(fn: Callable[[], object], files: tuple[str, ...]) -> int:
    """Python lines executed in files whose names end with one of ``files``
    while ``fn()`` runs."""
    n = 0

    def tracer(frame, event, arg):
        nonlocal n
        if not frame.f_code.co_filename.endswith(files):
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
