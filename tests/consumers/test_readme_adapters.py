"""The adapters page (docs/adapters.md): every Python example in it runs as written (asserts
included)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "adapters.md"


def adapter_examples(text: str) -> list[str]:
    """The ```python blocks of the page."""
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_every_adapter_example_runs():
    pytest.importorskip("transformers")
    blocks = adapter_examples(PAGE.read_text())
    assert len(blocks) >= 4, f"docs/adapters.md has {len(blocks)} python examples"
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/adapters.md (example {i})", "exec"), {})
