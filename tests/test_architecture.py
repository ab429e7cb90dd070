"""The tree keeps the design: layers (import-linter), few top-level modules, and no
private name reached across packages."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "tiermem"
TOP_LEVEL_LIMIT = 12  # modules directly in tiermem/: the rest lives in its layer's package


def _package_of(module: str) -> str:
    """tiermem.optim.rules.adam -> tiermem.optim (a layer); tiermem.config -> tiermem.config."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _module_name(path: Path, repo: Path) -> str:
    rel = path.relative_to(repo).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


NATIVE = ("tiermem._lib", "tiermem._native")  # the compiled module and its loader: shared


def private_imports_across_packages(repo: Path = REPO) -> list[str]:
    """`from tiermem.x import _name` (or `tiermem.x._name`) where x is another layer."""
    found = []
    for path in sorted((repo / "tiermem").rglob("*.py")):
        here = _package_of(_module_name(path, repo))
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and node.module.startswith("tiermem"):
                there = _package_of(node.module)
                for alias in node.names:
                    private = alias.name.startswith("_") or any(
                        p.startswith("_") for p in node.module.split(".")[1:])
                    if private and there != here and node.module not in NATIVE:
                        found.append(f"{path.relative_to(repo)}:{node.lineno}: "
                                     f"from {node.module} import {alias.name}")
    return found


def test_no_private_name_is_imported_across_packages():
    assert private_imports_across_packages() == []


def test_the_private_name_check_finds_one(tmp_path):
    """The check above can fail: a module reaching into another layer's private name."""
    pkg = tmp_path / "tiermem"
    (pkg / "optim").mkdir(parents=True)
    (pkg / "optim" / "x.py").write_text("from tiermem.tiers.pipeline import _Slot\n")
    assert private_imports_across_packages(tmp_path) == [
        "tiermem/optim/x.py:1: from tiermem.tiers.pipeline import _Slot"]


def test_few_modules_sit_directly_in_the_package():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= TOP_LEVEL_LIMIT, top


def test_every_layer_is_a_package():
    for name in ("tools", "dist", "optim", "tiers", "device", "swap", "kernels", "io",
                 "telemetry"):
        assert (PKG / name / "__init__.py").is_file(), name


def test_the_layer_contract_holds():
    pytest.importorskip("importlinter")
    out = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()"],
        cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout
