"""The layer contract of docs/design/architecture.md, read from the source: every import
(at the top of a module or inside a function) of every product module.

``import-linter`` walks the ``sessionkv/`` folder only and does not see the
folders that ``package-dir`` maps into ``sessionkv.*`` (index/, tiers/, ...),
so this test reads the folders itself and names each module as installed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# folder -> installed package (pyproject.toml's package-dir)
FOLDERS = {
    "sessionkv": "sessionkv",
    "index": "sessionkv.index",
    "tiers": "sessionkv.tiers",
    "engine": "sessionkv.engine",
    "connectors": "sessionkv.connectors",
    "router": "sessionkv.router",
    "devtools": "sessionkv.devtools",
}
# The public API: sessionkv/ but for its applications (the CLI and the doctor).
API = "api"
CLI = ("sessionkv.cli", "sessionkv.doctor")
# layer -> the layers it may import (besides itself). Imports go downwards only.
MAY_IMPORT = {
    API: set(),
    "sessionkv.index": {API},
    "sessionkv.tiers": {"sessionkv.index", API},
    "sessionkv.engine": {"sessionkv.tiers", "sessionkv.index", API},
    "sessionkv.connectors": {"sessionkv.engine", "sessionkv.tiers", "sessionkv.index", API},
    "sessionkv.router": {API},
    "cli": {"sessionkv.router", API},
    "sessionkv.devtools": {
        "sessionkv.connectors",
        "sessionkv.engine",
        "sessionkv.tiers",
        "sessionkv.index",
        "sessionkv.router",
        "cli",
        API,
    },
}
# Third-party packages a layer must not import: the index and the API are pure
# (they run in routers and clients without vLLM); the router speaks HTTP and
# the control channel only; the engine reaches vLLM only through the tiers.
ENGINE_ONLY = ("vllm", "torch", "lmcache", "mooncake")
FORBIDDEN = {
    API: ENGINE_ONLY,
    "cli": ENGINE_ONLY,
    "sessionkv.index": ENGINE_ONLY,
    "sessionkv.router": ENGINE_ONLY,
    "sessionkv.engine": ENGINE_ONLY,
}


def module_name(path: Path, root: Path = ROOT) -> str:
    folder, *rest = path.relative_to(root).with_suffix("").parts
    parts = [FOLDERS[folder], *rest]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str | None:
    """The layer of an installed ``sessionkv`` module, None for anything else."""
    if module in CLI:
        return "cli"
    for pkg in sorted(FOLDERS.values(), key=len, reverse=True):
        if pkg != "sessionkv" and (module == pkg or module.startswith(pkg + ".")):
            return pkg
    return API if module == "sessionkv" or module.startswith("sessionkv.") else None


def imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file, relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from sessionkv import control`` imports sessionkv.control
            out += [
                (node.lineno, f"{base}.{a.name}" if base == "sessionkv" else base)
                for a in node.names
            ]
    return out


def violations(root: Path = ROOT) -> list[str]:
    bad = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            module = module_name(path, root)
            mine = layer_of(module)
            for line, name in imports(path, module):
                theirs = layer_of(name)
                where = f"{path.relative_to(root)}:{line}: {module} ({mine}) imports {name}"
                if theirs is not None and theirs != mine and theirs not in MAY_IMPORT[mine]:
                    bad.append(f"{where} ({theirs}): imports go downwards only")
                if name.split(".")[0] in FORBIDDEN.get(mine, ()):
                    bad.append(f"{where}: this layer runs without vLLM")
    return bad


def test_every_import_goes_down_the_layers():
    assert violations() == []


def test_every_product_folder_is_an_installed_package():
    pyproject = (ROOT / "pyproject.toml").read_text()
    for folder, pkg in FOLDERS.items():
        assert f'"{pkg}" = "{folder}"' in pyproject


@pytest.mark.parametrize(
    "source, wrong",
    [
        ("from sessionkv.connectors.manager import SessionTierManager\n", "downwards"),
        ("from ..connectors import manager\n", "downwards"),
        ("def f():\n    import vllm\n", "without vLLM"),
    ],
)
def test_a_wrong_import_is_found(tmp_path, source, wrong):
    """The check itself: an upward import, relative or lazy, or vLLM in the index."""
    for folder in FOLDERS:
        (tmp_path / folder).mkdir()
    (tmp_path / "index" / "bad.py").write_text(source)
    found = violations(tmp_path)
    assert len(found) == 1 and wrong in found[0], found
