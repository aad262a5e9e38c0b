"""The curated surface: ``prealign.loaders`` exports at most 30 names, imported on first use; a name
it exported before still resolves (with a DeprecationWarning naming its module); planning imports no
torch."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

import prealign.loaders as loaders
import prealign.schemas as schemas

# Modules that must load without torch (pure numpy / JSON): planning, and the index's columnar
# records.
TORCH_FREE = [
    "prealign.loaders",
    "prealign.schemas.errors",
    "prealign.loaders.errors",
    "prealign.loaders.policy",
    "prealign.loaders.plan.packing",
    "prealign.loaders.plan.planner",
    "prealign.loaders.plan.schedule",
    "prealign.loaders.plan.cost",
    "prealign.loaders.plan.elastic",
    "prealign.loaders.plan.hybrid_cp",
    "prealign.loaders.index.sample_index",
    "prealign.loaders.index.events",
]


def _imported(module: str) -> list[str]:
    """Every module ``python -X importtime -c "import module"`` reports, in a fresh interpreter."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"],
        capture_output=True,
        text=True,
        check=True,
    )
    return [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "|" in line]


@pytest.mark.slow
@pytest.mark.parametrize("module", TORCH_FREE)
def test_importing_planning_and_index_records_loads_no_torch(module):
    names = _imported(module)
    assert module in names  # (the probe sees the import at all)
    assert "torch" not in names, f"import {module} loads torch"


def test_importing_the_loaders_package_loads_none_of_its_modules():
    names = _imported("prealign.loaders")
    assert [n for n in names if n.startswith("prealign.loaders.")] == []


def test_at_most_30_names_each_resolving():
    assert len(loaders.__all__) <= 30
    assert len(set(loaders.__all__)) == len(loaders.__all__) and sorted(loaders.__all__) == dir(
        loaders
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no exported name is deprecated
        for name in loaders.__all__:
            assert getattr(loaders, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        loaders.nope


@pytest.mark.parametrize("name", sorted(loaders._WAS))
def test_a_name_exported_before_still_resolves_with_a_deprecation(name):
    with pytest.warns(DeprecationWarning, match=f"import it from {loaders._WAS[name]}"):
        value = getattr(loaders, name)
    assert value is getattr(__import__(loaders._WAS[name], fromlist=[name]), name)


def test_schemas_source_is_renamed_field_source():
    with pytest.warns(DeprecationWarning, match="renamed FieldSource"):
        old = schemas.Source
    assert old is schemas.FieldSource and old.NEXT_TOKEN.value == "next_token"
    assert "Source" not in schemas.__all__ and "FieldSource" in schemas.__all__
