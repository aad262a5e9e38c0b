"""What a user reads is true: docs/design.md's "Layout of the code" names every module and
benchmark."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = [
    "schemas",
    "collate",
    "collate/vision",
    "loaders",
    "loaders/sources",
    "loaders/handoff",
    "loaders/media",
    "loaders/index",
    "loaders/plan",
    "loaders/serve",
    "loaders/cli",
    "src/prealign",
]


def _layout_rows() -> dict[str, str]:
    text = ROOT.joinpath("docs", "design.md").read_text()
    section = text.split("## Layout of the code", 1)[1].split("\n## ", 1)[0]
    return {
        m.group(1): m.group(2) for m in re.finditer(r"^\| `([^`]+)/` \| (.*) \|$", section, re.M)
    }


def test_the_layout_names_every_module_and_benchmark():
    rows = _layout_rows()
    missing = []
    for folder in FOLDERS:
        row = rows.get(folder, "")
        for path in sorted((ROOT / folder).glob("*.py")):
            if path.name == "__init__.py" and folder != "src/prealign":
                continue
            if f"`{path.name}`" not in row and f"`{path.stem}`" not in row:
                missing.append(f"{folder}/{path.name}")
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        if f"`{path.name}`" not in rows.get("benchmarks", ""):
            missing.append(f"benchmarks/{path.name}")
    assert not missing, f"docs/design.md 'Layout of the code' does not name: {missing}"


def test_the_layout_names_no_module_that_is_gone():
    rows = _layout_rows()
    for folder in [f for f in FOLDERS if f != "src/prealign"] + [
        "benchmarks"
    ]:  # (src: "a user's own collate.py")
        for name in re.findall(r"`(\w+\.py)`", rows.get(folder, "")):
            assert (ROOT / folder / name).exists(), (
                f"docs/design.md names {folder}/{name}, which does not exist"
            )


def test_the_readme_quickstart_prints_what_the_readme_says(capsys):
    readme = ROOT.joinpath("README.md").read_text()
    block = re.findall(r"```python\n(.*?)```", readme, re.S)[0]
    exec(compile(block, "README.md", "exec"), {})
    printed = capsys.readouterr().out.strip()
    assert printed and f"It prints `{printed}`" in readme, printed


def test_ci_runs_the_slow_tests_once_and_the_readme_says_so():
    ci = ROOT.joinpath(".ci", "run").read_text()
    readme = ROOT.joinpath("README.md").read_text()
    assert ci.count('python -m pytest -m "not slow"') == 1 and "for env in verl floor" in ci
    assert 'python -m pytest -m "not slow"' in readme and re.search(r"about \d+ minutes", readme)
