"""vLLM's own KV events (``--kv-events-config``, ZMQ publisher, msgspec
``KVEventBatch``: what llm-d's indexer and Dynamo's router subscribe to) on a
real engine (tiny model, G2 and G3 on the local disk): the ``BlockStored``
events of G2 (``medium`` "CPU") and of the G3 cascade carry the storing
request's ``session_id``, as vLLM tags device blocks; a request with no
session stays untagged. G3's eviction is reported: a ``BlockRemoved``
(medium "STORAGE") for each block the disk tier's evictor removed, and none
for a block never reported stored. (Without KV events vLLM's tracker is left
as is: tests/connectors/test_tier_stack.py; the other G3 removals, hint
copies and shared chunks: tests/connectors/test_storage_events.py.)"""

import threading
import uuid

import msgspec
import numpy as np
import pytest
import zmq
from vllm import SamplingParams
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from sessionkv.connectors.kv_events import SessionEventsTracker
from sessionkv.devtools.engines import kv_transfer_config, new_engine_id, serve, tiny_llm
from sessionkv.devtools.server import free_port, remove_offload_region

RNG = np.random.default_rng(41)
P, Q, R = (RNG.integers(10, 4000, 200).tolist() for _ in range(3))  # 6 full blocks each
PARAMS = SamplingParams(temperature=0, max_tokens=4)
G2, G3 = "CPU", "STORAGE"  # BlockStored.medium of vLLM's CPU tier and of ours


class Subscriber:
    """A ZMQ SUB socket decoding vLLM's (topic, seq, payload) messages. It
    binds: vLLM's publisher binds only wildcard endpoints (``tcp://*:N``,
    all interfaces) and connects to any other, such as a loopback one."""

    def __init__(self, endpoint):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sock.bind(endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events, self._stop = [], threading.Event()
        self.messages, self.errors = 0, []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(100):
                self.messages += 1
                try:
                    _, _, payload = self.sock.recv_multipart()
                    self.events.extend(self.decoder.decode(payload).events)
                except Exception as e:  # kept for the failure message
                    self.errors.append(repr(e))

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("events")
    (d / "tiers.yaml").write_text("report: {per_tier: all}\n")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    tier = {
        "type": "DiskTier",
        "module_path": "sessionkv.tiers.g3.backends.disk",
        "path": str(d / "g3"),
        "max_bytes": 1 << 30,
        "namespace": f"ev-{uuid.uuid4().hex[:8]}",
        "timeout_s": 10.0,
    }
    engine_id = new_engine_id()
    sub = Subscriber(endpoint)  # bound before the engine's publisher connects
    llm = tiny_llm(
        kv_transfer_config(
            engine_id,
            secondary_tiers=[tier],
            self_describing_kv_events=True,
            sessionkv={"policy_file": str(d / "tiers.yaml")},
        ),
        poison=False,
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv"
        ),
    )
    yield llm, sub
    sub.close()
    llm.llm_engine.engine_core.shutdown()
    remove_offload_region(engine_id)


def chunks(prompt):
    """The prompt's full 32-token chunks (one block per chunk here)."""
    return {tuple(prompt[i : i + 32]) for i in range(0, len(prompt) - 31, 32)}


def sessions(events, medium, prompt):
    """The session_ids of ``medium``'s BlockStored events of ``prompt``'s chunks."""
    return [
        e.session_id
        for e in events
        if isinstance(e, BlockStored)
        and e.medium == medium
        and tuple(e.token_ids) in chunks(prompt)
    ]


def test_g2_and_g3_stores_carry_the_storing_session(engine):
    import time

    llm, sub = engine
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert isinstance(scheduler.connector.scheduler._events_tracker, SessionEventsTracker)
    time.sleep(0.5)  # the subscription reaches the publisher
    serve(llm, P, PARAMS, session="agent-7")
    serve(llm, Q, PARAMS)  # no session
    deadline = time.monotonic() + 60
    while not all(len(sessions(sub.events, m, x)) >= 6 for m in (G2, G3) for x in (P, Q)):
        assert time.monotonic() < deadline, (
            sub.messages,
            sub.errors[:3],
            sorted({(e.medium, e.session_id) for e in sub.events}, key=str),
        )
        serve(llm, [5, 6, 7], SamplingParams(max_tokens=1))  # steps publish the events
        time.sleep(0.2)
    for medium in (G2, G3):
        assert set(sessions(sub.events, medium, P)) == {"agent-7"}, medium
        assert set(sessions(sub.events, medium, Q)) == {None}, medium
    # vLLM's own device events (several blocks per event) tag P the same way
    device = {
        e.session_id
        for e in sub.events
        if isinstance(e, BlockStored) and e.medium == "GPU" and list(e.token_ids[:32]) == P[:32]
    }
    assert device == {"agent-7"}, device


def stored_hashes(events, medium, prompt=None):
    return {
        h
        for e in events
        if isinstance(e, BlockStored)
        and e.medium == medium
        and (prompt is None or tuple(e.token_ids) in chunks(prompt))
        for h in e.block_hashes
    }


def removed_hashes(events, medium):
    return {
        h
        for e in events
        if isinstance(e, BlockRemoved) and e.medium == medium
        for h in e.block_hashes
    }


def test_g3_blocks_the_disk_tier_evicts_are_reported_removed(engine):
    # Issue 52: G3's BlockStored was never followed by a BlockRemoved, so an
    # indexer kept every block ever cascaded as resident in G3 for ever.
    import time

    llm, sub = engine
    tier = llm.llm_engine.engine_core.engine_core.scheduler.connector.manager.secondary_tiers[0]
    serve(llm, R, PARAMS, session="agent-9")
    deadline = time.monotonic() + 60
    while len(stored_hashes(sub.events, G3, R)) < 6:
        assert time.monotonic() < deadline, sorted(
            {(type(e).__name__, e.medium) for e in sub.events}, key=str
        )
        serve(llm, [5, 6, 7], SamplingParams(max_tokens=1))
        time.sleep(0.2)
    cascaded = stored_hashes(sub.events, G3, R)
    assert not cascaded & removed_hashes(sub.events, G3)
    assert tier._backend.evict(target=0.0, start=0.0) > 0  # its evictor, down to nothing
    while not cascaded <= removed_hashes(sub.events, G3):
        assert time.monotonic() < deadline, (cascaded, removed_hashes(sub.events, G3))
        serve(llm, [5, 6, 7], SamplingParams(max_tokens=1))  # steps publish the events
        time.sleep(0.2)
    # Only what was announced stored is announced removed.
    assert removed_hashes(sub.events, G3) <= stored_hashes(sub.events, G3)
