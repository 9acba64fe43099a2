"""G2 host regions left behind by engines that did not exit cleanly.

vLLM maps G2 from ``/dev/shm/vllm_offload_<engine_id>.mmap`` and, on the CPU
path (no barrier), removes the file only from a clean shutdown of the process
that created it; an engine core that is killed (vLLM's default
``--shutdown-timeout 0``, the OOM killer, SIGKILL) leaves the whole G2 size of
shared memory behind, for every restart. So each engine holds a shared
``flock`` on its region while it runs (``hold``: on the descriptor vLLM keeps
open, so the lock ends with the process however it ends), and an engine
starting removes the regions no live process holds (``reclaim``).

Invariants: a region is removed only when no process holds a lock on it and
it is older than ``STALE_S`` (an engine still starting takes its lock within
seconds of making the file). Removing the name of a region still mapped by
an engine without this lock (vLLM's own connector) is harmless: vLLM itself
unlinks the name once its workers mapped it (``SharedOffloadRegion``'s
barrier), and mappings stay valid.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import time

from vllm.logger import init_logger

logger = init_logger(__name__)

REGIONS = "/dev/shm/vllm_offload_*.mmap"
STALE_S = 600.0


def hold(fd: int | None) -> None:
    """A shared lock on a region's open descriptor, for as long as it stays open."""
    if fd is not None:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)


def reclaim(pattern: str = REGIONS, stale_s: float = STALE_S,
            now: float | None = None) -> list[str]:
    """Remove the regions matching ``pattern`` that no process holds and that
    are older than ``stale_s``; the paths removed. Never raises."""
    now = time.time() if now is None else now
    removed = []
    for path in glob.glob(pattern):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_mtime > now - stale_s:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)     # nobody holds it
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue                        # held (BlockingIOError), or gone meanwhile
        finally:
            os.close(fd)
    if removed:
        logger.info("sessionkv: removed %d G2 regions no live engine holds: %s",
                    len(removed), ", ".join(removed))
    return removed
