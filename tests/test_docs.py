"""The docs that are generated or promised stay in step with the code."""

from pathlib import Path

import pytest

from tiermem.config import load_config, reference

ROOT = Path(__file__).resolve().parents[1]


def test_config_reference_lists_every_key():
    """docs/config.md (from `tiermem validate --reference`) names every config key."""
    text = (ROOT / "docs" / "config.md").read_text()
    missing = [key for key, *_ in reference() if f"`{key}`" not in text]
    assert not missing, f"docs/config.md lacks {missing}; regenerate it"


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    """Every config in configs/ is valid."""
    load_config(path)


def test_readme_gives_the_two_commands():
    """The README's quick start is `make run` and `make test`, and CI runs the latter."""
    readme = (ROOT / "README.md").read_text()
    assert "make run" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
