"""G2 regions left by killed engines are removed when the next engine
starts (``connectors/regions.py``): only those no process holds a lock on
and older than ``STALE_S``. Files in a temporary directory stand in for
``/dev/shm``; the locks are real ``flock``s, the holder another process."""

import fcntl
import os
import subprocess
import sys
import time

from sessionkv.connectors.regions import STALE_S, hold, reclaim


def region(path, age_s):
    path.write_bytes(b"\0" * 4096)
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def test_only_old_regions_no_process_holds_are_removed(tmp_path):
    dead = region(tmp_path / "vllm_offload_dead.mmap", STALE_S + 60)
    young = region(tmp_path / "vllm_offload_young.mmap", 5)       # an engine still starting
    live = region(tmp_path / "vllm_offload_live.mmap", STALE_S + 60)
    other = region(tmp_path / "unrelated.mmap", STALE_S + 60)
    # Another process holds the live one, as a running engine does (hold()).
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         f"fd = os.open({str(live)!r}, os.O_RDONLY)\n"
         "fcntl.flock(fd, fcntl.LOCK_SH)\nprint('held', flush=True)\ntime.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        removed = reclaim(str(tmp_path / "vllm_offload_*.mmap"))
        assert removed == [str(dead)]
        assert not dead.exists() and young.exists() and live.exists() and other.exists()
    finally:
        holder.kill()
        holder.wait()
    # Its holder gone (killed, as an engine core is), the live one is stale too.
    assert reclaim(str(tmp_path / "vllm_offload_*.mmap")) == [str(live)]


def test_hold_takes_a_shared_lock_that_excludes_reclaim(tmp_path):
    path = region(tmp_path / "vllm_offload_mine.mmap", STALE_S + 60)
    fd = os.open(path, os.O_RDWR)
    try:
        hold(fd)
        other = os.open(path, os.O_RDONLY)
        try:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                raise AssertionError("an exclusive lock was granted over hold()'s")
            except BlockingIOError:
                pass
            fcntl.flock(other, fcntl.LOCK_SH | fcntl.LOCK_NB)    # another holder: fine
        finally:
            os.close(other)
        assert reclaim(str(tmp_path / "vllm_offload_*.mmap")) == []
        hold(None)                                              # no descriptor: nothing
    finally:
        os.close(fd)
