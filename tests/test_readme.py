"""The README's two commands stay true: the test command is the one CI runs."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    lines = ROOT.joinpath("README.md").read_text().splitlines()
    return [ln.strip() for ln in lines[:12] if ln.startswith("    ") and ln.strip()]


def test_readme_opens_with_demo_and_test_commands():
    cmds = _commands()
    assert len(cmds) >= 2, cmds
    assert cmds[0].endswith("prealign demo")
    assert cmds[1].endswith("python -m pytest")


def test_ci_runs_the_readme_test_command():
    test_cmd = _commands()[1]
    ci = ROOT.joinpath(".ci", "run").read_text()
    normalised = test_cmd.replace("pip install -c", "pip install -q -c").replace("pip install --no-deps",
                                                                                "pip install -q --no-deps")
    assert normalised in ci


def test_readme_collate_example_runs():
    """The first Python example of the README is executed as written (its asserts included)."""
    import re

    block = re.findall(r"```python\n(.*?)```", ROOT.joinpath("README.md").read_text(), re.S)[0]
    exec(compile(block, "README.md", "exec"), {})
