"""The local-disk G3 tier against hostile neighbours (issue 54): it touches
only the tree it made, which no other local user can read, and planted
links, FIFOs and a stepped clock cost a miss, never a file outside the
tree, a hung read or a frozen evictor. Real files, real modes, a second
local user (``nobody``, through ``setpriv``)."""

import os
import shutil
import stat
import subprocess
import tempfile
import threading
import time

import numpy as np
import pytest

from sessionkv.tiers.g3.backends.disk import MARK, DiskBackend

KIB = 1024
HOUR_AGO = time.time() - 7200


def put(d, name, size=64 * KIB):
    return d.put_chunks([name], [memoryview(np.full(size, 7, np.uint8))])[0]


def read(d, name, size=64 * KIB):
    return d.get_chunks([name], [memoryview(np.zeros(size, np.uint8))])[0]


def evict_to(d, target, timeout_s=10.0):
    """Evict down to ``target`` (retried while the evictor thread holds the lock)."""
    deadline = time.monotonic() + timeout_s
    while d.usage() > target * d.max_bytes:
        assert time.monotonic() < deadline, d.usage()
        d.evict(target=target)
        time.sleep(0.01)


def old_file(path, data=b"precious"):
    path.write_bytes(data)
    os.utime(path, (HOUR_AGO, HOUR_AGO))
    return path


@pytest.mark.parametrize("layout", ["var", "root"])
def test_a_directory_that_is_not_a_tiers_is_refused_and_left_alone(tmp_path, layout):
    # path: /var (its tmp/ has other programs' files) or path: / (tmp/ among many)
    (tmp_path / "tmp").mkdir()
    victim = old_file(tmp_path / "tmp" / ("cd" * 16))  # even a name of the tier's form
    (tmp_path / ("log" if layout == "var" else "etc")).mkdir()
    with pytest.raises(ValueError, match="not a DiskTier's"):
        DiskBackend(str(tmp_path), 1024 * KIB)
    assert victim.read_bytes() == b"precious"
    assert sorted(os.listdir(tmp_path)) == sorted(["tmp", "log" if layout == "var" else "etc"])


@pytest.mark.parametrize("planted", ["tmp", "objects", "fanout", "usage"])
def test_a_planted_link_in_the_tree_is_refused_at_start(tmp_path, planted):
    victim_dir = tmp_path / "etc"
    victim_dir.mkdir()
    victim = old_file(victim_dir / ("ef" * 16))
    root = tmp_path / "cache"
    if planted == "fanout":  # objects/00 -> elsewhere, in a made tree
        DiskBackend(str(root), 1024 * KIB).close()
        shutil.rmtree(root / "objects" / "00")
        (root / "objects" / "00").symlink_to(victim_dir)
    else:  # planted before the engine first starts
        root.mkdir()
        (root / planted).symlink_to(victim_dir / ("ef" * 16) if planted == "usage" else victim_dir)
    with pytest.raises(ValueError, match="not a (directory|regular file) of this engine's"):
        DiskBackend(str(root), 1024 * KIB)
    assert victim.read_bytes() == b"precious" and os.listdir(victim_dir) == ["ef" * 16]


def test_a_fanout_link_planted_while_running_is_never_entered(tmp_path):
    victim_dir = tmp_path / "elsewhere"
    victim_dir.mkdir()
    victims = [old_file(victim_dir / f"{i:030x}") for i in range(20)]
    d = DiskBackend(str(tmp_path / "cache"), 1024 * KIB)
    try:
        fan = tmp_path / "cache" / "objects" / "00"
        shutil.rmtree(fan)
        fan.symlink_to(victim_dir)
        for i in range(24):  # past the limit: the evictor runs
            put(d, f"o{i}")
        evict_to(d, 0.1)  # down to a tenth: the oldest first
        assert all(v.read_bytes() == b"precious" for v in victims)
        assert len(os.listdir(victim_dir)) == 20
    finally:
        d.close()


def test_another_local_user_reads_nothing(tmp_path):
    base = tempfile.mkdtemp(dir="/tmp")  # a parent any user may enter
    os.chmod(base, 0o755)
    try:
        root = os.path.join(base, "cache")
        d = DiskBackend(root, 1024 * KIB)
        try:
            assert put(d, "secret")
            obj = d.path_of("secret")
            modes = {
                p: stat.S_IMODE(os.lstat(p).st_mode)
                for p in (root, os.path.dirname(obj), obj, os.path.join(root, "usage"))
            }
            assert modes == {
                root: 0o700,
                os.path.dirname(obj): 0o700,
                obj: 0o600,
                os.path.join(root, "usage"): 0o600,
            }, modes
            r = subprocess.run(
                ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "cat", obj],
                capture_output=True,
                timeout=30,
            )
            assert r.returncode != 0 and b"Permission denied" in r.stderr, r
        finally:
            d.close()
    finally:
        shutil.rmtree(base)


def test_a_tree_of_another_user_is_refused(tmp_path):
    root = tmp_path / "cache"
    root.mkdir()
    os.chown(root, 65534, 65534)
    with pytest.raises(ValueError, match="belongs to uid 65534"):
        DiskBackend(str(root), 1024 * KIB)


def test_an_old_tree_without_the_mark_is_adopted_and_closed(tmp_path):
    d = DiskBackend(str(tmp_path), 1024 * KIB)
    assert put(d, "kept")
    d.close()
    os.unlink(tmp_path / MARK)  # as the tier left it before the mark
    os.chmod(tmp_path, 0o755)
    d = DiskBackend(str(tmp_path), 1024 * KIB)
    try:
        assert read(d, "kept") == 64 * KIB and (tmp_path / MARK).exists()
        assert stat.S_IMODE(os.stat(tmp_path).st_mode) == 0o700
    finally:
        d.close()


def read_in_thread(fn, timeout_s=5.0):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), "the read blocked"
    return out[0]


def test_a_fifo_or_link_in_place_of_an_object_is_a_quarantined_miss(tmp_path):
    outside = old_file(tmp_path / "outside", b"x" * 64 * KIB)
    d = DiskBackend(str(tmp_path / "cache"), 1024 * KIB)
    try:
        for name in ("fifo", "link", "small"):
            assert put(d, name)
        for name in ("fifo", "small"):
            os.unlink(d.path_of(name))
            os.mkfifo(d.path_of(name))
        os.unlink(d.path_of("link"))
        os.symlink(outside, d.path_of("link"))
        assert d.exists(["fifo", "link", "small"]) == [False, False, False]
        assert read_in_thread(lambda: read(d, "fifo")) == -1
        assert read_in_thread(lambda: read(d, "link")) == -1
        assert read_in_thread(lambda: d.get_small(["small"])) == [None]
        assert d.pin(["link"], 60) == [False]
        assert d.quarantined == 3
        assert not os.path.lexists(d.path_of("fifo")) and not os.path.lexists(d.path_of("link"))
        assert outside.read_bytes() == b"x" * 64 * KIB
        assert put(d, "fifo") and read(d, "fifo") == 64 * KIB  # the name works again
    finally:
        d.close()


def test_a_clock_stepped_back_does_not_freeze_eviction(tmp_path):
    d = DiskBackend(str(tmp_path), 1024 * KIB)
    try:
        for i in range(12):
            assert put(d, f"old{i}")
        assert d.pin(["pinned"], 60) == [False]  # not there: a TTL asked for all the same
        assert put(d, "pinned") and d.pin(["pinned"], 60) == [True]
        day_ahead = time.time() + 86400  # objects written before a day's step back
        for i in range(12):
            os.utime(d.path_of(f"old{i}"), (day_ahead, day_ahead))
        assert d.pin_horizon() == 60
        evict_to(d, 0.3)  # the stepped objects are evictable
        assert d.exists(["pinned"]) == [True]  # a real pin still holds
    finally:
        d.close()
