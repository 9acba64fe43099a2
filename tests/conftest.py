"""Shared test fixtures: the engine environment and the real backend services.
Helpers shared with the benches live in ``sessionkv.devtools``."""

import os
import warnings

import pytest


def _vllm() -> str:
    import vllm

    return f"vllm {vllm.__version__} ({os.path.dirname(vllm.__file__)})"


def pytest_report_header(config):
    """Which vLLM this run tests: scripts/test runs one pass per release."""
    return _vllm()


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"tested on {_vllm()}")


def pytest_configure(config):
    """Engines in tests run in-process with a small G1 (``ENGINE_ENV``), set
    before any test module imports vLLM."""
    from sessionkv.devtools.engines import use_engine_env

    use_engine_env()


@pytest.fixture(scope="session")
def mooncake(tmp_path_factory):
    """A real mooncake_master and one standalone store process (512 MB) on
    free ports, for the whole session. Inside scripts/test's private network
    namespace where the machine allows one (it says so when it does not)."""
    from sessionkv.devtools.services import lan_address, start_mooncake

    if not os.environ.get("SESSIONKV_NETNS"):
        warnings.warn(
            "no private network namespace: Mooncake's store process listens on "
            f"all interfaces ({lan_address()}) while the tests run",
            stacklevel=2,
        )
    ports, master, store = start_mooncake(tmp_path_factory.mktemp("mooncake"))
    yield ports
    store.stop()
    master.stop()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server (volatile-lru, 256 MB) on a free port, for the session."""
    from sessionkv.devtools.services import start_redis

    url, server = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    server.stop()


@pytest.fixture(scope="session")
def lmcache_url(tmp_path_factory):
    """A real LMCache storage server (``lmcache_server ... cpu``) on a free port."""
    from sessionkv.devtools.services import start_lmcache

    url, server = start_lmcache(tmp_path_factory.mktemp("lmcache"))
    yield url
    server.stop()


@pytest.fixture(scope="session")
def g3_disk(tmp_path_factory):
    """The local-disk G3's directory (``tiers/g3/backends/disk.py``), for the session:
    nothing to start; engines and tiers on it share objects and one limit."""
    return str(tmp_path_factory.mktemp("g3-disk"))
