"""The declarative mixture file (JSON: pyyaml is not a dependency), read by ``Mixture.from_file``.

    {"by": "tokens", "length": "total", "pack_within_component": false,
     "components": {"web":  {"path": "web/shard-{000..009}.tar", "weight": 0.6},
                    "chat": {"hf": "chat.jsonl", "transform": "text", "weight": 0.3},
                    "video": {"path": "video/", "transform": "qwen2_5_vl_config/", "repeat": 2}}}

Relative paths resolve against the file's folder. A key this reader does not know is an error naming
it. A model config folder's transform is its family's, as ``prealign inspect --model-config``
builds it (:mod:`prealign.loaders.media.families`: the Qwen families, InternVL and GLM-4V through
``VLMSampleTransform``; Gemma 3, LLaVA-OneVision, Mistral3, SmolVLM, ... their own); the folder's
``preprocessor_config.json`` sets its image processor. All VLM components must collate to one
batch schema (one family, tokenizer and vision settings), else a
:class:`~prealign.loaders.media.families.MixedFamiliesError` names two that differ.
"""

from __future__ import annotations

import collections
import glob
import json
import os

from prealign.schemas.errors import ConfigError

_TOP = {"by", "length", "pack_within_component", "on_component_change", "components"}
_COMPONENT = {"path", "hf", "split", "transform", "weight", "repeat"}
_PROCESSOR_KEYS = (
    "min_pixels",
    "max_pixels",
    "patch_size",
    "temporal_patch_size",
    "merge_size",
    "image_mean",
    "image_std",
)


def _resolve(base: str, path: str) -> str:
    if "://" in path or os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(base, path))


def _shards(path: str) -> list[str] | str:
    """A folder: its ``.tar`` files (sorted); anything else (a file, a brace pattern, a URL) as
    given."""
    if os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(path, "*.tar")))
        if not found:
            raise ConfigError(f"mixture file: folder {path} holds no .tar shard")
        return found
    return path


def resolved_shards(file: str, path: str) -> list[str] | str:
    """``path`` of a component of the mixture file at ``file``, resolved against its folder (a
    folder of shards: its ``.tar`` files)."""
    where = _resolve(os.path.dirname(os.path.abspath(file)), path)
    return (
        _shards(where)
        if os.path.isdir(where) and glob.glob(os.path.join(where, "*.tar"))
        else where
    )


def _text_transform(tokenizer):
    if tokenizer is None:
        raise ConfigError(
            "mixture file: transform 'text' needs Mixture.from_file(..., tokenizer=...)"
        )
    return _TokenizeText(tokenizer)


def _vlm_transform(name: str, folder: str, tokenizer):
    """The VLM transform of a model config folder (``config.json``; its ``preprocessor_config.json``
    and ``video_preprocessor_config.json`` when present; its tokenizer unless ``tokenizer`` is
    given): the family's own transform where it has one, else ``VLMSampleTransform``."""
    from transformers import AutoConfig, PreTrainedTokenizerBase

    from prealign.collate.vision import vision_family
    from prealign.loaders.media.families import chat_tokenizer, own_transform
    from prealign.loaders.media.vlm import VLMSampleTransform

    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"mixture file: component {name!r}: transform {folder}: not a model config folder with "
            f"a tokenizer ({type(exc).__name__}); or pass Mixture.from_file(..., tokenizer=...)"
        ) from None
    family = vision_family(config)
    if family.transform:  # its own transform wraps the HF tokenizer itself
        has_processor = os.path.isfile(os.path.join(folder, "preprocessor_config.json"))
        return own_transform(family, config, tokenizer, None, folder if has_processor else None)
    if isinstance(tokenizer, PreTrainedTokenizerBase):  # the family's token names, as the CLI
        tokenizer = chat_tokenizer(tokenizer, family)
    extra = {}
    for key, file in (
        ("processor_options", "preprocessor_config.json"),
        ("video_processor_config", "video_preprocessor_config.json"),
    ):
        path = os.path.join(folder, file)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    extra[key] = json.load(f)
            except (OSError, ValueError, RecursionError) as exc:
                raise ConfigError(
                    f"mixture file: component {name!r}: {path}: not readable JSON "
                    f"({type(exc).__name__})"
                ) from None
            if not isinstance(extra[key], dict):
                raise ConfigError(
                    f"mixture file: component {name!r}: {path}: expected a JSON object, got "
                    f"{type(extra[key]).__name__}"
                )
    if (
        "processor_options" in extra
    ):  # the image processor's own keys (as `prealign index --processor`)
        extra["processor_options"] = {
            k: v for k, v in extra["processor_options"].items() if k in _PROCESSOR_KEYS
        }
    return VLMSampleTransform(tokenizer=tokenizer, model_config=config, **extra)


class _TokenizeText:
    """``{"text": str}`` -> ``{"input_ids": int64 [L]}`` with a Hugging Face tokenizer
    (picklable)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, row: dict) -> dict:
        import torch

        text = row["text"]
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return {"input_ids": torch.tensor(self.tokenizer(text)["input_ids"], dtype=torch.int64)}


def _source(name: str, entry: dict, base: str, tokenizer):
    from prealign.loaders.sources.hf_files import load_data_file, one_split
    from prealign.loaders.sources.source import HFSource
    from prealign.loaders.sources.webdataset import WebDatasetSource, numpy_fields

    kind = entry.get("transform")
    if kind == "text":
        transform = _text_transform(tokenizer)
    elif isinstance(kind, str):
        folder = _resolve(base, kind)
        if not os.path.isdir(folder):
            raise ConfigError(
                f"mixture file: component {name!r}: transform {kind!r} is neither 'text' nor a "
                f"model config folder ({folder} does not exist)"
            )
        transform = _vlm_transform(name, folder, tokenizer)
    elif kind is None:
        transform = None
    else:
        raise ConfigError(
            f"mixture file: component {name!r}: key transform: expected 'text' or a folder, got "
            f"{kind!r}"
        )
    if ("path" in entry) == ("hf" in entry):
        raise ConfigError(
            f"mixture file: component {name!r}: give 'path' (webdataset shards) or 'hf' (a dataset "
            f"file or saved folder), not {'both' if 'path' in entry else 'neither'}"
        )
    for key in ("path", "hf"):
        if key in entry and (not isinstance(entry[key], str) or not entry[key]):
            raise ConfigError(
                f"mixture file: component {name!r}: key {key}: expected a path (a non-empty str), "
                f"got {entry[key]!r:.80}"
            )
    if "path" in entry:
        return WebDatasetSource(
            _shards(_resolve(base, entry["path"])), transform=transform or numpy_fields
        )
    import datasets

    where = _resolve(base, entry["hf"])
    if os.path.isdir(where):
        ds = datasets.load_from_disk(where)
    else:
        ext = os.path.splitext(where)[1].lstrip(".")
        builder = {
            "jsonl": "json",
            "json": "json",
            "parquet": "parquet",
            "arrow": "arrow",
            "csv": "csv",
        }.get(ext)
        if builder is None:
            raise ConfigError(
                f"mixture file: component {name!r}: hf {where}: expected a saved folder or a "
                f".jsonl/.json/.parquet/.arrow/.csv file"
            )
        ds = load_data_file(builder, where, what=f"mixture file: component {name!r}: hf {where}")
    ds = one_split(ds, entry.get("split", "train"), what=f"mixture file: component {name!r}: split")
    return HFSource(ds, transform=transform, name=name)


def _unique_keys(pairs: list) -> dict:
    """A JSON object of the file; a key given twice (the second would silently replace the
    first: a component lost) is a ``ValueError``."""
    out = dict(pairs)
    if len(out) != len(pairs):
        twice = [k for k, n in collections.Counter(k for k, _ in pairs).items() if n > 1]
        raise ValueError(f"expected each key once in an object, got {twice[:8]} more than once")
    return out


def read_mixture_file(path: str) -> dict:
    """The file's JSON, checked: unknown keys and a missing ``components`` are errors naming
    them."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f, object_pairs_hook=_unique_keys)
    except (OSError, ValueError, RecursionError) as exc:  # (RecursionError: nested too deep)
        raise ConfigError(f"mixture file {path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("components"), dict):
        raise ConfigError(
            f"mixture file {path}: expected an object with 'components': {{name: {{...}}}}"
        )
    unknown = set(data) - _TOP
    if unknown:
        raise ConfigError(
            f"mixture file {path}: unknown key(s) {sorted(unknown)}; expected {sorted(_TOP)}"
        )
    for name, entry in data["components"].items():
        if not isinstance(entry, dict):
            raise ConfigError(
                f"mixture file {path}: component {name!r}: expected an object, got {entry!r}"
            )
        bad = set(entry) - _COMPONENT
        if bad:
            raise ConfigError(
                f"mixture file {path}: component {name!r}: unknown key(s) {sorted(bad)}; expected "
                f"{sorted(_COMPONENT)}"
            )
        if "split" in entry and not isinstance(entry["split"], str):  # (path, hf: _source)
            raise ConfigError(
                f"mixture file {path}: component {name!r}: key split: expected a str, got "
                f"{entry['split']!r:.80}"
            )
    return data


def load_mixture_file(mixture_cls, component_cls, path: str, *, tokenizer=None):
    """``Mixture`` of the file at ``path`` (see the module docstring)."""
    data = read_mixture_file(path)
    base = os.path.dirname(os.path.abspath(path))
    comps = {}
    for name, entry in data["components"].items():
        comps[name] = component_cls(
            _source(name, entry, base, tokenizer),
            weight=entry.get("weight"),
            repeat=entry.get("repeat"),
        )
    from prealign.loaders.media.families import common_schema

    common_schema({name: comp.source.transform for name, comp in comps.items()})
    options = {
        k: data[k]
        for k in ("by", "length", "pack_within_component", "on_component_change")
        if k in data
    }
    return mixture_cls(comps, **options)
