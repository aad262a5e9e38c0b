"""The CI gates (issue #16): the strict-skip gate of ``tests/conftest.py`` (run with ``pytester``),
every skip site's reason classifiable, ``.ci/run``'s lint stage and installs, and pytest's summary
line kept."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import (
    INSTALLED_BY_THE_TEST_COMMAND,
    PLATFORM_PREFIX,
    declared_modules,
    skip_verdict,
)

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[1]
INNER_CONFTEST = (
    "from tests.conftest import pytest_configure, pytest_unconfigure  # noqa: F401 - the gate, as "
    "the suite has it\n"
)
SKIPS = """
import pytest
# a declared test extra, missing: the whole module skipped at collection
pytest.importorskip("s3fs")

def test_never_runs():
    pass
"""
SKIP_IN_TEST = """
import pytest

def test_needs_boto3():
    pytest.importorskip("boto3")     # a declared test extra, missing

def test_ok():
    pass
"""
ALLOWED = """
import pytest

@pytest.mark.skipif(True, reason="platform: no CUDA GPU here")
def test_gpu():
    pass

def test_linux_only():
    pytest.skip("platform: no /dev/shm (not Linux)")

def test_optional_module():
    pytest.importorskip("prealign_no_such_module")   # declared nowhere: an optional tool

@pytest.mark.xfail(reason="known")
def test_xfail():
    assert False

def test_ok():
    pass
"""


@pytest.fixture
def gate(pytester, monkeypatch):
    """An inner pytest run with the suite's gate; s3fs and boto3 (declared test extras) made
    unimportable."""
    pytester.makeconftest(INNER_CONFTEST)
    for name in ("s3fs", "boto3"):
        monkeypatch.setitem(sys.modules, name, None)
    for name in ("CI", "PREALIGN_STRICT_SKIPS"):
        monkeypatch.delenv(name, raising=False)
    return pytester


@pytest.mark.parametrize("env", [{"PREALIGN_STRICT_SKIPS": "1"}, {"CI": "true"}])
def test_a_skipped_declared_extra_fails_a_strict_run(gate, monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    gate.makepyfile(test_module_skip=SKIPS, test_function_skip=SKIP_IN_TEST)
    result = gate.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*strict skips*",
            "*SKIP NOT ALLOWED*test_function_skip.py::test_needs_boto3*"
            "could not import 'boto3'*declared*",
        ]
    )
    result.stdout.fnmatch_lines(["*SKIP NOT ALLOWED*test_module_skip.py*could not import 's3fs'*"])
    result.assert_outcomes(passed=1, skipped=2)


@pytest.mark.parametrize("ci", [None, "false", "0"])
def test_the_same_skips_pass_outside_ci(gate, monkeypatch, ci):
    if ci is not None:
        monkeypatch.setenv("CI", ci)
    gate.makepyfile(test_module_skip=SKIPS, test_function_skip=SKIP_IN_TEST)
    result = gate.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK
    assert "SKIP NOT ALLOWED" not in result.stdout.str()


def test_platform_skips_undeclared_modules_and_xfails_pass_a_strict_run(gate, monkeypatch):
    monkeypatch.setenv("PREALIGN_STRICT_SKIPS", "1")
    gate.makepyfile(test_allowed=ALLOWED)
    result = gate.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.assert_outcomes(passed=1, skipped=3, xfailed=1)


def test_an_unclassified_skip_fails_a_strict_run(gate, monkeypatch):
    monkeypatch.setenv("PREALIGN_STRICT_SKIPS", "1")
    gate.makepyfile("import pytest\ndef test_x():\n    pytest.skip('not today')\n")
    result = gate.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*SKIP NOT ALLOWED*not today*platform:*"])


def test_verdicts():
    declared = declared_modules()
    assert {
        "torch",
        "numpy",
        "megatron",
        "PIL",
        "transformers",
        "datasets",
        "s3fs",
        "boto3",
        "moto",
        "hypothesis",
        "accelerate",
        "verl",
    } <= declared
    assert skip_verdict(
        "could not import 'megatron.core.utils': No module named 'megatron'", declared
    )
    assert skip_verdict(
        "module 'transformers' has __version__ '4.0', required is: '5.6.1'", declared
    )
    assert skip_verdict("platform: too few CPUs (2 < 4)", declared) is None
    assert (
        skip_verdict("could not import 'flash_attn': No module named 'flash_attn'", declared)
        is None
    )


def _skip_sites() -> list[tuple[str, int, str, str]]:
    """(file, line, kind, argument) of every skip in the suite: importorskip's module, skip's /
    skipif's reason."""
    sites = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name == Path(__file__).name:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = (
                node.func.attr
                if isinstance(node.func, ast.Attribute)
                else getattr(node.func, "id", "")
            )
            if name == "importorskip":
                sites.append((path.name, node.lineno, name, node.args[0].value))
            elif name in ("skip", "skipif"):
                reason = (
                    node.args[0]
                    if name == "skip" and node.args
                    else next((k.value for k in node.keywords if k.arg == "reason"), None)
                )
                sites.append(
                    (
                        path.name,
                        node.lineno,
                        name,
                        reason.value if isinstance(reason, ast.Constant) else None,
                    )
                )
    return sites


def test_every_skip_site_is_classifiable():
    """A skip either names a module (importorskip, or "could not import 'x'") or says "platform:
    ..."."""
    sites = _skip_sites()
    assert len(sites) >= 25, sites
    for file, line, kind, arg in sites:
        assert isinstance(arg, str), (file, line, "a literal reason")
        if kind == "importorskip":
            continue
        assert arg.startswith(PLATFORM_PREFIX) or arg.startswith("could not import '"), (
            file,
            line,
            arg,
        )


def test_ci_lints_with_the_pinned_ruff_and_runs_strict():
    ci = (ROOT / ".ci" / "run").read_text()
    pins = (ROOT / ".ci" / "constraints.txt").read_text()
    assert re.search(r"^ruff==\d", pins, re.M)
    assert "pip install -q -c .ci/constraints.txt ruff && ruff check ." in ci
    assert ci.index("ruff check .") < ci.index(
        "python -m pytest"
    )  # lint first: seconds, not minutes
    assert re.search(r"^export CI=true$", ci, re.M)


def test_ci_installs_what_the_strict_gate_requires():
    """The build system's setuptools (the wheel test builds without isolation) and every --no-deps
    install."""
    ci = (ROOT / ".ci" / "run").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    (requires,) = re.findall(r'^requires = \["(setuptools[^"]*)"\]', pyproject, re.M)
    assert f'pip install -q -c "$2" "{requires}"' in ci
    assert set(re.findall(r"pip install -q --no-deps (\w+)==", ci)) == INSTALLED_BY_THE_TEST_COMMAND
    for env in ("constraints.txt", "constraints-verl.txt", "constraints-floor.txt"):
        assert re.search(r"^setuptools==\d", (ROOT / ".ci" / env).read_text(), re.M), env


def test_quiet_runs_keep_the_summary_line(pytester):
    """pyproject's addopts plus the ``-q`` of a quiet command still print ``N passed``."""
    import shlex

    (addopts,) = re.findall(r'^addopts = "([^"]*)"', (ROOT / "pyproject.toml").read_text(), re.M)
    pytester.makepyfile("def test_a():\n    pass\n")
    result = pytester.runpytest(*shlex.split(addopts), "-q", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK
    assert re.search(r"^1 passed", result.stdout.str(), re.M), result.stdout.str()


XDIST_SKIPS = """
import pytest

def test_declared_module_missing():
    pytest.skip("could not import 'boto3': No module named 'boto3'")   # what importorskip says

def test_ok():
    pass
"""


def test_the_gate_holds_under_xdist(gate, monkeypatch):
    """``pytest -n 2`` (the README's ``-n auto``, CI): the workers' skips reach the gate in the
    controller, so a forbidden skip still fails the run and is named."""
    pytest.importorskip("xdist")
    monkeypatch.setenv("CI", "true")
    gate.makepyfile(test_xdist_skip=XDIST_SKIPS)
    result = gate.runpytest("-p", "no:cacheprovider", "-n", "2")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.stdout.fnmatch_lines(
        ["*SKIP NOT ALLOWED*test_xdist_skip.py::test_declared_module_missing*boto3*declared*"]
    )
    result.assert_outcomes(passed=1, skipped=1)
