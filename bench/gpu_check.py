"""A prepared check for a machine with one NVIDIA GPU: G2's host region in vLLM
0.33's layout, its block copies against raw pinned memcpy, and byte exactness.

    python bench/gpu_check.py --json OUT [--layers 8] [--chunks 1,8,64,512]

Needs only PyTorch with CUDA and the standard library: no vLLM, no sessionkv,
no numpy (it runs from a copy of this repository on a bare GPU machine, in a
minute or two). Exit status 0 when every byte check passed, 1 when one did
not, 2 when it cannot run (no PyTorch, no CUDA device, /dev/shm too small).

What it builds, as vLLM 0.33 does (``kv_offload/cpu/shared_offload_region.py``,
``cpu/gpu_worker.py``, ``cpu/host_register.py``):

- the region: a file in /dev/shm created with ``O_EXCL``, sized with
  ``ftruncate``, mapped ``MAP_SHARED`` and pre-faulted; rows of
  ``row = round_up(slot * world, PAGESIZE)`` bytes, one per chunk; in each
  row, worker ``rank`` owns ``slot`` bytes at ``rank * slot``, and its slot
  holds every layer's pages for the chunk, layer after layer
  (``create_next_worker_view``: one int8 view per layer, shape
  ``(chunks, page * blocks_per_chunk)``, stride ``(row, 1)``). This process
  plays worker ``--rank`` of ``--world``; the other workers' slots are
  filled with a pattern that must survive every copy.
- pinning: the whole region registered with ``cudaHostRegister`` (flags 0),
  the call vLLM makes through ctypes, here through ``torch.cuda.cudart()``;
  vLLM registers the whole region too when a worker's slot is within 3 MiB
  of the row (``pin_mmap_region``). A failed registration is reported
  (``pinned: false``) and the copies run pageable, as vLLM's do.
- the device KV cache: one tensor per layer, bf16, shape
  ``(blocks, 2, block_size, kv_heads, head_dim)``, seen as int8
  ``(blocks, page)`` as vLLM's worker sees it.

Copies, each on a side stream that first waits for the current stream (as
vLLM's transfer handlers do), of ``n`` chunks with random chunk ids and
random, non-contiguous GPU block ids:

- ``store`` (D2H): the blocks gathered on the device into the slot layout
  (``index_select``), then one DMA per chunk into its slot, which is
  contiguous in the row;
- ``load`` (H2D): one DMA per chunk from its slot, then scattered into the
  blocks on the device (``index_copy_``);
- ``raw_d2h``/``raw_h2d``: one contiguous copy of the same byte count
  between the device and a buffer from PyTorch's pinned allocator, and
  ``region_d2h``/``region_h2d`` the same from the start of the registered
  region (is registered mmap memory as fast as ``cudaHostAlloc``'s?).

vLLM's own kernel (``swap_blocks_batch``) issues one descriptor per (layer,
block) in one batched call; without vLLM's compiled ops this check gathers on
the device and issues one DMA per chunk slot, so ``store_GBps``/``load_GBps``
are what the region sustains in vLLM's layout, not a timing of vLLM's kernel.
GPU time comes from CUDA events; a spin kernel (``torch.cuda._sleep``) holds
the side stream while Python enqueues the copies, so Python's issue time is
not in it as long as ``issue_ms`` stays below about 10 ms (both reported).
Median of ``--iters`` runs after one warm-up.

Exactness (``exact`` is all of them): device blocks -> region -> the region
holds the blocks' bytes in the slots, the other workers' bytes unchanged; a
second, independent ``mmap`` of the same file (as vLLM's scheduler maps the
workers' region) sees the same bytes; region -> fresh device blocks equal
the source blocks bit for bit (random bit patterns, NaNs included), and every
other fresh block is still zero.

Cost: the region (``--region-chunks`` x row, 1 GiB by default) in /dev/shm
and pinned, twice the device KV (``--device-blocks`` x page x layers, 2 GiB
by default) on the GPU, and a pinned buffer of the largest copy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import statistics
import sys
import time

PAGESIZE = mmap.PAGESIZE
SHM = "/dev/shm"
# Fill of the other workers' slots (and of ours before the first store).
PATTERN = -91  # 0xA5 as int8
SPIN_CYCLES = 20_000_000  # ~10 ms of torch.cuda._sleep on a recent GPU
DEVICE = "cuda"


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def layout(args: argparse.Namespace) -> dict:
    """Byte geometry of the region and the device KV, vLLM 0.33's formulas."""
    page = 2 * args.block_size * args.kv_heads * args.head_dim * 2  # K and V, bf16
    slot = args.layers * page * args.blocks_per_chunk  # cpu_page_size
    row = round_up(slot * args.world, PAGESIZE)  # kv_bytes_per_chunk
    return {
        "layers": args.layers,
        "block_size": args.block_size,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "dtype": "bfloat16",
        "page_bytes": page,
        "blocks_per_chunk": args.blocks_per_chunk,
        "world": args.world,
        "rank": args.rank,
        "slot_bytes": slot,
        "row_bytes": row,
        "region_chunks": args.region_chunks,
        "region_bytes": row * args.region_chunks,
        "device_blocks": args.device_blocks,
    }


class Region:
    """The shared host region: create, map, pre-fault, pin; ``close`` undoes all.

    Views into the mapping hold it exported, so ``close`` drops them first."""

    def __init__(self, torch, geo: dict, path: str):
        self.torch, self.path, self.size = torch, path, geo["region_bytes"]
        self.fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(self.fd, self.size)
        self.mm = mmap.mmap(
            self.fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
        self.base = torch.frombuffer(memoryview(self.mm), dtype=torch.int8)
        t = time.perf_counter()
        self.base.fill_(PATTERN)  # pre-faults every page, as populate does
        self.populate_s = time.perf_counter() - t
        row, slot, rank = geo["row_bytes"], geo["slot_bytes"], geo["rank"]
        n, per_layer = geo["region_chunks"], geo["page_bytes"] * geo["blocks_per_chunk"]
        # This worker's slot per chunk, and its per-layer views (create_next_worker_view).
        self.slots = torch.as_strided(self.base, (n, slot), (row, 1), rank * slot)
        self.layer_views = [
            torch.as_strided(self.base, (n, per_layer), (row, 1), rank * slot + i * per_layer)
            for i in range(geo["layers"])
        ]
        self.pinned, self.pin_error, self.pin_s = False, None, 0.0

    def pin(self) -> None:
        """``cudaHostRegister`` of the whole region, flags 0 (vLLM's call)."""
        try:
            cudart = self.torch.cuda.cudart()
            t = time.perf_counter()
            rc = cudart.cudaHostRegister(self.base.data_ptr(), self.size, 0)
            self.pin_s = time.perf_counter() - t
        except Exception as e:  # no binding in this PyTorch: copies run pageable
            self.pin_error = f"cudaHostRegister not callable: {e!r}"
            return
        if int(rc) == 0:
            self.pinned = True
        else:
            self.pin_error = f"cudaHostRegister: {cudart.cudaGetErrorString(rc)} ({int(rc)})"
            _clear_cuda_error()

    def close(self) -> None:
        if self.pinned:
            self.torch.cuda.synchronize()
            self.torch.cuda.cudart().cudaHostUnregister(self.base.data_ptr())
            self.pinned = False
        self.slots = self.layer_views = self.base = None
        with contextlib.suppress(BufferError):
            self.mm.close()
        os.close(self.fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _clear_cuda_error() -> None:
    """Drain the runtime's sticky last error after a failed registration (vLLM
    calls ``cudaGetLastError``; PyTorch does not bind it, so ctypes on the
    libcudart this process loaded, when it is a shared library)."""
    import ctypes

    with contextlib.suppress(OSError):
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
        for p in paths:
            ctypes.CDLL(p).cudaGetLastError()


def kv_cache(torch, geo: dict, fill: bool) -> list:
    """Per-layer device KV tensors in vLLM's block layout; random bits or zeros."""
    out = []
    for _ in range(geo["layers"]):
        t = torch.zeros(
            (geo["device_blocks"], 2, geo["block_size"], geo["kv_heads"], geo["head_dim"]),
            dtype=torch.bfloat16,
            device=DEVICE,
        )
        if fill:
            t.view(torch.int16).copy_(
                torch.randint(-32768, 32768, t.shape, dtype=torch.int16, device=DEVICE)
            )
        out.append(t.view(torch.int8).view(geo["device_blocks"], geo["page_bytes"]))
    return out


def store(torch, kv: list, blocks, chunks: list[int], slots, staging) -> None:
    """D2H: gather ``blocks`` (n * blocks_per_chunk ids) into the slot layout on
    the device, then one DMA per chunk into its slot. Runs on the current stream."""
    n, layers = len(chunks), len(kv)
    st = staging[:n].view(n, layers, -1, kv[0].shape[1])  # (n, L, bpc, page)
    for i, t in enumerate(kv):
        st[:, i].copy_(t.index_select(0, blocks).view(n, -1, t.shape[1]))
    flat = staging[:n]
    for i, c in enumerate(chunks):
        slots[c].copy_(flat[i], non_blocking=True)


def load(torch, kv: list, blocks, chunks: list[int], slots, staging) -> None:
    """H2D: one DMA per chunk from its slot into staging, then scattered into
    ``blocks`` on the device. Runs on the current stream."""
    n, layers = len(chunks), len(kv)
    flat = staging[:n]
    for i, c in enumerate(chunks):
        flat[i].copy_(slots[c], non_blocking=True)
    st = flat.view(n, layers, -1, kv[0].shape[1])
    for i, t in enumerate(kv):
        t.index_copy_(0, blocks, st[:, i].reshape(-1, t.shape[1]))


def timed(torch, stream, fn, iters: int) -> dict:
    """GPU seconds of ``fn`` on ``stream`` (median of ``iters`` after one warm-up)
    and Python's issue time; the stream spins while Python enqueues."""
    spin = getattr(torch.cuda, "_sleep", None)
    gpu, issue = [], []
    for k in range(iters + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            if spin is not None:
                spin(SPIN_CYCLES)
            start.record(stream)
            t = time.perf_counter()
            fn()
            issued = time.perf_counter() - t
            end.record(stream)
        end.synchronize()
        if k:
            gpu.append(start.elapsed_time(end) / 1e3)
            issue.append(issued)
    return {"s": statistics.median(gpu), "issue_s": statistics.median(issue)}


def exactness(torch, geo: dict, region: Region, kv: list, stream, staging, n: int, gen) -> dict:
    """Device -> region -> second mapping -> fresh device blocks, bit for bit."""
    bpc, dev = geo["blocks_per_chunk"], DEVICE
    perm = torch.randperm(geo["device_blocks"], generator=gen)
    src = perm[: n * bpc].to(dev)
    dst = perm[n * bpc : 2 * n * bpc].to(dev)
    chunks = torch.randperm(geo["region_chunks"], generator=gen)[:n].tolist()
    region.base.fill_(PATTERN)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        store(torch, kv, src, chunks, region.slots, staging)
    stream.synchronize()
    # What the slots must hold: the source blocks, layer after layer, per chunk.
    want = torch.stack([t.index_select(0, src).view(n, -1) for t in kv], 1).view(n, -1).cpu()
    idx = torch.tensor(chunks)
    checks = {"store_bytes_in_region": torch.equal(region.slots.index_select(0, idx), want)}
    # vLLM's per-layer views (create_next_worker_view) see each layer's blocks.
    checks["layer_views_see_blocks"] = all(
        torch.equal(v.index_select(0, idx), t.index_select(0, src).view(n, -1).cpu())
        for v, t in zip(region.layer_views, kv)
    )
    # Every byte outside this worker's slots in the chunks written, and every
    # slot not written, still holds the pattern.
    rows = region.base.view(geo["region_chunks"], geo["row_bytes"])
    lo, hi = geo["rank"] * geo["slot_bytes"], (geo["rank"] + 1) * geo["slot_bytes"]
    mask = torch.ones(geo["region_chunks"], dtype=torch.bool)
    mask[idx] = False
    checks["other_region_bytes_untouched"] = all(
        bool((part == PATTERN).all()) for part in (rows[:, :lo], rows[:, hi:], region.slots[mask])
    )
    # A second, independent mapping of the file (the scheduler's view).
    fd = os.open(region.path, os.O_RDWR)
    try:
        mm2 = mmap.mmap(
            fd, region.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
        try:
            base2 = torch.frombuffer(memoryview(mm2), dtype=torch.int8)
            slots2 = torch.as_strided(base2, region.slots.shape, region.slots.stride(), lo)
            checks["second_mapping_sees_bytes"] = (
                torch.equal(slots2.index_select(0, idx), want)
                and base2.data_ptr() != region.base.data_ptr()
            )
            del base2, slots2
        finally:
            with contextlib.suppress(BufferError):
                mm2.close()
    finally:
        os.close(fd)
    # Back into fresh (zeroed) device blocks at other block ids.
    fresh = kv_cache(torch, geo, fill=False)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        load(torch, fresh, dst, chunks, region.slots, staging)
    stream.synchronize()
    checks["load_blocks_equal"] = all(
        torch.equal(f.index_select(0, dst), t.index_select(0, src)) for f, t in zip(fresh, kv)
    )
    keep = torch.ones(geo["device_blocks"], dtype=torch.bool, device=dev)
    keep[dst] = False
    checks["other_device_blocks_untouched"] = all(not bool(f[keep].any()) for f in fresh)
    del fresh
    return {"chunks": n, **checks}


def measure(
    torch, geo: dict, args, region: Region, kv: list, stream, bufs: dict, n: int, gen
) -> dict:
    """One row of figures: ``n`` chunks stored, loaded, and the raw copies of as many bytes."""
    perm = torch.randperm(geo["device_blocks"], generator=gen)
    blocks = perm[: n * args.blocks_per_chunk].to(DEVICE)
    chunks = torch.randperm(geo["region_chunks"], generator=gen)[:n].tolist()
    nbytes = n * geo["slot_bytes"]
    h, d, r = bufs["pinned"][:nbytes], bufs["device"][:nbytes], region.base[:nbytes]
    staging = bufs["staging"]
    # store first: load then reads the slots store wrote, so the KV keeps its bytes.
    res = {
        "store": timed(
            torch,
            stream,
            lambda: store(torch, kv, blocks, chunks, region.slots, staging),
            args.iters,
        ),
        "load": timed(
            torch,
            stream,
            lambda: load(torch, kv, blocks, chunks, region.slots, staging),
            args.iters,
        ),
        "raw_d2h": timed(torch, stream, lambda: h.copy_(d, non_blocking=True), args.iters),
        "raw_h2d": timed(torch, stream, lambda: d.copy_(h, non_blocking=True), args.iters),
        "region_d2h": timed(torch, stream, lambda: r.copy_(d, non_blocking=True), args.iters),
        "region_h2d": timed(torch, stream, lambda: d.copy_(r, non_blocking=True), args.iters),
    }
    row = {"chunks": n, "bytes": nbytes}
    for name, m in res.items():
        row[f"{name}_GBps"] = round(nbytes / m["s"] / 1e9, 3)
        row[f"{name}_ms"] = round(m["s"] * 1e3, 4)
    row["store_issue_ms"] = round(res["store"]["issue_s"] * 1e3, 4)
    row["load_issue_ms"] = round(res["load"]["issue_s"] * 1e3, 4)
    row["store_over_raw"] = round(res["raw_d2h"]["s"] / res["store"]["s"], 3)
    row["load_over_raw"] = round(res["raw_h2d"]["s"] / res["load"]["s"], 3)
    return row


def run(args: argparse.Namespace, torch) -> dict:
    geo = layout(args)
    free = shutil.disk_usage(SHM).free
    if free < geo["region_bytes"]:
        print(
            f"gpu_check: {SHM} has {free / 2**20:.0f} MiB free, the region needs "
            f"{geo['region_bytes'] / 2**20:.0f} MiB: give the container a larger /dev/shm "
            "(docker --shm-size or --ipc=host) or lower --region-chunks",
            file=sys.stderr,
        )
        raise SystemExit(2)
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    out = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "layout": geo,
        "shm": {"path": SHM, "total_bytes": shutil.disk_usage(SHM).total, "free_bytes": free},
    }
    region = Region(torch, geo, os.path.join(SHM, f"sessionkv_gpu_check_{os.getpid()}.mmap"))
    try:
        region.pin()
        out.update(
            pinned=region.pinned,
            pin_error=region.pin_error,
            pin_s=round(region.pin_s, 4),
            populate_s=round(region.populate_s, 4),
        )
        kv = kv_cache(torch, geo, fill=True)
        stream = torch.cuda.Stream()
        most = max(args.chunks)
        bufs = {
            "staging": torch.empty((most, geo["slot_bytes"]), dtype=torch.int8, device=DEVICE),
            "pinned": torch.empty(most * geo["slot_bytes"], dtype=torch.int8, pin_memory=True),
            "device": torch.empty(most * geo["slot_bytes"], dtype=torch.int8, device=DEVICE),
        }
        out["copies"] = []
        for n in args.chunks:
            out["copies"].append(measure(torch, geo, args, region, kv, stream, bufs, n, gen))
            print(json.dumps(out["copies"][-1]), flush=True)
        out["checks"] = [
            exactness(torch, geo, region, kv, stream, bufs["staging"], n, gen)
            for n in sorted({1, most})
        ]
        out["exact"] = all(v for c in out["checks"] for k, v in c.items() if k != "chunks")
        del bufs, kv
    finally:
        region.close()
    out["elapsed_s"] = round(time.perf_counter() - t0, 2)
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="G2's host region in vLLM 0.33's layout on one NVIDIA GPU: block copies "
        "against raw pinned memcpy, and byte exactness (PyTorch only)"
    )
    p.add_argument("--json", required=True, help="write the figures here")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16, help="tokens per GPU block")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--blocks-per-chunk", type=int, default=1)
    p.add_argument("--world", type=int, default=2, help="workers sharing the region (TP x PP)")
    p.add_argument("--rank", type=int, default=1, help="the worker this process plays")
    p.add_argument("--region-chunks", type=int, default=1024)
    p.add_argument("--device-blocks", type=int, default=2048)
    p.add_argument(
        "--chunks",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 8, 64, 512],
        help="chunk counts per copy, comma-separated",
    )
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if not 0 <= args.rank < args.world:
        p.error("--rank must be in [0, --world)")
    if (
        min(args.chunks) < 1
        or max(args.chunks) > args.region_chunks
        or 2 * max(args.chunks) * args.blocks_per_chunk > args.device_blocks
    ):
        p.error(
            "each of --chunks must be at least 1 and at most --region-chunks, and twice "
            "its blocks must fit --device-blocks"
        )
    try:
        import torch
    except ImportError as e:
        print(f"gpu_check: needs PyTorch with CUDA ({e})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(
            f"gpu_check: no CUDA device (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda}): run it on a machine with an NVIDIA GPU and a CUDA "
            "build of PyTorch",
            file=sys.stderr,
        )
        return 2
    out = run(args, torch)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: out[k] for k in ("device", "pinned", "exact", "elapsed_s")}))
    return 0 if out["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
