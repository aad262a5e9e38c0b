"""Leftovers of the hostile CLI pass: ``--tp`` / ``--cp`` that are valid ints whose multiple is past
int32 got the hint "--tp and --cp take ints >= 1", which they already are; the hint now says what
to change."""

from __future__ import annotations

import re

import pytest

from prealign.loaders.cli import main
from prealign.loaders.cli.errors import error_lines, hint_for
from prealign.schemas import ParallelLayout
from prealign.schemas.errors import LayoutError

BIG = str(2**20)
TOO_BIG_HINT = "give a smaller --tp or --cp"


def _hint(line: str) -> str:
    match = re.search(r"\(hint: (.*)\)$", line)
    assert match, line
    return match.group(1)


@pytest.mark.parametrize("argv", [["--tp", BIG, "--cp", BIG], ["--tp", "1", "--cp", str(2**31)]])
def test_valid_ints_whose_multiple_is_too_big_get_a_hint_that_fits(capsys, argv):
    assert main(["demo", *argv, "--workers", "0"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("prealign: error: total multiple ") and "int32" in line, line
    hint = _hint(line)
    assert "ints >= 1" not in hint and hint.startswith(TOO_BIG_HINT), hint


def test_layout_errors_each_get_their_own_hint():
    with pytest.raises(LayoutError) as too_big:
        ParallelLayout(tp=2**20, cp=2**20)
    assert hint_for(too_big.value).startswith(TOO_BIG_HINT)
    for kw in ({"tp": 0}, {"cp": "2"}):
        with pytest.raises(LayoutError) as not_an_int:
            ParallelLayout(**kw)
        assert hint_for(not_an_int.value) == "--tp and --cp take ints >= 1 (sp is on when tp > 1)"
    with pytest.raises(LayoutError) as other:
        ParallelLayout(length_buckets=())
    assert "--tp" not in _hint(error_lines(other.value)[0])
