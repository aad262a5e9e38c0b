"""Hostile mixture files: a ConfigError naming the file, the component and the key, never a
RecursionError or a TypeError, and never a component silently replaced by a second of its name."""

from __future__ import annotations

import json

import pytest

from prealign.loaders.mixture import Mixture
from prealign.schemas.errors import ConfigError


def _file(tmp_path, text: str) -> str:
    path = tmp_path / "mixture.json"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text", ["[" * 100_000, '{"components": ' * 100_000], ids=["array", "obj"])
def test_nesting_past_the_recursion_limit_is_a_config_error(tmp_path, text):
    with pytest.raises(ConfigError, match="mixture file .*recursion"):
        Mixture.from_file(_file(tmp_path, text))


@pytest.mark.parametrize(
    "key, value",
    [("path", 5), ("path", ["a.tar", 5]), ("hf", 5), ("hf", None), ("split", 0)],
    ids=repr,
)
def test_a_component_key_not_a_str_is_a_config_error(tmp_path, key, value):
    entry = {"path": "x.tar", key: value} if key == "split" else {key: value}
    text = json.dumps({"components": {"web": {**entry, "weight": 1}}})
    with pytest.raises(ConfigError, match=f"component 'web': key {key}: expected a (path .*)?str"):
        Mixture.from_file(_file(tmp_path, text))


def test_a_duplicate_component_name_is_a_config_error(tmp_path):
    """JSON keeps the last of two equal keys: the first component was silently dropped."""
    text = (
        '{"components": {"web": {"path": "a.tar", "weight": 1}, '
        '"web": {"path": "b.tar", "weight": 2}}}'
    )
    with pytest.raises(ConfigError, match="'web'.* more than once"):
        Mixture.from_file(_file(tmp_path, text))


@pytest.mark.parametrize(
    "text, words",
    [("[" * 100_000, "RecursionError"), ("[1, 2]", "expected a JSON object, got list")],
    ids=["deep", "list"],
)
def test_a_hostile_preprocessor_config_of_a_model_folder_is_a_config_error(tmp_path, text, words):
    """A component's model folder whose preprocessor_config.json is nested past the recursion limit
    (a RecursionError) or is not an object (an AttributeError on ``.items()``)."""
    transformers = pytest.importorskip("transformers")
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer

    folder = tmp_path / "model"
    transformers.Qwen2VLConfig().save_pretrained(str(folder))
    (folder / "preprocessor_config.json").write_text(text)
    mix = json.dumps({"components": {"v": {"path": "x.tar", "transform": "model", "weight": 1}}})
    with pytest.raises(ConfigError, match=f"preprocessor_config.json.*{words}"):
        Mixture.from_file(_file(tmp_path, mix), tokenizer=ByteTokenizer())
