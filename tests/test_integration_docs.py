"""The examples of docs/guide/integrations/*.md run as written.

Every ```python block of a page runs, in order, in one namespace (a page's later blocks use
what its first defined), in a fresh working directory (the examples write ./tiermem-swap,
checkpoints and out/). Snippets that cannot run alone are fenced as ```text or ```yaml.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from offload_helpers import listdir

PAGES = Path(__file__).resolve().parent.parent / "docs" / "guide" / "integrations"
NEEDS = {"lightning": "lightning.pytorch", "accelerate": "accelerate",
         "transformers": "transformers"}
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks(page: Path) -> list[str]:
    return FENCE.findall(page.read_text())


@pytest.mark.parametrize("page", sorted(NEEDS))
def test_page_example_runs(page, tmp_path, monkeypatch):
    pytest.importorskip(NEEDS[page], reason=f"{NEEDS[page]} is not installed "
                        "(pip install -e '.[integrations]')")
    code = blocks(PAGES / f"{page}.md")
    assert len(code) >= 2, f"{page}.md: expected a training and a resume example"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{page}"}
    for i, block in enumerate(code):
        exec(compile(block, f"docs/guide/integrations/{page}.md[python block {i}]", "exec"),
             namespace)
    # every example left its block: state handed back, swap directory emptied
    assert listdir(tmp_path / "tiermem-swap") == []


def test_every_page_is_tested():
    assert sorted(p.stem for p in PAGES.glob("*.md")) == sorted(NEEDS)
