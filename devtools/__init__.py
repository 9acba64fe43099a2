"""Development tools, not the product: launchers for the backend services and
for vLLM server processes, and the helpers the tests and benches share
(engines, keys, the G3 fault scenario, a stand-in ``OffloadingSpec``).

Nothing in the product (``sessionkv``, ``index``, ``tiers``, ``connectors``,
``router``) imports this package; ``tests/test_layers.py`` checks it."""
