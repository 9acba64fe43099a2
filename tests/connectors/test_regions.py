"""One G2 region per engine (``tiers/g2/regions.py``): a region is removed
only when sessionkv registered it and no live process holds it, never by
age; on a device the scheduler joins the workers' region and never makes
its own. Regions are vLLM's own ``SharedOffloadRegion`` in ``/dev/shm``
(each test its own engine id); holders are other processes, as an engine's
workers are; the locks are real ``flock``s."""

import dataclasses
import glob
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import numpy as np
import pytest
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from sessionkv.connectors import spec as spec_mod
from sessionkv.connectors.spec import SessionTierSpec
from sessionkv.devtools.g3_spec import standalone_spec
from sessionkv.tiers.g2 import regions

CHUNK = 16384  # bytes per chunk: one worker, four pages
CHUNKS = 64
DAY = 86400.0


@pytest.fixture
def engine_id():
    eid = f"test-{uuid.uuid4().hex[:12]}"
    yield eid
    path = regions.region_path(eid)
    regions.release(path)
    for p in glob.glob(glob.escape(path) + "*") + [regions._registration(path)]:
        if os.path.lexists(p):
            os.unlink(p)


def age(path, seconds):
    t = time.time() - seconds
    os.utime(path, (t, t), follow_symlinks=False)


def holder(code: str) -> subprocess.Popen:
    """Another process running ``code`` that prints 'ready' and then sleeps."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(code) + "\nprint('ready', flush=True)\nimport time\ntime.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ,
    )
    line = proc.stdout.readline().strip()
    if line != "ready":
        proc.kill()
        raise AssertionError(f"holder did not start: {line!r}")
    return proc


def stop(proc):
    proc.kill()
    proc.wait()


def worker(engine_id: str, fill: int) -> subprocess.Popen:
    """A worker as on a device: registers the region, then vLLM's own
    ``SharedOffloadRegion`` creates and maps it (rank 0, as vLLM 0.33's
    tiering spec's ``create_worker``), and the worker writes ``fill`` into
    every chunk of its view, as its G1 -> G2 copies would."""
    return holder(f"""
        from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
        from sessionkv.tiers.g2 import regions
        regions.register(regions.region_path({engine_id!r}))
        r = SharedOffloadRegion(engine_id={engine_id!r}, num_chunks={CHUNKS}, rank=0,
                                kv_bytes_per_chunk={CHUNK}, cpu_page_size={CHUNK})
        r.create_next_worker_view({CHUNK}).fill_({fill})
    """)


def device_spec(engine_id, monkeypatch) -> SessionTierSpec:
    """Our spec for an engine on a device platform. The platform is a fake
    (there is no GPU here): ``has_device_worker`` answers True, which is all
    the scheduler side asks of it."""
    monkeypatch.setattr(spec_mod, "has_device_worker", lambda: True)
    cfg = dataclasses.replace(
        standalone_spec("m", CHUNK).config,
        engine_id=engine_id,
        extra_config={"cpu_bytes_to_use": CHUNKS * CHUNK},
    )
    return SessionTierSpec(cfg)


def test_the_scheduler_joins_the_workers_region_after_a_long_warm_up(engine_id, monkeypatch):
    """vLLM 0.33's order on a device: workers map first, compile and warm-up
    take longer than any age threshold (the old one was 10 minutes), then the
    scheduler maps. One region, and the scheduler's G2 view sees the
    workers' bytes."""
    w = worker(engine_id, 7)
    try:
        path = regions.region_path(engine_id)
        age(path, DAY)
        age(regions._registration(path), DAY)
        region = device_spec(engine_id, monkeypatch)._scheduler_region()
        try:
            assert os.path.exists(path), "reclaim removed the live worker region"
            assert glob.glob(glob.escape(path) + "*") == [path]
            g2 = np.asarray(region.create_kv_memoryview())
            assert g2.shape == (CHUNKS, CHUNK)
            assert (g2 == 7).all(), "the scheduler's G2 view does not see the workers' bytes"
            del g2
        finally:
            region.cleanup()
    finally:
        stop(w)


def test_on_a_device_the_scheduler_never_creates_the_region(engine_id, monkeypatch):
    spec = device_spec(engine_id, monkeypatch)
    with pytest.raises(RuntimeError, match="missing"):
        spec._scheduler_region()
    assert not os.path.exists(regions.region_path(engine_id))


def test_a_region_no_process_holds_is_removed_with_its_segments(engine_id):
    path = regions.region_path(engine_id)
    w = worker(engine_id, 1)
    for extra in (".1", ".2"):  # vLLM 0.33's segment files
        with open(path + extra, "wb") as f:
            f.write(b"\0")
    with open(path + ".bak", "wb") as f:  # not a segment: not ours to remove
        f.write(b"\0")
    try:
        assert path not in regions.reclaim()  # held by the worker
        assert os.path.exists(path)
    finally:
        stop(w)  # killed, as an engine core is
    assert path in regions.reclaim()
    assert not os.path.exists(path) and not os.path.exists(path + ".1")
    assert not os.path.exists(path + ".2")
    assert os.path.exists(path + ".bak")
    assert not os.path.exists(regions._registration(path))


def test_regions_sessionkv_did_not_register_are_never_removed(engine_id):
    """vLLM's own connector's regions (and anything else in /dev/shm) are
    not sessionkv's, whatever their age and whoever holds them."""
    r = SharedOffloadRegion(
        engine_id=engine_id, num_chunks=4, rank=None, kv_bytes_per_chunk=4096, cpu_page_size=4096
    )
    path = r.mmap_path
    try:
        age(path, 30 * DAY)
        assert path not in regions.reclaim()
        assert os.path.exists(path)
    finally:
        r.cleanup()


def test_a_registration_symlink_is_not_followed(engine_id, tmp_path):
    path = regions.region_path(engine_id)
    target = tmp_path / "victim"
    target.write_bytes(b"keep")
    os.symlink(target, regions._registration(path))
    assert path not in regions.reclaim()
    assert target.read_bytes() == b"keep"
    with pytest.raises(OSError):
        regions.register(path)  # nor by the engine registering
    assert target.read_bytes() == b"keep"


def test_register_waits_out_a_reclaim_and_registers_anew(engine_id):
    """A registration being reclaimed (its lock taken exclusively) is not
    joined: the engine registering waits, finds the file replaced, and holds
    a fresh one that the next reclaim leaves alone."""
    path = regions.region_path(engine_id)
    reg = regions._registration(path)
    reclaimer = holder(f"""
        import fcntl, os
        fd = os.open({reg!r}, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
    """)
    try:
        done = []
        t = threading.Thread(target=lambda: done.append(regions.register(path)))
        t.start()
        time.sleep(0.2)
        assert not done  # waits for the reclaimer
        os.unlink(reg)  # the reclaimer removes it ...
    finally:
        stop(reclaimer)  # ... and lets go
    t.join(5)
    assert done and os.path.exists(reg)
    assert os.path.samestat(os.fstat(regions._held[reg]), os.stat(reg))
    open(path, "wb").close()
    assert path not in regions.reclaim()  # held by this process
    assert os.path.exists(path)
