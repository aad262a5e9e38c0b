"""The README's two commands stay true (the test command is the one CI runs), it stays short and
points into ``docs/``, its quickstart runs, and the documentation site lists every page it has."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT.joinpath("README.md").read_text()


def _commands() -> list[str]:
    lines = README.splitlines()
    return [ln.strip() for ln in lines[:12] if ln.startswith("    ") and ln.strip()]


def test_readme_opens_with_demo_and_test_commands():
    cmds = _commands()
    assert len(cmds) >= 2, cmds
    assert cmds[0].endswith("prealign demo")
    assert cmds[1].endswith("python -m pytest -n auto")  # every core (pytest-xdist, the test extra)


def test_ci_runs_the_readme_test_command():
    test_cmd = _commands()[1]
    ci = ROOT.joinpath(".ci", "run").read_text()
    normalised = test_cmd.replace("pip install -c", "pip install -q -c").replace(
        "pip install --no-deps", "pip install -q --no-deps"
    )
    assert normalised in ci


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_readme_quickstart_runs():
    """The README's Python quickstart is executed as written (its asserts included)."""
    block = _python_blocks(README)[0]
    assert len(block.strip().splitlines()) <= 12
    exec(compile(block, "README.md", "exec"), {})


def test_collate_page_example_runs():
    """The collate example (the README's first, now the first of docs/collate.md) runs as
    written."""
    block = _python_blocks(ROOT.joinpath("docs", "collate.md").read_text())[0]
    exec(compile(block, "docs/collate.md", "exec"), {})


def test_readme_is_short_and_its_links_resolve():
    assert len(README.splitlines()) <= 200
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith("http"):
            assert ROOT.joinpath(target).exists(), f"README links to {target}, which does not exist"


def test_moved_content_is_in_the_docs():
    """What the README used to hold lives in docs/: the benchmark tables and how to rerun them, the
    compatibility matrix, the batch contract, the design choices."""
    docs = ROOT / "docs"
    assert "python benchmarks/bench_collate.py" in (docs / "benchmarks.md").read_text()
    assert "verl/ours" in (docs / "benchmarks.md").read_text()
    assert ".ci/constraints-floor.txt" in (docs / "compatibility.md").read_text()
    assert "cu_seqlens_padded" in (docs / "collate.md").read_text()
    assert "FP8 under SP" in (docs / "design.md").read_text()


def test_mkdocs_nav_lists_every_page_and_every_relative_link_resolves():
    config = "\n".join(
        ln
        for ln in ROOT.joinpath("mkdocs.yml").read_text().splitlines()
        if not ln.lstrip().startswith("#")
    )
    listed = set(re.findall(r":\s*([\w./-]+\.md)\s*$", config, re.M))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    later = {
        "vlm.md",
        "balance.md",
        "scale.md",
        "resume.md",
    }  # written alongside, added to the nav at merge
    assert pages - later <= listed, (
        f"pages not in mkdocs.yml's nav: {sorted(pages - later - listed)}"
    )
    assert listed <= pages, f"nav names missing pages: {sorted(listed - pages)}"
    for page in (ROOT / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to {target}"
        for snippet in re.findall(r'--8<-- "([^"]+)"', page.read_text()):
            assert (ROOT / snippet).exists(), f"{page.name} includes {snippet}"
