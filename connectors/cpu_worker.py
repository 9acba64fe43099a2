"""G1 <-> G2 copies for the CPU platform.

vLLM's ``CPUOffloadingWorker`` needs CUDA/XPU tensors (streams, events, pinned
descriptor buffers, Triton), so on a CPU-only machine our spec uses this worker
instead. It copies with plain torch indexing between each canonical KV tensor,
viewed as ``(num_blocks, page)`` int8, and this worker's slot of the shared host
region, viewed as ``(num_chunks, blocks_per_chunk, page)``.

Copies run synchronously inside ``submit_store`` / ``submit_load``; their
results wait in a queue for ``get_finished``. The connector submits stores only
after the forward pass that wrote the blocks (``wait_for_save`` defers them to
the next step) and loads before the forward pass that reads them, so a
synchronous copy is ordered the way vLLM's stream events order the CUDA copies.

Threading: called only from the worker's model-runner thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion


def expand_chunks(
    chunk_ids: np.ndarray, blocks_per_chunk: int, skip: int, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chunk, slot) indices of ``count`` consecutive blocks stored in
    ``chunk_ids``, starting ``skip`` blocks into the first chunk."""
    chunks = np.repeat(chunk_ids.astype(np.int64), blocks_per_chunk)
    slots = np.tile(np.arange(blocks_per_chunk, dtype=np.int64), len(chunk_ids))
    return (
        torch.from_numpy(chunks[skip : skip + count]),
        torch.from_numpy(slots[skip : skip + count]),
    )


class TorchCopyWorker(OffloadingWorker):
    """``OffloadingWorker`` that copies G1 <-> G2 with torch on the CPU platform."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        region: SharedOffloadRegion,
    ):
        # The worker owns the region from here on and releases it in shutdown().
        self._region = region
        self._bpc = blocks_per_chunk
        self._device: list[torch.Tensor] = []
        self._host: list[torch.Tensor] = []
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            dev = t.tensor
            if dev.dtype != torch.int8 or dev.dim() != 2 or dev.shape[1] != page:
                dev = dev.view(torch.int8).view(-1, page)
            host = region.create_next_worker_view(page * blocks_per_chunk)
            self._device.append(dev)
            self._host.append(host.view(host.shape[0], blocks_per_chunk, page))
        self._finished: list[TransferResult] = []

    def _index(
        self, gpu_spec: GPULoadStoreSpec, host_spec: LoadStoreSpec
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Device block ids and the matching (chunk, slot) host indices."""
        if not isinstance(host_spec, BlockIDsLoadStoreSpec):
            raise TypeError(f"unsupported host spec {type(host_spec).__name__}")
        gpu_ids = gpu_spec.block_ids
        chunk_ids = host_spec.block_ids
        sizes: Sequence[int] = gpu_spec.group_sizes
        starts: Sequence[int] = gpu_spec.block_indices
        chunks, slots = [], []
        chunk_off = 0
        for size, start in zip(sizes, starts):
            if size == 0:
                continue
            skip = start % self._bpc
            n_chunks = -(-(size + skip) // self._bpc)
            c, s = expand_chunks(chunk_ids[chunk_off : chunk_off + n_chunks], self._bpc, skip, size)
            chunks.append(c)
            slots.append(s)
            chunk_off += n_chunks
        if chunk_off != len(chunk_ids) or sum(sizes) != len(gpu_ids):
            raise ValueError("store/load spec sizes do not match")
        dev_idx = torch.from_numpy(gpu_ids.astype(np.int64))
        return dev_idx, torch.cat(chunks), torch.cat(slots)

    def _done(self, job_id: int, nbytes: int, t0: float) -> bool:
        self._finished.append(TransferResult(job_id, True, nbytes, time.perf_counter() - t0))
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """G1 -> G2, copied before returning."""
        t0 = time.perf_counter()
        dev_idx, chunks, slots = self._index(src_spec, dst_spec)
        nbytes = 0
        for dev, host in zip(self._device, self._host):
            host.index_put_((chunks, slots), dev.index_select(0, dev_idx))
            nbytes += len(dev_idx) * dev.shape[1]
        return self._done(job_id, nbytes, t0)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """G2 -> G1, copied before returning (so ``expedited``, vLLM 0.33's
        "waited on within the step", changes nothing)."""
        t0 = time.perf_counter()
        dev_idx, chunks, slots = self._index(dst_spec, src_spec)
        nbytes = 0
        for dev, host in zip(self._device, self._host):
            dev.index_copy_(0, dev_idx, host[chunks, slots])
            nbytes += len(dev_idx) * dev.shape[1]
        return self._done(job_id, nbytes, t0)

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        # Every job completed inside its submit call.
        return

    def shutdown(self) -> None:
        self._device.clear()
        self._host.clear()
        self._region.cleanup()
