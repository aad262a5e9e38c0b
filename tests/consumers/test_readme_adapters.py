"""The README's Adapters section: every Python example in it runs as written (asserts included)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def adapter_examples(text: str) -> list[str]:
    """The ```python blocks of the section whose heading starts with "## Adapters"."""
    match = re.search(r"^## Adapters.*?(?=^## |\Z)", text, re.S | re.M)
    return re.findall(r"```python\n(.*?)```", match.group(0), re.S) if match else []


def test_every_adapter_example_runs():
    pytest.importorskip("transformers")
    blocks = adapter_examples(README.read_text())
    assert len(blocks) >= 4, f"README.md's Adapters section has {len(blocks)} python examples"
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md (Adapters example {i})", "exec"), {})
