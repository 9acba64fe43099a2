"""The reference router (RFC phase 3): session affinity then load in front of
several engines, session state in Redis, a YAML policy that turns session
lifecycle into signed hints. It speaks HTTP and the control channel only (no
vLLM or connector imports).

``app`` is the HTTP proxy and composition root; ``routing`` chooses a turn's
worker; ``hinting`` decides every hint and when (no I/O, its clock
injected), with ``retains`` ranking what G2 keeps; ``transport`` sends what
``hinting`` decides; ``config`` reads router.yaml.
"""

from sessionkv.router.app import Router, serve
from sessionkv.router.config import RouterConfig, load_config, parse_config

__all__ = ["Router", "RouterConfig", "load_config", "parse_config", "serve"]
