"""The local-disk G3 backend's own rules (the tier contract is in
test_g3_contract.py): one size limit for every engine on the directory,
least recently used objects evicted first, pins held through eviction and
lapsing by themselves, objects and their count surviving a restart."""

import os
import struct
import threading
import time

import numpy as np
import pytest

from sessionkv.tiers.g3.backends.disk import LOW_WATER, DiskBackend

KIB = 1024


def put(backend, name, size=64 * KIB, fill=1):
    return backend.put_chunks([name], [memoryview(np.full(size, fill, np.uint8))])[0]


def read(backend, name, size=64 * KIB):
    return backend.get_chunks([name], [memoryview(np.zeros(size, np.uint8))])[0]


def on_disk(path):
    return sum(
        e.stat().st_size
        for d in os.scandir(os.path.join(path, "objects"))
        for e in os.scandir(d.path)
    )


def settle(backend, timeout_s=10, below=0.9):
    """Wait for the evictor to catch up (its thread runs on wake-ups): until
    ``usage`` is at most ``below`` of ``max_bytes``."""
    deadline = time.monotonic() + timeout_s
    while backend.usage() > below * backend.max_bytes:
        assert time.monotonic() < deadline, backend.usage()
        time.sleep(0.05)


def test_two_engines_share_one_limit_and_the_least_recently_used_go_first(tmp_path):
    a = DiskBackend(str(tmp_path), 1024 * KIB)
    b = DiskBackend(str(tmp_path), 1024 * KIB)  # another engine on the host
    try:
        for i in range(7):  # 448 KiB from each: below HIGH_WATER
            assert put(a, f"a{i}") and put(b, f"b{i}")
        assert a.usage() == b.usage() == 896 * KIB  # one count for both
        time.sleep(0.05)
        for i in range(7):
            assert read(a, f"a{i}") == 64 * KIB  # a's objects now more recent than b's
        time.sleep(0.05)
        for i in range(4):  # 256 KiB more: past the limit
            if not put(b, f"c{i}"):  # refused while the evictor ran
                settle(b)
                assert put(b, f"c{i}")
        settle(b)
        assert a.usage() == on_disk(str(tmp_path)) <= 1024 * KIB
        names = [f"{p}{i}" for p in "ab" for i in range(7)] + [f"c{i}" for i in range(4)]
        gone = {n for n, there in zip(names, a.exists(names)) if not there}
        assert gone and all(n.startswith("b") for n in gone), gone  # the oldest: b's
        assert a.evictions + b.evictions == len(gone)
    finally:
        a.close()
        b.close()


def test_a_restart_between_the_marks_keeps_every_object(tmp_path):
    """The start scan recounts but evicts only past HIGH_WATER, as a put
    would: a directory left at 87.5 % (between LOW_WATER and HIGH_WATER)
    keeps its objects. CI lost the oldest object when the start scan of the
    test above ran late, after its puts."""
    d = DiskBackend(str(tmp_path), 1024 * KIB)
    for i in range(14):  # 896 KiB: past LOW_WATER only
        assert put(d, f"o{i}")
    d.close()
    (tmp_path / "usage").write_bytes(b"\xff" * 8)  # the start scan must recount
    d = DiskBackend(str(tmp_path), 1024 * KIB)
    settle(d, below=1.0)  # until the recount
    d.close()  # waits for the scan to end
    d = DiskBackend(str(tmp_path), 1024 * KIB)
    try:
        assert d.exists([f"o{i}" for i in range(14)]) == [True] * 14
        assert d.usage() == on_disk(str(tmp_path)) == 896 * KIB
        assert not put(d, "big", size=200 * KIB)  # refused: the evictor runs now
        settle(d, below=LOW_WATER)
        assert sum(d.exists([f"o{i}" for i in range(14)])) == 12 and d.evictions == 2
    finally:
        d.close()


def test_the_count_stays_exact_under_racing_puts_removes_and_evictions(tmp_path):
    """Two engines, three threads each, on 24 names: puts over each other's
    objects, removes and evictions all race; once they stop, ``usage`` is
    the bytes on disk to the byte (a scan-based count drifted here)."""
    # 24 names of 48 KiB on average fill 1 MiB: a 512 KiB limit evicts often.
    engines = [DiskBackend(str(tmp_path), 512 * KIB) for _ in range(2)]

    def work(d, seed):
        rng = np.random.default_rng(seed)
        for _ in range(150):
            name, size = f"n{rng.integers(24)}", int(rng.integers(1, 96)) * KIB
            if rng.random() < 0.2:
                d.remove([name])
            else:
                put(d, name, size=size)

    threads = [
        threading.Thread(target=work, args=(d, 10 * i + j))
        for i, d in enumerate(engines)
        for j in range(3)
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for d in engines:
            d.close()  # waits for the evictors
    assert sum(d.evictions for d in engines) > 0  # the evictors raced too
    counted = struct.unpack("<Q", (tmp_path / "usage").read_bytes())[0]
    assert counted == on_disk(str(tmp_path)) <= 512 * KIB


def test_pins_hold_through_eviction_and_lapse_by_themselves(tmp_path):
    d = DiskBackend(str(tmp_path), 640 * KIB)
    try:
        for i in range(8):
            assert put(d, f"o{i}")
        assert d.pin(["o0", "o1", "gone"], 1.0) == [True, True, False]
        d.evict(target=0.0)  # everything unpinned goes
        assert d.exists([f"o{i}" for i in range(8)]) == [True, True] + [False] * 6
        assert read(d, "o0") == 64 * KIB  # readable while pinned
        time.sleep(1.2)
        d.evict(target=0.0)
        assert d.exists(["o0", "o1"]) == [False, False]
        assert d.usage() == 0
    finally:
        d.close()


def test_objects_and_their_count_survive_a_restart_and_a_lost_count(tmp_path):
    d = DiskBackend(str(tmp_path), 1024 * KIB)
    for i in range(4):
        assert put(d, f"o{i}", fill=i)
    d.close()
    (tmp_path / "usage").write_bytes(b"\xff" * 8)  # a count a crash left wrong
    d = DiskBackend(str(tmp_path), 1024 * KIB)
    try:
        deadline = time.monotonic() + 10
        while d.usage() != 4 * 64 * KIB:  # the start scan recounts
            assert time.monotonic() < deadline, d.usage()
            time.sleep(0.05)
        buf = np.zeros(64 * KIB, np.uint8)
        assert d.get_chunks(["o3"], [memoryview(buf)]) == [64 * KIB] and (buf == 3).all()
        assert d.remove(["o3", "never"]) == [True, True] and d.usage() == 3 * 64 * KIB
    finally:
        d.close()


def test_a_stale_temporary_file_is_swept_and_odd_names_stay_inside(tmp_path):
    d = DiskBackend(str(tmp_path), 1024 * KIB)
    try:
        stale = tmp_path / "tmp" / ("ab" * 16)  # a put's name, left by a crash
        other = tmp_path / "tmp" / "left-by-someone-else"  # not a name the tier makes
        for f in (stale, other):
            f.write_bytes(b"x")
            os.utime(f, (time.time() - 7200, time.time() - 7200))
        for name in ("../../etc/passwd", "a/../../b", "\x00\n", "ü" * 300):
            assert put(d, name, size=KIB) and read(d, name, size=KIB) == KIB
        d.evict(target=LOW_WATER)
        assert not stale.exists() and other.exists()
        assert sorted(os.listdir(tmp_path)) == [
            "count.lock",
            "evict.lock",
            "objects",
            "sessionkv-disk-tier",
            "tmp",
            "usage",
            "usage.lock",
        ]
    finally:
        d.close()


@pytest.mark.parametrize(
    "kw, key",
    [
        ({"path": "", "max_bytes": 1}, "path"),
        ({"path": "x", "max_bytes": 0}, "max_bytes"),
        ({"path": "x", "max_bytes": True}, "max_bytes"),
        ({"path": "x", "max_bytes": "1G"}, "max_bytes"),
    ],
)
def test_bad_settings_name_the_key(tmp_path, kw, key):
    if kw["path"]:
        kw = {**kw, "path": str(tmp_path / kw["path"])}
    with pytest.raises(ValueError, match=f"DiskTier: {key}"):
        DiskBackend(**kw)


def test_a_directory_that_cannot_be_made_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ValueError, match="DiskTier: cannot use path"):
        DiskBackend(str(tmp_path / "file" / "sub"), 1024)
