"""Layers point one way: tools -> kvd -> engine -> kernels, transports beside kvd.

A lint over the source: every module's imports (top-level and inside functions,
``import x`` and ``from x import y``, relative ones resolved) are parsed with
``ast`` and none may name a package above its own, or one beside it that it
has no business with. Kernels know nothing of the model (as ggml's CPU kernels
know nothing of llama.cpp's models); the engine knows no daemon; transports
move bytes and know neither the engine nor the kernels.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tools", "kvd", "engine", "kernels", "transports")
# package -> the packages of this tree its modules may not import
FORBIDDEN = {
    "kernels": {"engine", "kvd", "tools", "transports"},
    "engine": {"kvd", "tools", "transports"},
    "transports": {"engine", "kernels", "tools"},
    "kvd": {"tools"},
}


def imported_packages(source: str, module: str) -> list[tuple[int, str]]:
    """(line, top-level package) of every import in ``source``, the source of the dotted
    ``module`` (which resolves its relative imports), wherever in the file it stands."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:                          # from . import x / from ..a import b
                base = module.split(".")[:-node.level]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name.split(".")[0]))
    return found


def test_the_lint_sees_every_kind_of_import():
    source = ("import engine.model.llama\nfrom kvd import protocol\n"
              "def f():\n    from tools.bench import x\n    import torch\n"
              "from . import quant\nfrom ..engine import y\n")
    assert sorted(imported_packages(source, "kernels.native")) == [
        (1, "engine"), (2, "kvd"), (4, "tools"), (5, "torch"), (6, "kernels"), (7, "engine")]


def modules(package: str) -> list[tuple[Path, str]]:
    """(path, dotted module name) of every source file under ``package``/."""
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1] + ["__init__"]       # its relative imports resolve against the package
        out.append((path, ".".join(parts)))
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_module_imports_a_layer_above_or_beside_it(package):
    files = modules(package)
    assert files, f"no sources under {package}/"
    found = [f"{path.relative_to(ROOT)}:{line}: imports {name}"
             for path, module in files for line, name in imported_packages(path.read_text(), module)
             if name in FORBIDDEN[package]]
    assert not found, (f"{package}/ may not import {', '.join(sorted(FORBIDDEN[package]))} "
                       "(tools -> kvd -> engine -> kernels, transports beside kvd):\n" + "\n".join(found))
