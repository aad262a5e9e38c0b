"""``prealign demo --model``'s choices are :data:`~prealign.loaders.cli.demo_data.DEMO_MODELS`, in
its order. The parser keeps its own copy: ``main`` imports ``demo_data`` (torch, transformers) only
when the demo runs, so that ``prealign index --text`` imports no torch."""

from __future__ import annotations

from prealign.loaders.cli.demo_data import DEMO_MODELS
from prealign.loaders.cli.main import build_parser


def test_demo_model_choices_are_the_demo_models():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    model = next(a for a in sub.choices["demo"]._actions if a.dest == "model")
    assert tuple(model.choices) == DEMO_MODELS
