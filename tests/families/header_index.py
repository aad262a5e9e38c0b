"""The header-pass check the family tests share: on ``prealign demo --model <model>`` data, the
header-only index (image headers sized, the chat rendered by the tokenizer alone) gives every sample
the length and media flag the full transform gives."""

from __future__ import annotations


def assert_header_index_equals_full_pass(tmp_path, model: str, samples: int = 16) -> None:
    from prealign.loaders import BadDataPolicy, WebDatasetSource, build_index
    from prealign.loaders.cli.demo_data import build_demo_dataset, demo_transform
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.loaders.index.header_pass import ImageSizesRule, length_rule, write_sidecars

    ds = build_demo_dataset(
        str(tmp_path), num_samples=samples, samples_per_shard=samples // 2, topk=4, model=model
    )
    t = demo_transform(model, ByteTokenizer(), 4)
    schema = t.family.batch_schema(topk=4, vocab_size=ds.vocab_size)
    policy = BadDataPolicy(on_error="skip")
    full = build_index(
        WebDatasetSource(list(ds.shards), transform=t, image="bytes", sidecars=False),
        schema,
        policy=policy,
    )
    source = WebDatasetSource(list(ds.shards), transform=t, image="bytes")
    assert isinstance(
        length_rule(source, schema), ImageSizesRule
    )  # headers only, no pixel processed
    write_sidecars(source, schema)
    side = build_index(
        WebDatasetSource(list(ds.shards), transform=t, image="bytes"), schema, policy=policy
    )
    assert len(full) == len(side) == samples - len(ds.bad)
    assert (
        full.lengths.tolist() == side.lengths.tolist()
        and full.media.tolist() == side.media.tolist()
    )
    assert bool(full.media.any()) and not bool(full.media.all())
