"""The demo-data checks the family tests share, on ``prealign demo --model <model>`` data: the demo
command's own run (every batch on every CP rank valid), and the header pass (the header-only index:
image headers sized, the chat rendered by the tokenizer alone, gives every sample the length and
media flag the full transform gives)."""

from __future__ import annotations


def run_demo(tmp_path, capsys, model: str, *, token_budget: int | None = None) -> str:
    """``prealign demo --model <model> --samples 30 --workers 0`` (``--token-budget`` when given):
    its report, after checking it exits 0 and calls every batch of both CP ranks valid."""
    from prealign.loaders.cli import main

    args = ["demo", "--model", model, "--samples", "30", "--out", str(tmp_path / "l.png")]
    args += ["--workers", "0"]
    if token_budget is not None:
        args += ["--token-budget", str(token_budget)]
    assert main(args) == 0
    out = capsys.readouterr().out
    n = int(out.split("micro-batches  ")[1].split(" ")[0])
    assert f"{2 * n}/{2 * n} batches valid" in out
    return out


def assert_header_index_equals_full_pass(
    tmp_path, model: str, samples: int = 16, *, rule=None, schema=None
) -> None:
    """The header-only index equals the full pass (lengths, media flags; bad samples dropped by
    both) and its length rule is ``rule`` (a class of :mod:`prealign.loaders.index.header_pass`,
    default ``ImageSizesRule``: headers only, no pixel processed); ``schema(transform,
    vocab_size)``: the batch schema (default the family's ``batch_schema`` with top-4)."""
    from prealign.loaders import BadDataPolicy, WebDatasetSource, build_index
    from prealign.loaders.cli.demo_data import build_demo_dataset, demo_transform
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.loaders.index.header_pass import ImageSizesRule, length_rule, write_sidecars

    ds = build_demo_dataset(
        str(tmp_path), num_samples=samples, samples_per_shard=samples // 2, topk=4, model=model
    )
    t = demo_transform(model, ByteTokenizer(), 4)
    if schema is None:
        schema = t.family.batch_schema(topk=4, vocab_size=ds.vocab_size)
    else:
        schema = schema(t, ds.vocab_size)
    policy = BadDataPolicy(on_error="skip")
    full = build_index(
        WebDatasetSource(list(ds.shards), transform=t, image="bytes", sidecars=False),
        schema,
        policy=policy,
    )
    source = WebDatasetSource(list(ds.shards), transform=t, image="bytes")
    assert isinstance(length_rule(source, schema), rule or ImageSizesRule)
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
