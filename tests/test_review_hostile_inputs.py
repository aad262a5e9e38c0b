"""Independent review of the hostile passes: input the library accepted before them (numpy
scalars, ``0``/``1`` for a flag, a ``pathlib.Path``, a byte count written ``1e9``) is still
accepted, and every built-in schema, layout and planner config survives its own round trip."""

from __future__ import annotations

import json
import pathlib
import pickle

import numpy as np
import pytest

from prealign.collate.vision import FAMILIES, vision_family
from prealign.loaders import WebDatasetSource
from prealign.loaders.plan.planner import PlannerConfig
from prealign.loaders.sources.remote import RemoteOptions
from prealign.schemas import vlm
from prealign.schemas.errors import ConfigError, SchemaError
from prealign.schemas.layout import ParallelLayout
from prealign.schemas.schema import BatchSchema, FieldSpec, causal_lm_schema, rl_schema
from tests.loader_helpers import sample_lengths, write_shards


def _builtin_schemas() -> list[BatchSchema]:
    transformers = pytest.importorskip("transformers")
    out = [
        causal_lm_schema(),
        causal_lm_schema(topk=4, vocab_size=9),
        rl_schema(),
        vlm.vlm_schema(),
        vlm.vlm_schema(topk=3, vocab_size=50),
        vlm.image_tokens_schema(image_size=8),
    ]
    for family in FAMILIES:
        if not hasattr(family, "batch_schema"):  # (the mRoPE families: vlm_schema above)
            continue
        try:
            config = transformers.AutoConfig.for_model(family.model_types[0])
        except ValueError:  # (a model type this transformers lacks)
            continue
        out += [vision_family(config).batch_schema(topk=k, vocab_size=50) for k in (None, 2)]
    return out


def test_every_builtin_schema_layout_and_planner_config_round_trips():
    schemas = _builtin_schemas()
    assert len(schemas) > 6
    for schema in schemas:
        back = BatchSchema.from_json(schema.to_json())
        assert back == schema and back.fingerprint() == schema.fingerprint(), schema.name
        dicts = [json.loads(json.dumps(f.to_dict())) for f in schema.fields]
        fields = tuple(FieldSpec.from_dict(d) for d in dicts)
        assert fields == schema.fields, schema.name
    for kw in (
        {},
        dict(tp=2, cp=2, sp=True),
        dict(tp=4, sp=False, max_seqs=8),
        dict(length_buckets=(128, 256)),
        dict(sp=np.bool_(True)),
        dict(sp=1),
    ):
        layout = ParallelLayout(**kw)
        assert ParallelLayout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout
    config = PlannerConfig()
    assert PlannerConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_numpy_scalars_in_a_schema_are_stored_as_python_numbers():
    """A schema built with numpy scalars (a vocab size read from an array, a flag from a numpy
    comparison) fingerprints and serialises like the one built with Python numbers (the checks
    let np.int64 through, then ``to_json`` was a TypeError at check_startup)."""
    plain = causal_lm_schema(pad_token_id=3, ignore_index=-100, vocab_size=100)
    numpy = causal_lm_schema(
        pad_token_id=np.int64(3), ignore_index=np.int64(-100), vocab_size=np.int64(100)
    )
    assert numpy.fingerprint() == plain.fingerprint()
    spec = FieldSpec(
        name="x",
        dtypes=("float32",),
        required=np.bool_(False),
        finite=np.bool_(True),
        pad_value=np.float32(0.5),
        max_value=np.float32(2),
    )
    assert (
        spec.to_dict()
        == FieldSpec(
            name="x", dtypes=("float32",), required=False, finite=True, pad_value=0.5, max_value=2.0
        ).to_dict()
    )
    json.dumps(spec.to_dict())
    with pytest.raises(SchemaError, match="required: expected a bool"):
        FieldSpec(name="x", required="no")


def test_remote_options_take_numpy_numbers():
    numpy = RemoteOptions(
        block_size=np.int64(1024), retries=np.int32(2), timeout=np.float32(5), backoff=np.int64(1)
    )
    assert numpy == RemoteOptions(block_size=1024, retries=2, timeout=5.0, backoff=1)
    with pytest.raises(ConfigError, match="block_size"):
        RemoteOptions(block_size=1024.5)
    import types

    options = types.MappingProxyType({"anon": True})  # (fsspec takes them as **kwargs)
    remote = RemoteOptions(storage_options=options)
    assert pickle.loads(pickle.dumps(remote)).storage_options == {"anon": True}
    with pytest.raises(ConfigError, match="storage_options"):
        RemoteOptions(storage_options=[("anon", True)])


def test_web_dataset_source_keeps_what_it_read_before(tmp_path):
    """``cache_limit`` was ``int(cache_limit)`` (1e9 bytes, np.int64), ``sidecars`` a flag (0/1),
    ``urls`` one path (a ``pathlib.Path`` as a str)."""
    urls = write_shards(str(tmp_path), sample_lengths(9), num_shards=3)
    for limit in (10**9, 1e9, np.int64(10**9)):
        source = WebDatasetSource(urls, cache_limit=limit)
        assert source.remote.cache_limit == 10**9 and type(source.remote.cache_limit) is int
    with pytest.raises(ConfigError, match="cache_limit"):
        WebDatasetSource(urls, cache_limit=2.5)
    assert WebDatasetSource(urls, sidecars=0).sidecars is False
    assert WebDatasetSource(urls, sidecars=1).sidecars is True
    for bad in ("no", 2, None):
        with pytest.raises(ConfigError, match="sidecars"):
            WebDatasetSource(urls, sidecars=bad)
    assert list(WebDatasetSource(pathlib.Path(urls[0])).urls) == [urls[0]]


def test_a_mixture_component_s_index_may_be_a_path_object(tmp_path):
    """``Component(index=)`` is a SampleIndex or its path: a ``pathlib.Path`` is its path (the new
    type check said "expected a SampleIndex, its path or None, got PosixPath")."""
    from prealign.loaders import Mixture
    from prealign.loaders.index.build import build_index
    from prealign.loaders.mixture import Component

    urls = write_shards(str(tmp_path), sample_lengths(9), num_shards=3)
    schema = causal_lm_schema()
    saved = tmp_path / "a.index"
    build_index(WebDatasetSource(urls), schema).save(str(saved))
    mix = Mixture({"a": Component(WebDatasetSource(urls), weight=1.0, index=saved)})
    assert len(mix.build_index(schema).lengths) == 9


def test_from_dict_takes_any_mapping():
    """A config read through a mapping that is not a ``dict`` (an OmegaConf ``DictConfig`` of a
    Hydra config, a ``MappingProxyType``) built a FieldSpec and a PlannerConfig before the new
    ``isinstance(d, dict)`` checks; a list is still refused."""
    import types

    from prealign.loaders.errors import PlanError

    spec = causal_lm_schema().fields[0]
    assert FieldSpec.from_dict(types.MappingProxyType(spec.to_dict())) == spec
    config = PlannerConfig()
    assert PlannerConfig.from_dict(types.MappingProxyType(config.to_dict())) == config
    layout = ParallelLayout(tp=2, length_buckets=(64, 128))
    assert ParallelLayout.from_dict(types.MappingProxyType(layout.to_dict())) == layout
    with pytest.raises(SchemaError, match="expected a dict"):
        FieldSpec.from_dict([("name", "x")])
    with pytest.raises(PlanError, match="expected a dict"):
        PlannerConfig.from_dict([("seed", 1)])
