"""``tiers/compat.py`` is the one place that touches vLLM's private
names (ARCHITECTURE.md): no other class of ours that subclasses a vLLM class
defines, reads or writes an underscore name that a vLLM class in its MRO
defines or sets. Checked on the vLLM this process runs (both passes of
``scripts/test``), against that release's own classes."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import textwrap

from sessionkv import connectors, engine, tiers
from sessionkv.tiers import compat

# Every module of the layers that subclass vLLM's classes but compat itself,
# found by walking the packages, so that a new or split module is checked too.
MODULES = tuple(
    m.name
    for pkg in (connectors, engine, tiers)
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")
    if m.name != compat.__name__
)
_SET = re.compile(r"self\.(_[a-zA-Z]\w*)\s*(?::[^=\n]*)?=")


def _is_vllm(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "vllm"


def _private(name: str) -> bool:
    # _abc_impl: every ABC subclass gets its own (abc's machinery, not vLLM's).
    return name.startswith("_") and not name.startswith("__") and name != "_abc_impl"


def vllm_private_names(cls: type) -> set[str]:
    """Underscore names vLLM's classes in ``cls``'s MRO define or set."""
    out: set[str] = set()
    for base in cls.__mro__:
        if not _is_vllm(base):
            continue
        out |= {n for n in vars(base) if _private(n)}
        try:
            out |= set(_SET.findall(inspect.getsource(base)))
        except (OSError, TypeError):
            pass
    return out


def ours() -> list[type]:
    found = []
    for name in MODULES:
        mod = importlib.import_module(name)
        for obj in vars(mod).values():
            if (
                inspect.isclass(obj)
                and obj.__module__ == name
                and any(_is_vllm(b) for b in obj.__mro__)
            ):
                found.append(obj)
    return found


def self_names(cls: type) -> set[str]:
    """``self.<name>`` of every method defined in ``cls`` itself."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
    }


def test_our_vllm_subclasses_leave_vllms_private_names_to_compat():
    classes = ours()
    assert {c.__name__ for c in classes} >= {
        "SessionTierConnector",
        "SessionTierManager",
        "SessionPrimaryTier",
        "SessionTierSpec",
        "SessionCachePolicy",
        "TorchCopyWorker",
    }
    offences = []
    for cls in classes:
        private = vllm_private_names(cls)
        defined = {n for n in vars(cls) if _private(n)} & private
        used = {n for n in self_names(cls) if _private(n)} & private
        for n in sorted(defined | used):
            offences.append(f"{cls.__module__}.{cls.__name__}: {n}")
    assert not offences, (
        "private vLLM names outside tiers/compat.py (add them there, "
        "with the reason):\n" + "\n".join(offences)
    )


def test_compat_names_what_it_touches():
    # Every private vLLM name compat's mixins override or read is in its table.
    doc = compat.__doc__
    for mixin in (compat.QuarantinedSlots, compat.CascadeGate, compat.ParkedCascades):
        for n in {n for n in vars(mixin) if _private(n)} | {
            n for n in self_names(mixin) if _private(n)
        }:
            if n in ("_leave_out", "_parked"):
                continue  # its own helpers
            assert f"``{n}``" in doc, n
    for n in ("_policy", "_acquire_step", "_release_step"):
        assert f"``{n}``" in doc and n in inspect.getsource(compat), n
