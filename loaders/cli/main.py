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

from prealign.loaders.cli import preflight
from prealign.loaders.cli.errors import UsageError, run_reporting
from prealign.schemas.layout import ParallelLayout

DEMO_BUDGET = 4096
"""``prealign demo``'s default token budget (InternVL's: four times it)."""
DEMO_MAX_SAMPLES = 100_000
"""The demo builds its data in a temp folder (about 6 KB a sample): beyond this, inspect your own
data."""


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes are a :class:`UsageError` (one line, exit code 2), not usage +
    message."""

    def error(self, message: str):
        raise UsageError(message, hint=did_you_mean(self, message) or f"see {self.prog} --help")


def _option_strings(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """``{sub-command or "": its option strings}`` of ``parser`` and its sub-commands."""
    out: dict[str, list[str]] = {"": []}
    for action in parser._actions:  # noqa: SLF001 - argparse keeps its actions there
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for name, sub in action.choices.items():
                out[name] = [o for a in sub._actions for o in a.option_strings]  # noqa: SLF001
        out[""] += list(action.option_strings)
    return out


def did_you_mean(parser: argparse.ArgumentParser, message: str) -> str:
    """``did you mean --tokenizer?`` for a misspelt flag, ``did you mean 'index'?`` for a misspelt
    command (``""`` when nothing is close)."""
    import difflib
    import re

    choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if choice:
        close = difflib.get_close_matches(
            choice.group(1), re.findall(r"'?([\w-]+)'?", choice.group(2)), n=1
        )
        return f"did you mean '{close[0]}'?" if close else ""
    unknown = re.search(r"unrecognized arguments: (.*)", message)
    if not unknown:
        return ""
    known = sorted({o for opts in _option_strings(parser).values() for o in opts})
    hints = []
    for word in unknown.group(1).split():
        if word.startswith("-"):
            close = difflib.get_close_matches(word.split("=")[0], known, n=1, cutoff=0.6)
            if close:
                hints.append(f"did you mean {close[0]}?")
    return "; ".join(hints)


def _add_common(p: argparse.ArgumentParser, *, budget: int) -> None:
    g = p.add_argument_group("layout and loading")
    g.add_argument(
        "--tp", type=int, default=2, help="tensor-parallel size (SP on when > 1) [%(default)s]"
    )
    g.add_argument(
        "--cp",
        type=int,
        default=2,
        help="context-parallel size; every CP rank is loaded [%(default)s]",
    )
    g.add_argument(
        "--token-budget",
        type=int,
        default=budget,
        help="padded THD tokens per micro-batch [%(default)s]",
    )
    g.add_argument(
        "--workers", type=int, default=2, help="DataLoader workers per CP rank [%(default)s]"
    )
    g.add_argument(
        "--defer-cp-shard",
        action="store_true",
        help="VLM path: whole aligned batch + cp_gather_index instead of CP-sharded tokens",
    )
    g.add_argument("--seed", type=int, default=0, help="shuffle / data seed [%(default)s]")
    g.add_argument(
        "--out", default="prealign_demo.png", help="PNG of the packed layout [%(default)s]"
    )
    g.add_argument(
        "--rows", type=int, default=10, help="micro-batch rows in the table [%(default)s]"
    )
    g.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="where remote shards are copied and --hf datasets cached "
        "(default: a temp dir for shards, datasets' own cache)",
    )
    g.add_argument("--debug", action="store_true", help="show the traceback of an error")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="prealign", description="TP/CP/SP-aligned packed batches for Megatron.")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="end-to-end demo on a synthetic multimodal webdataset (no files needed)",
        description="Build a small synthetic multimodal webdataset with teacher top-k in a temp "
        "dir, stream it through PackedLoader on every CP rank, validate every batch, "
        "print a table and write a PNG of the packed layout.",
    )
    demo.add_argument(
        "--samples",
        type=int,
        default=240,
        help="samples to generate (3 of them broken) [%(default)s]",
    )
    demo.add_argument("--topk", type=int, default=8, help="teacher top-k K [%(default)s]")
    demo.add_argument(
        "--keep", metavar="DIR", help="write the shards to DIR and keep them (default: a temp dir)"
    )
    demo.add_argument(
        "--model",
        choices=(
            "qwen2_vl",
            "qwen2_5_vl",
            "qwen3_vl",
            "qwen3_5",
            "gemma3",
            "gemma4",
            "internvl",
            "glm4v",
            "glm4v_moe",
            "llava_onevision",
            "mistral3",
            "smolvlm",
        ),
        help="build that family's samples, with short videos (default: Qwen2-VL images only)",
    )
    _add_common(demo, budget=DEMO_BUDGET)
    demo.set_defaults(func=cmd_demo)

    insp = sub.add_parser(
        "inspect",
        help="the same on your own webdataset shards or HF dataset",
        description="Index and load your data exactly as training would, validate every batch "
        "and report padding, shapes and throughput. Samples are chat JSON + images "
        "(rendered with the demo byte tokenizer) or pre-tokenized input_ids.",
    )
    insp.add_argument("shards", nargs="*", help="webdataset shards (paths, URLs, brace patterns)")
    insp.add_argument(
        "--hf",
        metavar="PATH",
        help="a local json/jsonl/parquet/csv file or folder, a dataset saved "
        "with save_to_disk, or a Hub dataset name",
    )
    insp.add_argument("--split", default="train", help="split for --hf [%(default)s]")
    insp.add_argument(
        "--media-root",
        metavar="DIR",
        help="--hf: the folder the rows' image and video file paths "
        "are relative to (default: the --hf file's folder)",
    )
    insp.add_argument(
        "--text",
        action="store_true",
        help="text-only causal-LM data (webdataset .npy members / "
        "HF columns as given) instead of the VLM transform",
    )
    from prealign.loaders.cli.index_cmd import add_teacher_args, add_transform_args

    add_teacher_args(insp)
    insp.add_argument("--limit", type=int, default=None, help="stop after this many micro-batches")
    insp.add_argument(
        "--oversize",
        choices=("error", "truncate", "skip"),
        default="error",
        help="a sample longer than a micro-batch holds: stop, cut it, or leave it out "
        "[%(default)s]",
    )
    add_transform_args(insp)
    _add_common(insp, budget=8192)
    insp.set_defaults(func=cmd_inspect, out="prealign_inspect.png")
    from prealign.loaders.cli.index_cmd import add_parser as add_index  # prealign index (issue #7)

    add_index(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command; a person's mistake (or unusable input) is one ``prealign: error: ... (hint:
    ...)``
    line on stderr and exit code 2 (``--debug`` adds the traceback)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return run_reporting(build_parser(), argv)


# ---- commands
# ----------------------------------------------------------------------------------------
def cmd_demo(args) -> int:
    from prealign.loaders.cli.demo_data import build_demo_dataset, demo_transform
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.loaders.cli.index_cmd import transform_schema
    from prealign.loaders.sources.webdataset import WebDatasetSource

    layout = _check_common(args)
    if getattr(args, "model", None) == "internvl" and args.token_budget == DEMO_BUDGET:
        args.token_budget = (
            4 * DEMO_BUDGET
        )  # 448-px tiles, 256 tokens each: a 360-px image is up to 3,328 tokens
        _note(
            f"--model internvl: token budget {args.token_budget} (InternVL's tiles; give "
            f"--token-budget to choose)"
        )
    preflight.check_int("--samples", args.samples, 1, high=DEMO_MAX_SAMPLES)
    preflight.check_int("--topk", args.topk, 1, high=ByteTokenizer().vocab_size)
    preflight.check_dir("--keep", args.keep)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="prealign-demo-") as tmp:
        where = args.keep or tmp
        _note(
            f"building {args.samples} synthetic VLM samples (chat + PIL images + top-{args.topk} "
            f"teacher) in {where}"
        )
        model = getattr(args, "model", None)
        ds = build_demo_dataset(
            where, num_samples=args.samples, topk=args.topk, seed=args.seed, model=model
        )
        _note(f"data built in {time.perf_counter() - t0:.1f} s")
        transform = demo_transform(model, ByteTokenizer(), args.topk)
        source = WebDatasetSource(list(ds.shards), transform=transform, image="bytes")
        schema = transform_schema(
            transform, args.topk
        )  # the family's own batch (1-D positions, tiles, ...)
        schema_name = {
            "gemma3": "image_tokens_schema",
            "gemma4": "Gemma4.batch_schema",
            "internvl": "InternVL.batch_schema",
            "llava_onevision": "LlavaOneVision.batch_schema",
            "mistral3": "Mistral3.batch_schema",
            "smolvlm": "Idefics3.batch_schema",
        }.get(model, "vlm_schema")
        title = (
            f"{args.samples} samples ({len(ds.bad)} broken on purpose) in {len(ds.shards)} "
            f"webdataset shards, {schema_name}(topk={args.topk})"
        )
        return _run(args, layout, source, schema, title=title)


def cmd_inspect(args) -> int:
    from prealign.loaders.cli.index_cmd import transform_schema, vlm_transform
    from prealign.loaders.sources.webdataset import WebDatasetSource, numpy_fields
    from prealign.schemas.schema import causal_lm_schema

    if mixture_file(args.shards) and not args.hf:  # a mixture file (docs/mixtures.md)
        return _inspect_mixture(args)
    if bool(args.shards) == bool(args.hf):
        raise UsageError(
            "inspect takes webdataset shards or --hf PATH" + (", not both" if args.shards else ""),
            hint="e.g. prealign inspect data/shard-{000..009}.tar, or prealign inspect --hf "
            "train.jsonl",
        )
    layout = _check_common(args)
    preflight.check_topk_vocab(args)
    preflight.check_int("--limit", args.limit, 1, optional=True)
    topk = args.topk or None
    if args.text:
        schema = causal_lm_schema(topk=topk, vocab_size=args.vocab_size)
        transform = numpy_fields if args.shards else None
        told = "none (--text: token ids as given)"
    else:
        transform, told = vlm_transform(args, topk)
        schema = transform_schema(transform, topk)
    if args.shards:
        from prealign.loaders.sources.webdataset import expand_urls

        preflight.check_shards(expand_urls(args.shards))
        preflight.check_mode(expand_urls(args.shards), args.text, "inspect")
        source = WebDatasetSource(
            args.shards, transform=transform, image="bytes", cache_dir=args.cache_dir
        )
        what = f"{len(source.urls)} webdataset shard(s)"
    else:
        from prealign.loaders.sources.source import HFSource

        local = os.path.isfile(args.hf) or os.path.isdir(
            args.hf
        )  # rows name media files relative to its folder
        root = args.media_root or (
            os.path.dirname(os.path.abspath(args.hf))
            if os.path.isfile(args.hf)
            else args.hf
            if local
            else None
        )
        source = HFSource(
            preflight.load_hf(args.hf, args.split, args.cache_dir),
            transform=transform,
            media_root=root,
        )
        what = f"HF dataset {args.hf} [{args.split}]"
    _note(f"tokenizer: {told}")
    return _run(args, layout, source, schema, title=f"{what}, {schema.name}")


def mixture_file(shards) -> str | None:
    """The one argument when it is a mixture file (``*.json``, a file), else None."""
    if shards and len(shards) == 1 and shards[0].endswith(".json") and os.path.isfile(shards[0]):
        return shards[0]
    return None


def _inspect_mixture(args) -> int:
    """``prealign inspect mix.json``: the mixture of the file, then each component's planned /
    served share."""
    from prealign.loaders.mixture import Mixture
    from prealign.schemas.schema import causal_lm_schema
    from prealign.schemas.vlm import vlm_schema

    layout = _check_common(args)
    preflight.check_topk_vocab(args)
    topk = args.topk or None
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    source = Mixture.from_file(args.shards[0], tokenizer=tokenizer)
    if args.text:
        schema = causal_lm_schema(topk=topk, vocab_size=args.vocab_size)
    else:  # the VLM components' one schema (their family's; different ones were refused)
        from prealign.loaders.media.families import common_schema

        schema = common_schema(
            {n: c.source.transform for n, c in source.components.items()}, topk
        ) or vlm_schema(topk=topk)
    return _run(
        args,
        layout,
        source,
        schema,
        title=f"mixture {args.shards[0]} ({', '.join(source.names)}), {schema.name}",
    )


def _mixture_table(rows: dict) -> str:
    """Per component: weight, share planned and served, samples and tokens, bad samples by
    reason."""
    lines = [
        f"{'component':<16}{'weight':>8}{'planned':>9}{'served':>9}{'samples':>10}{'tokens':>12}  "
        f"bad"
    ]
    for name, r in rows.items():
        weight = f"{r['weight_share']:.3f}" if r["weight_share"] is not None else f"x{r['repeat']}"
        bad = ", ".join(f"{k} {v}" for k, v in sorted(r["bad"].items())) or "-"
        lines.append(
            f"{name:<16}{weight:>8}{r['share_planned']:>9.3f}{r['share_served']:>9.3f}"
            f"{r['samples_served']:>10}{r['tokens_served']:>12}  {bad}"
        )
    return "\n".join(lines)


def _check_common(args) -> ParallelLayout:
    """The layout and loading options, checked before any work (``--out`` writable included)."""
    from prealign.loaders.plan.planner import microbatch_capacity

    for name in ("tp", "cp"):
        preflight.check_int(f"--{name}", getattr(args, name), 1)
    preflight.check_int("--workers", args.workers, 0)
    preflight.check_int("--seed", args.seed, 0, high=2**63 - 1)
    preflight.check_int("--rows", args.rows, 2)
    preflight.check_int("--token-budget", args.token_budget, 1)
    layout = ParallelLayout(tp=args.tp, cp=args.cp)
    microbatch_capacity(layout, args.token_budget)  # PlanError when not even one block fits
    preflight.check_out(args.out)
    preflight.check_dir("--cache-dir", args.cache_dir)
    return layout


# ---- the shared run
# ------------------------------------------------------------------------------------
def _note(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _run(args, layout: ParallelLayout, source, schema, *, title: str) -> int:
    from prealign.loaders.cli.inspection import inspect_source
    from prealign.loaders.cli.plot import draw_packed_layout
    from prealign.loaders.cli.report import format_shapes, format_table, totals
    from prealign.loaders.plan.planner import PlannerConfig
    from prealign.schemas.validate import validate_batch
    from prealign.schemas.vlm import validate_vlm_batch

    res = inspect_source(
        source,
        schema=schema,
        layout=layout,
        token_budget=args.token_budget,
        planner=PlannerConfig(oversize=getattr(args, "oversize", "error")),
        num_workers=args.workers,
        seed=args.seed,
        defer_cp_shard=args.defer_cp_shard,
        limit=getattr(args, "limit", None),
        validate=lambda b: (
            validate_vlm_batch(b, schema, layout, raise_on_error=False)
            if "mrope_position_ids" in schema
            else validate_batch(b, schema, layout, raise_on_error=False)
        ),
    )
    tot = totals(res.stats)
    mode = (
        "whole batch + cp_gather_index (deferred CP shard)"
        if args.defer_cp_shard
        else "CP-sharded (zigzag)"
    )
    pad = 100.0 * (tot["padded_tokens"] - tot["real_tokens"]) / max(tot["padded_tokens"], 1)
    checks = len(res.stats) * layout.cp
    lines = [
        f"prealign: {title}",
        f"layout: tp={layout.tp} cp={layout.cp} sp={layout.sp} (T_local % {layout.local_multiple}, "
        f"every P_i % {layout.seq_multiple}), THD {mode}, token budget {args.token_budget}",
        "",
        format_table(res.stats, tp=layout.tp, max_rows=args.rows),
        "",
        f"micro-batches  {tot['micro_batches']} (x {_plural(layout.cp, 'CP rank', 'CP ranks')}), "
        f"{_plural(tot['sequences'], 'sequence', 'sequences')}, "
        f"{_plural(tot['images'], 'image', 'images')}"
        + (f", {_plural(tot['videos'], 'video', 'videos')}" if tot.get("videos") else ""),
        f"tokens         {tot['real_tokens']} real / {tot['padded_tokens']} padded ({pad:.1f}% "
        f"padding)",
        f"validated      {checks - sum(1 for s in res.stats if s.violations)}/{checks} batches "
        f"valid (schema {schema.name} {schema.fingerprint()}, media counts, SP/CP alignment)",
        *_skips(res.report),
        f"throughput     {_throughput(res, args.workers)}; index pass {res.index_seconds:.1f} s",
    ]
    if res.stats:
        lines += [
            "",
            "CP rank 0 shapes of micro-batch 0 (every CP rank alike):",
            format_shapes(res.stats[0]),
        ]
    if res.mixture:
        lines += [
            "",
            "mixture (shares of the "
            + ("tokens" if source.spec.by == "tokens" else "samples")
            + "):",
            _mixture_table(res.mixture),
        ]
    if res.first_violations:
        lines += ["", "first violations:", *(f"  {v}" for v in res.first_violations)]
    if res.panels:
        draw_packed_layout(
            res.panels,
            layout,
            args.out,
            title=f"prealign: tp={layout.tp} cp={layout.cp}, first "
            f"{_plural(len(res.panels), 'micro-batch', 'micro-batches')}",
        )
        lines += ["", f"picture        {args.out}"]
    print("\n".join(lines))
    return 0 if tot["violations"] == 0 else 1


def _throughput(res, workers: int) -> str:
    """Real tokens/s over all CP ranks, timed from the first micro-batch's arrival to the last
    (worker start-up left out): n/a below two micro-batches."""
    if res.steady_batches < 1 or res.steady_seconds <= 0:
        return "n/a (fewer than 2 micro-batches to time)"
    return (
        f"{res.steady_tokens / res.steady_seconds:,.0f} real tokens/s over all CP ranks "
        f"({res.steady_batches / res.steady_seconds:.1f} micro-batches/s after the first; decode "
        f"+ image processing + collate, {_plural(workers, 'worker', 'workers')} per rank)"
    )


def _skips(report, shown: int = 4) -> list[str]:
    """The bad-data report: counts by cause (the report's own, e.g. ``corrupt_image 1``), then the
    first sample of each cause, named with what was wrong."""
    from prealign.loaders.cli.errors import cause_lines

    if not report.total:
        return ["skipped        none"]
    counts = ", ".join(f"{k} {v}" for k, v in sorted(report.counts.items()))
    lines = [f"skipped        {report.total} sample(s), policy skip + count ({counts}):"]
    return lines + cause_lines(report)[: 2 * shown]


if __name__ == "__main__":
    sys.exit(main())
