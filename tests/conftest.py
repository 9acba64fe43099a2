"""Shared test setup: local models, the e2e helpers on the path, engine env."""

import os
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
E2E = ROOT / "tests" / "e2e"
MODELS = Path(os.environ.get("SESSIONKV_MODELS", ROOT / ".cache" / "models"))

# Engines in tests run in-process (start in ~10 s instead of ~35 s), with a
# small G1 so that they fit next to each other. Servers started by tests get
# the e2e folder on PYTHONPATH for the test-only worker extension.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(E2E))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(E2E), os.environ.get("PYTHONPATH")) if p
)


@pytest.fixture(scope="session")
def mooncake(tmp_path_factory):
    """A real mooncake_master and one standalone store process (512 MB) on
    free ports, for the whole session. Inside scripts/test's private network
    namespace where the machine allows one (it says so when it does not)."""
    from sessionkv.services import lan_address, start_mooncake
    if not os.environ.get("SESSIONKV_NETNS"):
        warnings.warn("no private network namespace: Mooncake's store process listens on "
                      f"all interfaces ({lan_address()}) while the tests run")
    ports, master, store = start_mooncake(tmp_path_factory.mktemp("mooncake"))
    yield ports
    store.stop()
    master.stop()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server (volatile-lru, 256 MB) on a free port, for the session."""
    from sessionkv.services import start_redis
    url, server = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    server.stop()


@pytest.fixture(scope="session")
def lmcache_url(tmp_path_factory):
    """A real LMCache storage server (``lmcache_server ... cpu``) on a free port."""
    from sessionkv.services import start_lmcache
    url, server = start_lmcache(tmp_path_factory.mktemp("lmcache"))
    yield url
    server.stop()
