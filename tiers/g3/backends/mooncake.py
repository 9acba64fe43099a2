"""G3 on Mooncake Store (TCP, or RDMA by configuration).

In ``kv_connector_extra_config``::

    "secondary_tiers": [{"type": "MooncakeTier", "module_path": "sessionkv.tiers.g3.backends.mooncake",
                         "master": "127.0.0.1:50051",
                         "metadata_server": "http://127.0.0.1:8080/metadata",
                         "local_hostname": "10.0.0.5", "protocol": "tcp"}]

The engine mounts no storage of its own (``global_segment_size`` 0): capacity
comes from standalone store processes (``mooncake_client``, started by
``scripts/services``), so objects outlive any engine. The G2 host region is
registered once (``register_buffer``), as are the tier's checksum slots,
and chunks move with the zero-copy scatter/gather batch calls
(``batch_put_from_multi_buffers``, ``batch_get_into_multi_buffers``): each
object is the chunk's bytes followed by their 16-byte checksum
(``inline_sums``), so a load is one batch call straight into G2 and no
checksum objects are read or written. (Measured here, 64 x 1 MiB: reading
separate checksum objects added 30 % to the read, the trailer nothing; a
checksum *before* the bytes made puts 40 % slower: the bytes land unaligned.)

Mooncake's own behaviour under faults (0.3.13, measured): a stopped master
makes ``is_exist`` wait 30 s and answer -901; a killed one answers -900 at
once for single calls and after ~4.3 s for batches; the client reconnects by
itself when a master comes back on the same address; with the store process
killed, ``is_exist`` still answers 1 and reads return nothing; with it stopped,
a read fails after ``MC_TCP_PROGRESS_TIMEOUT_SEC`` (60 s by default, 5 s here)
and busy-polls a core meanwhile. ``G3Tier``'s deadlines, breaker and checksums
turn all of these into misses.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from sessionkv.tiers.g3.tier import G3Tier, ObjectBackend, address_of

# Mooncake ErrorCodes (mooncake-store/include/types.h).
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705


class MooncakeBackend(ObjectBackend):
    """``ObjectBackend`` over one ``MooncakeDistributedStore`` client."""

    def __init__(
        self,
        *,
        master: str,
        metadata_server: str,
        local_hostname: str,
        protocol: str = "tcp",
        device_name: str = "",
        local_buffer_bytes: int = 16 << 20,
        tcp_progress_timeout_s: int = 5,
    ):
        # Mooncake reads this knob from the environment only. Its default
        # (60 s) keeps a read from a stopped store process busy-polling a core
        # for a minute; the tier abandons such calls after its own deadline.
        os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(int(tcp_progress_timeout_s)))
        from mooncake.store import MooncakeDistributedStore

        self._store = MooncakeDistributedStore()
        rc = self._store.setup(
            local_hostname, metadata_server, 0, local_buffer_bytes, protocol, device_name, master
        )
        if rc != 0:
            raise ConnectionError(
                f"Mooncake Store setup failed (rc {rc}): master {master}, metadata "
                f"{metadata_server}, local_hostname {local_hostname}, protocol {protocol}"
            )

    def register(self, buf: memoryview) -> None:
        rc = self._store.register_buffer(address_of(buf), len(buf))
        if rc != 0:
            raise ConnectionError(f"Mooncake register_buffer failed (rc {rc})")

    def exists(self, names: Sequence[str]) -> list[bool]:
        if not names:
            return []
        return [r == 1 for r in self._store.batch_is_exist(list(names))]

    def put_chunks(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[bool]:
        if not names:
            return []
        rcs = self._store.batch_put_from(
            list(names), [address_of(b) for b in bufs], [len(b) for b in bufs]
        )
        return [rc == 0 or rc == OBJECT_ALREADY_EXISTS for rc in rcs]

    def get_chunks(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[int]:
        if not names:
            return []
        rcs = self._store.batch_get_into(
            list(names), [address_of(b) for b in bufs], [len(b) for b in bufs]
        )
        return [rc if rc > 0 else -1 for rc in rcs]

    inline_sums = True
    sum_objects = False  # Mooncake shows an object only once whole: lookups ask for it
    put_replaces = False  # a put keeps an object already there (0.3.13 answers 0)

    def put_summed(
        self, names: Sequence[str], bufs: Sequence[memoryview], sums: Sequence[memoryview]
    ) -> list[bool]:
        rcs = self._scatter_gather(self._store.batch_put_from_multi_buffers, names, bufs, sums)
        return [rc == 0 or rc == OBJECT_ALREADY_EXISTS for rc in rcs]

    def get_summed(
        self, names: Sequence[str], bufs: Sequence[memoryview], sums: Sequence[memoryview]
    ) -> list[int]:
        rcs = self._scatter_gather(self._store.batch_get_into_multi_buffers, names, bufs, sums)
        return [rc - len(s) if rc >= len(s) else -1 for rc, s in zip(rcs, sums)]

    @staticmethod
    def _scatter_gather(call, names, bufs, sums) -> list[int]:
        """One object per name: its buffer, then its checksum (two parts)."""
        if not names:
            return []
        return call(
            list(names),
            [[address_of(b), address_of(s)] for b, s in zip(bufs, sums)],
            [[len(b), len(s)] for b, s in zip(bufs, sums)],
        )

    def put_small(self, names: Sequence[str], values: Sequence[bytes]) -> list[bool]:
        if not names:
            return []
        ok = self._store.upsert_batch(list(names), list(values)) == 0
        return [ok] * len(names)

    def get_small(self, names: Sequence[str], limit: int | None = None) -> list[bytes | None]:
        """``limit`` is applied after the read: Mooncake's batch get returns
        whole objects (no path here reads Mooncake with it: loads and
        lookups go through ``get_summed`` into fixed buffers and ``exists``)."""
        if not names:
            return []
        return [
            v if v and (limit is None or len(v) <= limit) else None
            for v in self._store.get_batch(list(names))
        ]

    def remove(self, names: Sequence[str]) -> list[bool]:
        if not names:
            return []
        return [
            rc == 0 or rc == OBJECT_NOT_FOUND for rc in self._store.batch_remove(list(names), True)
        ]

    # Mooncake pins when an object is put or upserted (a soft pin with its own
    # TTL; the master must run with --allow_evict_soft_pinned_objects=false),
    # so a pin rewrites each object whole: ``values`` are bytes and checksum,
    # staged by the tier in a registered buffer and upserted from there
    # (``batch_upsert_from``, zero-copy; ``upsert_batch`` copied every value
    # into the client's local buffer, and failed the whole batch past its
    # 16 MiB). Never hard pins: they do not expire.
    pin_needs_bytes = True

    def pin(
        self, names: Sequence[str], ttl_s: float, values: Sequence[memoryview] | None
    ) -> list[bool]:
        if not names:
            return []
        from mooncake.store import ReplicateConfig, SoftPinAction

        cfg = ReplicateConfig()
        cfg.soft_pin_action = SoftPinAction.ENABLE
        cfg.soft_pin_ttl_ms = max(1, int(ttl_s * 1000))
        assert values is not None  # pin_needs_bytes: the tier's RewritePins passes them
        rcs = self._store.batch_upsert_from(
            list(names), [address_of(v) for v in values], [len(v) for v in values], cfg
        )
        return [rc == 0 for rc in rcs]

    def close(self) -> None:
        self._store.close()


class MooncakeTier(G3Tier):
    """G3 tier on Mooncake Store (see the module docstring). Tier config keys:
    ``master``, ``metadata_server``, ``local_hostname``, ``protocol``,
    ``device_name``, ``tcp_progress_timeout_s``, and ``G3Tier``'s own."""

    backend_class = MooncakeBackend
