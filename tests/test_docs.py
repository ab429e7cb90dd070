"""The docs that are generated or promised stay in step with the code."""

from pathlib import Path

import pytest

from tiermem.config import load_config, reference

ROOT = Path(__file__).resolve().parents[1]


def test_config_reference_lists_every_key():
    """docs/guide/config.md (from `tiermem validate --reference`) names every config key."""
    text = (ROOT / "docs" / "guide" / "config.md").read_text()
    missing = [key for key, *_ in reference() if f"`{key}`" not in text]
    assert not missing, f"docs/guide/config.md lacks {missing}; regenerate it"


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    """Every config in configs/ is valid."""
    load_config(path)


def test_readme_gives_the_two_commands():
    """The README's quick start is `make run` and `make test`, and CI runs the latter."""
    readme = (ROOT / "README.md").read_text()
    assert "make run" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_torch_floor_is_the_same_everywhere():
    """pyproject's `torch>=X.Y`, the Makefile's check before it installs the pinned wheel, and
    the README state one floor (make cannot read pyproject, so they are kept in step here)."""
    import re
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (floor,) = [re.fullmatch(r"torch>=(\d+)\.(\d+)", d).groups() for d in deps
                if d.startswith("torch")]
    major, minor = map(int, floor)
    makefile = (ROOT / "Makefile").read_text()
    assert f"< ({major}, {minor})" in makefile, "Makefile's TORCH_OK checks another floor"
    assert f"older than {major}.{minor}" in makefile
    assert f"older than {major}.{minor}" in (ROOT / "README.md").read_text()


def test_user_guide_is_for_users():
    """docs/guide/ holds no test names, no paths of this machine and no session tooling:
    that material lives in docs/dev/."""
    import re

    bad = re.compile(r"tests/|test_[a-z_]+|/work/|/root/|gpu_session|gpu_prepare|lent a GPU"
                     r"|\b20\d\d-\d\d-\d\d\b")  # dates: a run diary belongs in docs/dev/
    found = [f"{p.relative_to(ROOT)}:{i}: {m.group(0)}"
             for p in sorted((ROOT / "docs" / "guide").rglob("*.md"))
             for i, line in enumerate(p.read_text().splitlines(), 1)
             for m in [bad.search(line)] if m]
    assert not found, found


def test_readme_offers_pip_and_shipped_configs():
    readme = (ROOT / "README.md").read_text()
    assert "pip install" in readme and "liburing-dev" in readme
    assert "configs/nvme.yaml" not in readme.split("## From a clone")[0]  # not installed
    assert "tiermem init-config" in readme
    assert "bitwise equal to the plain optimizer" not in readme
    assert "not built yet" not in readme  # the GPU step is built (not yet run on a GPU)


def test_readme_lists_every_guide_page():
    """The README's docs list names every page of the user guide (it once left out
    overlap.md)."""
    readme = (ROOT / "README.md").read_text()
    docs = readme.split("## Docs", 1)[1].split("\n## ", 1)[0]
    missing = [p.name for p in sorted((ROOT / "docs" / "guide").glob("*.md"))
               if f"`{p.name}`" not in docs]
    assert not missing, missing


def test_docs_say_what_opt_state_holds_inside_the_block():
    """opt.state holds none of the per-parameter state inside the block (it is in
    tiermem's records), and reading or writing a parameter's entry there is refused: the
    README and the quick start say so, and what to use instead."""
    for page in (ROOT / "README.md", ROOT / "docs" / "guide" / "quick-start.md"):
        text = page.read_text()
        assert "opt.state[p]" in text and "refused" in text and "opt.state_dict()" in text, \
            page.name


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    import re

    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_doc_links_resolve():
    """Every relative link in the README and docs/ (and every `docs/....md` named in the
    text, code and configs) points at a file that exists, and an #anchor at a heading
    in it: pages move between guide/ and dev/, and a reader must not land on nothing."""
    import re

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    link = re.compile(r"\]\(([^)\s]+)\)")
    named = re.compile(r"\bdocs/[\w./-]+\.md")
    broken = []
    for page in pages:
        text = page.read_text()
        for target in link.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md":
                heads = {_slug(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), re.M)}
                if anchor not in heads:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    sources = [*pages, *sorted((ROOT / "tiermem").rglob("*.py")),
               *sorted((ROOT / "tiermem").rglob("*.yaml")), *sorted((ROOT / "bench").glob("*.py"))]
    for src in sources:
        for name in named.findall(src.read_text()):
            if not (ROOT / name).exists():
                broken.append(f"{src.relative_to(ROOT)}: {name}")
    assert not broken, broken


def test_guide_figures_exist_and_say_how_they_were_made():
    """Each figure the guide shows is in docs/guide/img/ and the page gives the command;
    the four the first-hour issue asked for are shown."""
    import re

    shown = set()
    for page in sorted((ROOT / "docs" / "guide").rglob("*.md")):
        text = page.read_text()
        for img in re.findall(r"!\[[^\]]*\]\((img/[^)]+)\)", text):
            assert (page.parent / img).exists(), f"{page.name}: {img} missing"
            shown.add(img)
            after = text.split(img, 1)[1][:400]
            assert "bench/docs_plots.py" in after, f"{page.name}: {img} without its command"
    assert shown >= {"img/step-floors.png", "img/io-grid.png", "img/bf16-error.png",
                     "img/durability-cost.png"}, shown
