"""prealign installs as one top-level package and works beside a user's own ``collate`` /
``schemas`` / ``loaders``; every docstring example in the package runs."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import prealign

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> list[str]:
    names = ["prealign"]
    for pkg in ("prealign.schemas", "prealign.collate", "prealign.loaders"):
        mod = importlib.import_module(pkg)
        names += [pkg] + [m.name for m in pkgutil.walk_packages(mod.__path__, pkg + ".")]
    return names


def test_every_docstring_example_runs():
    ran = 0
    for name in _modules():
        if name.endswith("__main__"):
            continue
        result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, name
        ran += result.attempted
    assert ran >= 20, ran  # the examples are really there


def test_common_entry_points_are_offered_lazily():
    assert prealign.THDCollator is importlib.import_module("prealign.collate").THDCollator
    assert prealign.PackedLoader is importlib.import_module("prealign.loaders").PackedLoader
    assert set(prealign.__all__) <= set(dir(prealign)) and "ParallelLayout" in dir(prealign)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        prealign.nope


USER_FILES = {
    "collate.py": "WHO = 'user collate'\n",
    "loaders.py": "WHO = 'user loaders'\n",
    "schemas/__init__.py": "WHO = 'user schemas'\n",
    "empty_pkg_like_schemas/.keep": "",
}

USER_SCRIPT = textwrap.dedent("""
    import collate, loaders, schemas                      # the user's own modules win their names
    assert collate.WHO == "user collate"
    assert (loaders.WHO, schemas.WHO) == ("user loaders", "user schemas")
    import prealign
    from prealign.collate import THDCollator
    from prealign.loaders import PackedLoader, plan_microbatches
    from prealign.schemas import ParallelLayout, causal_lm_schema, validate_batch
    layout = ParallelLayout(tp=2, cp=2)
    schema = causal_lm_schema()
    batch = THDCollator(schema=schema, layout=layout, cp_rank=1)([{"input_ids": list(range(1, 8))}])
    assert validate_batch(batch, schema, layout, raise_on_error=False) == []
    assert not hasattr(schemas, "validate")    # nothing grafted under the user's package
    print("ok", batch["input_ids"].shape[1])
""")


@pytest.mark.slow
def test_runs_from_a_folder_with_its_own_collate_schemas_and_loaders(tmp_path, subprocess_env):
    for rel, text in USER_FILES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "train.py").write_text(USER_SCRIPT)
    out = subprocess.run(
        [sys.executable, "train.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=subprocess_env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", "4"]


@pytest.mark.slow
def test_the_wheel_installs_nothing_but_prealign_at_the_top_level(tmp_path):
    pytest.importorskip("setuptools", minversion="77")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("prealign-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"prealign", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for module in (
        "prealign/collate/thd.py",
        "prealign/loaders/cli/main.py",
        "prealign/schemas/validate.py",
        "prealign/__main__.py",
    ):
        assert module in names
    assert not any(n.startswith("prealign/tests") or "/benchmarks/" in n for n in names)
