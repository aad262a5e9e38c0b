"""The ``prealign`` console command.

    prealign demo     build a small multimodal webdataset with teacher top-k in a temp dir, stream
                      it through PackedLoader for tp=2, cp=2 on every CP rank, validate every batch,
                      print a table and write a PNG of the packed layout (no files needed)
    prealign inspect  the same for your own webdataset shards or Hugging Face dataset
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from prealign.schemas.layout import ParallelLayout


def _add_common(p: argparse.ArgumentParser, *, budget: int) -> None:
    g = p.add_argument_group("layout and loading")
    g.add_argument("--tp", type=int, default=2, help="tensor-parallel size (SP on when > 1) [%(default)s]")
    g.add_argument("--cp", type=int, default=2, help="context-parallel size; every CP rank is loaded [%(default)s]")
    g.add_argument("--token-budget", type=int, default=budget, help="padded THD tokens per micro-batch [%(default)s]")
    g.add_argument("--workers", type=int, default=2, help="DataLoader workers per CP rank [%(default)s]")
    g.add_argument("--defer-cp-shard", action="store_true",
                   help="VLM path: whole aligned batch + cp_gather_index instead of CP-sharded tokens")
    g.add_argument("--seed", type=int, default=0, help="shuffle / data seed [%(default)s]")
    g.add_argument("--out", default="prealign_demo.png", help="PNG of the packed layout [%(default)s]")
    g.add_argument("--rows", type=int, default=10, help="micro-batch rows in the table [%(default)s]")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prealign", description="TP/CP/SP-aligned packed batches for Megatron.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="end-to-end demo on a synthetic multimodal webdataset (no files needed)",
                          description="Build a small synthetic multimodal webdataset with teacher top-k in a temp "
                                      "dir, stream it through PackedLoader on every CP rank, validate every batch, "
                                      "print a table and write a PNG of the packed layout.")
    demo.add_argument("--samples", type=int, default=240, help="samples to generate (3 of them broken) [%(default)s]")
    demo.add_argument("--topk", type=int, default=8, help="teacher top-k K [%(default)s]")
    demo.add_argument("--keep", metavar="DIR", help="write the shards to DIR and keep them (default: a temp dir)")
    _add_common(demo, budget=4096)
    demo.set_defaults(func=cmd_demo)

    insp = sub.add_parser("inspect", help="the same on your own webdataset shards or HF dataset",
                          description="Index and load your data exactly as training would, validate every batch "
                                      "and report padding, shapes and throughput. Samples are chat JSON + images "
                                      "(rendered with the demo byte tokenizer) or pre-tokenized input_ids.")
    insp.add_argument("shards", nargs="*", help="webdataset shards (paths, URLs, brace patterns)")
    insp.add_argument("--hf", metavar="PATH", help="a dataset saved with save_to_disk, or a load_dataset path")
    insp.add_argument("--split", default="train", help="split for --hf [%(default)s]")
    insp.add_argument("--text", action="store_true", help="text-only causal-LM data (webdataset .npy members / "
                                                           "HF columns as given) instead of the VLM transform")
    insp.add_argument("--topk", type=int, default=0, help="expect teacher top-k with this K (0: none) [%(default)s]")
    insp.add_argument("--vocab-size", type=int, default=None, help="bound teacher ids (text mode)")
    insp.add_argument("--limit", type=int, default=None, help="stop after this many micro-batches")
    _add_common(insp, budget=8192)
    insp.set_defaults(func=cmd_inspect, out="prealign_inspect.png")
    from .index_cmd import add_parser as add_index  # prealign index (issue #7)
    add_index(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


# ---- commands ----------------------------------------------------------------------------------------
def cmd_demo(args) -> int:
    from .demo_data import build_demo_dataset
    from .demo_tokenizer import ByteTokenizer
    from ..vlm import VLMSampleTransform
    from ..webdataset_source import WebDatasetSource
    from prealign.schemas.vlm import vlm_schema

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="prealign-demo-") as tmp:
        where = args.keep or tmp
        _note(f"building {args.samples} synthetic VLM samples (chat + PIL images + top-{args.topk} teacher) in {where}")
        ds = build_demo_dataset(where, num_samples=args.samples, topk=args.topk, seed=args.seed)
        _note(f"data built in {time.perf_counter() - t0:.1f} s")
        transform = VLMSampleTransform(tokenizer=ByteTokenizer(), topk=args.topk)
        source = WebDatasetSource(list(ds.shards), transform=transform, image="bytes")
        schema = vlm_schema(topk=args.topk, vocab_size=ds.vocab_size)
        title = (f"{args.samples} samples ({len(ds.bad)} broken on purpose) in {len(ds.shards)} webdataset shards, "
                 f"vlm_schema(topk={args.topk})")
        return _run(args, source, schema, title=title)


def cmd_inspect(args) -> int:
    from prealign.schemas.schema import causal_lm_schema
    from prealign.schemas.vlm import vlm_schema
    from ..vlm import VLMSampleTransform
    from ..webdataset_source import WebDatasetSource, numpy_fields
    from .demo_tokenizer import ByteTokenizer

    if bool(args.shards) == bool(args.hf):
        print("prealign inspect: give webdataset shards or --hf PATH (one of them)", file=sys.stderr)
        return 2
    topk = args.topk or None
    if args.text:
        schema = causal_lm_schema(topk=topk, vocab_size=args.vocab_size)
        transform = numpy_fields if args.shards else None
    else:
        transform = VLMSampleTransform(tokenizer=ByteTokenizer(), topk=topk)
        schema = vlm_schema(topk=topk, vocab_size=transform.tokenizer.vocab_size)
    if args.shards:
        source = WebDatasetSource(args.shards, transform=transform, image="bytes")
        what = f"{len(source.urls)} webdataset shard(s)"
    else:
        source = _hf_source(args.hf, args.split, transform)
        what = f"HF dataset {args.hf} [{args.split}]"
    return _run(args, source, schema, title=f"{what}, {schema.name}")


def _hf_source(path: str, split: str, transform):
    import datasets

    from ..sources import HFSource

    if os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_info.json")):
        ds = datasets.load_from_disk(path)
    elif os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_dict.json")):
        ds = datasets.load_from_disk(path)[split]
    else:
        ds = datasets.load_dataset(path, split=split)
    return HFSource(ds, transform=transform)


# ---- the shared run ------------------------------------------------------------------------------------
def _note(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _run(args, source, schema, *, title: str) -> int:
    from prealign.schemas.vlm import validate_vlm_batch
    from .inspection import inspect_source
    from .plot import draw_packed_layout
    from .report import format_shapes, format_table, totals

    layout = ParallelLayout(tp=args.tp, cp=args.cp)
    res = inspect_source(source, schema=schema, layout=layout, token_budget=args.token_budget,
                         num_workers=args.workers, seed=args.seed, defer_cp_shard=args.defer_cp_shard,
                         limit=getattr(args, "limit", None),
                         validate=lambda b: validate_vlm_batch(b, schema, layout, raise_on_error=False))
    tot = totals(res.stats)
    mode = "whole batch + cp_gather_index (deferred CP shard)" if args.defer_cp_shard else "CP-sharded (zigzag)"
    pad = 100.0 * (tot["padded_tokens"] - tot["real_tokens"]) / max(tot["padded_tokens"], 1)
    checks = len(res.stats) * layout.cp
    lines = [
        f"prealign: {title}",
        f"layout: tp={layout.tp} cp={layout.cp} sp={layout.sp} (T_local % {layout.local_multiple}, every P_i % "
        f"{layout.seq_multiple}), THD {mode}, token budget {args.token_budget}",
        "",
        format_table(res.stats, tp=layout.tp, max_rows=args.rows),
        "",
        f"micro-batches  {tot['micro_batches']} (x {layout.cp} CP ranks), {tot['sequences']} sequences, "
        f"{tot['images']} images",
        f"tokens         {tot['real_tokens']} real / {tot['padded_tokens']} padded ({pad:.1f}% padding)",
        f"validated      {checks - sum(1 for s in res.stats if s.violations)}/{checks} batches valid "
        f"(schema {schema.name} {schema.fingerprint()}, media counts, SP/CP alignment)",
        *_skips(res.report),
        f"throughput     {tot['real_tokens'] / max(res.load_seconds, 1e-9):,.0f} real tokens/s over all CP ranks "
        f"({len(res.stats) / max(res.load_seconds, 1e-9):.1f} micro-batches/s; decode + image processing + "
        f"collate, {args.workers} worker(s) per rank); index pass {res.index_seconds:.1f} s",
    ]
    if res.stats:
        lines += ["", "CP rank 0 shapes of micro-batch 0 (every CP rank alike):", format_shapes(res.stats[0])]
    if res.first_violations:
        lines += ["", "first violations:", *(f"  {v}" for v in res.first_violations)]
    if res.panels:
        draw_packed_layout(res.panels, layout, args.out,
                           title=f"prealign: tp={layout.tp} cp={layout.cp}, first {len(res.panels)} micro-batches")
        lines += ["", f"picture        {args.out}"]
    print("\n".join(lines))
    return 0 if tot["violations"] == 0 else 1


def _skips(report, shown: int = 3) -> list[str]:
    """The bad-data report: counts by cause (the report's own, e.g. ``corrupt_image 1``), then the
    first samples named with what was wrong."""
    if not report.total:
        return ["skipped        none"]
    counts = ", ".join(f"{k} {v}" for k, v in sorted(report.counts.items()))
    lines = [f"skipped        {report.total} sample(s), policy skip + count ({counts}):"]
    for where, reason, message in report.examples[:shown]:
        lines.append(f"                 {os.path.basename(where)}  {reason}  {_short(_detail(message, where, reason))}")
    return lines


def _detail(message: str, where: str, reason: str) -> str:
    """``message`` without what the line already shows: the ``reason: `` and ``sample <where>`` prefixes."""
    message = message.removeprefix(f"{reason}: ")
    for lead in (f"sample {where}, ", f"sample {where}: "):
        if message.startswith(lead):
            return message[len(lead):]
    return message


def _short(message: str, limit: int = 96) -> str:
    return message if len(message) <= limit else message[:limit - 3] + "..."


if __name__ == "__main__":
    sys.exit(main())
