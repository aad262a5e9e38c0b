"""``prealign index SHARDS... [--out DIR] [--workers N]``: write a sidecar index beside each shard.

The transform is chosen as ``prealign inspect`` chooses it (``--text`` for pre-tokenized ``.npy``
members, else the VLM transform with ``--tokenizer DIR`` / ``--processor DIR``: local Hugging Face
folders, never downloaded; without ``--tokenizer``, the demo byte tokenizer). A sidecar describes
the data: it serves any schema, pad id, vocabulary, layout and budget; only the transform is part of
its key. Shards whose sidecar is up to date (same size, same first/last 64 KiB, same transform) are
left alone, so a second run indexes only new or changed shards. ``--workers N`` local processes
share the shards; under ``torchrun`` (an initialised ``torch.distributed`` group, or ``WORLD_SIZE``
> 1 in the environment) rank ``r`` of ``W`` indexes shards ``r, r+W, ...``, then the ranks agree in
a gloo group (made from ``torchrun``'s environment when none exists). ``--merge`` then writes one
merged index of all the shards (:mod:`~prealign.loaders.index.merged`; rank 0, after every rank is
done), which a loader reads instead of one sidecar per shard; an existing merged index of exactly
this run's shards is rewritten by every run, so it never lags its sidecars (one of other shards is
left alone). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from prealign.loaders.cli.errors import OPEN_LINE
from prealign.loaders.media.families import (  # (also what `main` imports from here)
    chat_tokenizer,
    own_transform,
    transform_schema,
)


def add_parser(sub) -> None:
    """Register the ``index`` sub-command on ``sub`` (the ``prealign`` parser's sub-parsers)."""
    p = sub.add_parser(
        "index",
        help="write a sidecar index beside each shard (training then starts at once)",
        description="Index webdataset shards once: token lengths from headers, byte ranges, media "
        "flags, named dims and a fingerprint of each shard, in a small sidecar file "
        "that WebDatasetSource finds by itself.",
    )
    p.add_argument("shards", nargs="+", help="webdataset shards (paths, URLs, brace patterns)")
    p.add_argument(
        "--out",
        metavar="DIR",
        help="write the sidecars to DIR (then pass index_dir=DIR to "
        "WebDatasetSource) instead of beside the shards",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="local processes, used above 192 MiB of shards (16 MiB "
        "with --full; below, one process is faster) [%(default)s]",
    )
    p.add_argument(
        "--text",
        action="store_true",
        help="pre-tokenized .npy members (causal-LM schema) instead of the VLM transform",
    )
    add_teacher_args(p)
    add_transform_args(p)
    p.add_argument(
        "--full",
        action="store_true",
        help="run the full transform on every sample (no header rule)",
    )
    p.add_argument(
        "--force", action="store_true", help="re-index shards whose sidecar is up to date"
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="index nothing: read every shard whole and compare it with "
        "its sidecar's recorded hash (exit 1 on any difference)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="also write one merged index of all the shards (a loader "
        "then reads one file, not a sidecar per shard)",
    )
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    p.add_argument(
        "--header-only",
        action="store_true",
        help="VLM: read image headers only, no pixel decode "
        "(a corrupt image body is found when loaded)",
    )
    p.set_defaults(func=cmd_index)


def add_teacher_args(p) -> None:
    """``--topk K`` / ``--vocab-size V``: the teacher top-k members to expect, and the bound of
    their ids (text mode)."""
    p.add_argument(
        "--topk",
        type=int,
        default=0,
        help="expect teacher top-k with this K (0: none) [%(default)s]",
    )
    p.add_argument("--vocab-size", type=int, default=None, help="bound teacher ids (text mode)")


def add_transform_args(p) -> None:
    """``--tokenizer DIR`` / ``--processor DIR``: the VLM transform's tokenizer and image
    processor."""
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="VLM: a local Hugging Face tokenizer folder (never downloaded; "
        "default: the demo byte tokenizer)",
    )
    p.add_argument(
        "--processor",
        metavar="DIR",
        help="VLM: a local folder with the image processor's "
        "preprocessor_config.json (default: Qwen2-VL's defaults) "
        "and, for videos, its video_preprocessor_config.json",
    )
    p.add_argument(
        "--model-config",
        metavar="DIR",
        help="VLM: a local folder with the model's config.json: its "
        "family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, InternVL, "
        "GLM-4.1V, Gemma 3, LLaVA-OneVision) sets the transform, "
        "token ids, grids, batch schema and video rules (default: Qwen2-VL)",
    )


PROCESSOR_KEYS = (
    "min_pixels",
    "max_pixels",
    "patch_size",
    "temporal_patch_size",
    "merge_size",
    "image_mean",
    "image_std",
    "do_resize",
    "do_rescale",
    "do_normalize",
    "rescale_factor",
)
"""Image processor settings ``--processor DIR`` takes from its ``preprocessor_config.json``."""


def load_local(auto, option: str, folder: str, what: str):
    """``auto.from_pretrained(folder)`` from local files only (a transformers ``Auto*`` class:
    nothing downloaded), or a :class:`~prealign.schemas.errors.ConfigError` naming ``option
    folder``, ``what`` went wrong and the cause's first line."""
    from prealign.schemas.errors import ConfigError

    try:
        return auto.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, RecursionError, TypeError, AttributeError, KeyError) as exc:
        # (JSON nested too deep; a value of another type than transformers reads, e.g.
        # tokenizer_class: 3, fails inside it as a TypeError / AttributeError / KeyError)
        raise ConfigError(
            f"{option} {folder}: {what} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None


def _json_object(folder: str, name: str) -> dict:
    """The JSON object of ``--processor``'s file ``name``; a file that is missing, not JSON,
    nested too deep or not an object is a :class:`~prealign.schemas.errors.ConfigError` naming
    it."""
    import json

    from prealign.schemas.errors import ConfigError

    try:
        with open(os.path.join(folder, name)) as f:
            config = json.load(f)
    except (OSError, ValueError, RecursionError) as exc:
        raise ConfigError(
            f"--processor {folder}: no readable {name} ({type(exc).__name__})"
        ) from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"--processor {folder}: {name}: expected a JSON object of settings, got "
            f"{type(config).__name__}"
        )
    return config


def vlm_transform(args, topk):
    """The VLM transform ``args`` name, and a description of its tokenizer for the report: the
    family's own transform where it has one (Gemma 3, LLaVA-OneVision: ``VisionFamily.transform``),
    else :class:`VLMSampleTransform` (the Qwen families, InternVL), the tokenizer wrapped with the
    family's token names."""

    from prealign.loaders.media.vlm import VLMSampleTransform

    hf = None
    if getattr(args, "tokenizer", None):
        from transformers import AutoTokenizer

        hf = load_local(
            AutoTokenizer,
            "--tokenizer",
            args.tokenizer,
            "not a local Hugging Face tokenizer folder",
        )
    options = {}
    if getattr(args, "processor", None):
        config = _json_object(args.processor, "preprocessor_config.json")
        options = {k: config[k] for k in PROCESSOR_KEYS if k in config}
    model_config = video = family = None
    if getattr(args, "model_config", None):
        from transformers import AutoConfig

        from prealign.collate.vision import vision_family

        model_config = load_local(
            AutoConfig, "--model-config", args.model_config, "no readable config.json of a model"
        )
        family = vision_family(model_config)
        video_path = os.path.join(args.processor or "", "video_preprocessor_config.json")
        if args.processor and os.path.isfile(video_path):
            video = _json_object(args.processor, "video_preprocessor_config.json")
    if hf is None:
        from prealign.loaders.cli.demo_tokenizer import ByteTokenizer

        tok, told = ByteTokenizer(), "the demo byte tokenizer (give --tokenizer DIR for yours)"
    else:
        tok = (
            hf if getattr(family, "transform", None) else chat_tokenizer(hf, family)
        )  # own transforms wrap it
        told = f"{args.tokenizer} ({type(hf).__name__}, vocabulary {len(hf)})"
    if model_config is not None:
        told += f"; model family from {args.model_config} ({model_config.model_type})"
    if getattr(family, "transform", None):
        return own_transform(family, model_config, tok, topk, args.processor), told
    return VLMSampleTransform(
        tokenizer=tok,
        topk=topk,
        processor_options=options,
        model_config=model_config,
        video_processor_config=video,
    ), told


def source_and_schema(args):
    """(WebDatasetSource, schema) for ``args`` as ``prealign inspect`` builds them."""
    from prealign.loaders.sources.webdataset import WebDatasetSource, numpy_fields
    from prealign.schemas.schema import causal_lm_schema

    topk = args.topk or None
    if args.text:
        schema, transform = causal_lm_schema(topk=topk, vocab_size=args.vocab_size), numpy_fields
    else:
        transform, _ = vlm_transform(args, topk)
        schema = transform_schema(transform, topk)
    return WebDatasetSource(
        args.shards, transform=transform, image="bytes", index_dir=args.out
    ), schema


def _initialized_group():
    """``torch.distributed`` when this process has an initialised group, else None (looked up, not
    imported: a group exists only where torch is imported already, and ``prealign index --text``
    imports no torch)."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def _grouped() -> bool:
    """A process group exists, or ``torchrun``'s rendezvous address is set (one can be made)."""
    return _initialized_group() is not None or bool(os.environ.get("MASTER_ADDR"))


def _rank_world() -> tuple[int, int]:
    dist = _initialized_group()
    if dist is not None:
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class Progress:
    """A plain-text progress bar on stderr: ``[#####.....] 12/40 shards, 120,000 samples,
    85,000/s``."""

    def __init__(self, label: str, stream=None):
        self.label, self.stream, self.t0, self.last = (
            label,
            stream or sys.stderr,
            time.perf_counter(),
            0.0,
        )

    def __call__(self, done: int, total: int, samples: int) -> None:
        now = time.perf_counter()
        if done < total and now - self.last < 0.2:
            return
        self.last = now
        width = 30
        fill = width * done // max(total, 1)
        rate = samples / max(now - self.t0, 1e-9)
        end = "\n" if done >= total else ""
        OPEN_LINE[
            0
        ] = not end  # a warning meanwhile ends the bar's line first (cli.errors.warning_line)
        self.stream.write(
            f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {done}/{total} shards, "
            f"{samples:,} samples, {rate:,.0f} samples/s{end}"
        )
        self.stream.flush()


def _refuse_special_files(urls: list[str]) -> None:
    """A local shard that exists but is a device, FIFO or socket is refused before anything opens it
    (the preflight's magic check would block on a FIFO, read ``/dev/zero`` as a shard)."""
    import os
    import stat

    from prealign.loaders.errors import NotRegularFileError
    from prealign.loaders.sources import remote

    for url in urls:
        if remote.is_remote(url):
            continue
        try:
            mode = os.stat(remote.local_path(url)).st_mode
        except (OSError, ValueError):
            continue  # missing: the preflight names every missing shard
        if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
            raise NotRegularFileError(
                url, "shard is not a regular file (a device, FIFO or socket)", "give a plain file"
            )


def cmd_index(args) -> int:
    from prealign.loaders.cli import preflight
    from prealign.loaders.index.header_pass import write_sidecars
    from prealign.loaders.sources.webdataset import expand_urls

    preflight.check_int("--workers", args.workers, 1)
    preflight.check_topk_vocab(args)
    preflight.check_dir("--out", args.out)
    if (
        len(args.shards) == 1
        and args.shards[0].endswith(".json")
        and os.path.isfile(args.shards[0])
    ):
        return _index_mixture(args)
    urls = expand_urls(args.shards)
    _refuse_special_files(urls)
    preflight.check_shards(urls)
    preflight.check_mode(urls, args.text, "index")
    source, schema = source_and_schema(args)
    rank, world = _rank_world()
    shards = list(range(source.num_shards))[rank::world]
    if args.check:
        return _check(source, shards, args.out, rank, world)
    alone = world > 1 and not _grouped()  # ranks split by hand (RANK / WORLD_SIZE only)
    if alone and args.merge:
        from prealign.schemas.errors import ConfigError

        raise ConfigError(
            f"--merge with WORLD_SIZE={world} but no MASTER_ADDR (no torchrun): rank 0 cannot wait "
            "for the others; run `prealign index --merge` once after every rank is done"
        )
    label = "prealign index" + (f" (rank {rank}/{world})" if world > 1 else "")
    t0 = time.perf_counter()
    with _ranks_agree(1 if alone else world) as agree:
        stats = agree(
            lambda: write_sidecars(
                source,
                schema,
                out_dir=args.out,
                workers=args.workers,
                full=args.full,
                force=args.force,
                shards=shards,
                progress=Progress(label),
                verify_images=not args.header_only,
            )
        )
        dt = time.perf_counter() - t0
        print(
            f"{stats['indexed']} shard(s) indexed ({stats['samples']:,} samples in {dt:.2f} s), "
            f"{stats['up_to_date']} up to date" + (f", sidecars in {args.out}" if args.out else ""),
            file=sys.stderr,
        )
        agree(
            lambda: _merge(source, args.merge, rank if not alone else -1)
        )  # every rank returns once the merged index is written
        if stats.get("bad") or stats.get(
            "up_to_date"
        ):  # (bad samples recorded now, or maybe before)
            _say_refused(source, schema, shards, stats.get("bad") or {})
    return 0


def _index_mixture(args) -> int:
    """``prealign index mix.json``: each webdataset component of the mixture file indexed as its own
    shards (its transform: none -> ``--text``, a model config folder -> the VLM transform of that
    folder); an HF component needs no sidecar (said on stderr)."""
    import copy

    from prealign.loaders.mixture_file import read_mixture_file, resolved_shards

    path = args.shards[0]
    data = read_mixture_file(path)
    rc = 0
    for name, entry in data["components"].items():
        if "path" not in entry:
            print(f"{name}: an HF dataset, no sidecar to write", file=sys.stderr)
            continue
        sub = copy.copy(args)
        shards = resolved_shards(path, entry["path"])
        sub.shards = shards if isinstance(shards, list) else [shards]
        kind = entry.get("transform")
        sub.text = kind is None
        if kind not in (None, "text"):
            folder = resolved_shards(path, kind)
            sub.model_config, sub.tokenizer = folder, sub.tokenizer or folder
            sub.processor = sub.processor or folder
        print(f"{name}:", file=sys.stderr)
        rc = max(rc, cmd_index(sub))
    return rc


def _say_refused(source, schema, shards: list[int], recorded: dict) -> None:
    """How many samples of ``shards`` their sidecars refuse and why (what a loader leaves out under
    ``BadDataPolicy(on_error='skip')``, or raises under the default ``raise``), one line per cause
    with an example, on stderr; nothing when none is."""
    from prealign.loaders.cli.errors import cause_lines
    from prealign.loaders.index.build import build_index
    from prealign.loaders.policy import BadDataPolicy
    from prealign.loaders.sources.webdataset import WebDatasetSource
    from prealign.schemas.errors import PrealignError

    if not shards:
        return
    mine = WebDatasetSource(
        [source.urls[s] for s in shards],
        transform=source.transform,
        image=source.image,
        index_dir=source.index_dir,
        remote=source.remote,
    )
    skip = BadDataPolicy(on_error="skip", warn=False, max_consecutive=2**62)
    try:
        report = build_index(mine, schema, policy=skip, distributed=False).report
    except (
        PrealignError
    ) as exc:  # e.g. a stale merged index (a loader refuses it too): the pass's own counts
        if recorded:
            counts = ", ".join(f"{k} {v}" for k, v in sorted(recorded.items()))
            print(
                f"{sum(recorded.values()):,} sample(s) refused ({counts}) in the sidecars just "
                f"written; the index as a loader reads it: {type(exc).__name__}: {exc}",
                file=sys.stderr,
            )
        return
    if not report.total:
        return
    counts = ", ".join(
        f"{reason} {n}" for reason, n in sorted(report.counts.items(), key=lambda kv: -kv[1])
    )
    print(
        f"{report.total:,} sample(s) refused ({counts}): a loader raises at the first under the "
        f"default "
        f"BadDataPolicy(on_error='raise'), leaves them out and counts them under on_error='skip'",
        file=sys.stderr,
    )
    for line in cause_lines(report):
        print(line, file=sys.stderr)


class _ranks_agree:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1), a gloo group for the command's life (created at the
    first exchange when none is, from ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``;
    destroyed at the end): ``agree(fn)`` runs ``fn`` on every rank, then waits for all of them and
    raises the first rank's error on every rank, so rank 0 merges only after every rank wrote its
    sidecars."""

    def __init__(self, world: int):
        self.world, self.own = world, False

    def __enter__(self):
        return self

    def _join(self) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group(
                "gloo"
            )  # (after the indexing: its worker processes fork without it)
            self.own = True

    def __exit__(self, *exc) -> None:
        if self.own:
            import torch.distributed as dist

            dist.destroy_process_group()

    def __call__(self, fn):
        try:
            out, failure = fn(), None
        except Exception as exc:  # noqa: BLE001 - re-raised below: every rank must reach the exchange first
            if self.world == 1:
                raise
            out, failure = None, exc
        if self.world == 1:
            return out
        from prealign.schemas.distributed import all_gather_objects, process_rank_world
        from prealign.schemas.errors import PrealignError

        self._join()
        typed = (
            failure
            if failure is None or isinstance(failure, PrealignError)
            else PrealignError(f"{type(failure).__name__}: {failure}")
        )
        parts = all_gather_objects(None if failure is None else (process_rank_world()[0], typed))
        if failure is not None:
            raise failure
        for rank, err in (
            p for p in parts if p is not None
        ):  # another rank's error, as its own type
            err.args = (f"rank {rank} failed: {err.args[0] if err.args else ''}", *err.args[1:])
            raise err
        return out


def _merge(source, asked: bool, rank: int) -> None:
    """``--merge``, or a merged index already there of exactly these shards (kept in step with its
    sidecars): rank 0 writes it. A merged index of other shards (all of a folder, when this run
    indexes some) is left as it is, and said so."""
    from prealign.loaders.index.merged import merge_sidecars, merged_names, merged_path
    from prealign.loaders.sources import remote
    from prealign.loaders.sources.shard_files import shard_name

    path = merged_path(source)
    if rank != 0:
        if rank < 0 and os.path.exists(
            path
        ):  # (ranks split by hand: no rank knows when the others are done)
            print(
                f"merged index {path} left as it is: ranks without torchrun; run `prealign index "
                f"--merge` "
                "once every rank is done",
                file=sys.stderr,
            )
        return
    if not asked:
        if remote.is_remote(path) or not os.path.exists(remote.local_path(path)):
            return
        names = merged_names(path)
        if names != [shard_name(u) for u in source.urls]:
            print(
                f"merged index {path} left as it is: it is of "
                f"{'other' if names is None else len(names)} "
                f"shard(s), not of the {len(source.urls)} indexed now (give --merge to replace it "
                f"with one of these)",
                file=sys.stderr,
            )
            return
    t0 = time.perf_counter()
    done = merge_sidecars(source)
    print(
        f"merged index of {done['shards']} shard(s), {done['samples']:,} samples: {done['path']} "
        f"({time.perf_counter() - t0:.2f} s)",
        file=sys.stderr,
    )


def _check(source, shards: list[int], out: str | None, rank: int, world: int) -> int:
    """``prealign index --check``: each shard read whole against its sidecar's hash; 1 when any
    differs."""
    from prealign.loaders.index.header_pass import verify_shards

    label = "prealign index --check" + (f" (rank {rank}/{world})" if world > 1 else "")
    problems = verify_shards(source, shards, out_dir=out, progress=Progress(label))
    for url, what in problems.items():
        print(f"prealign index --check: {url}: {what}", file=sys.stderr)
    print(
        f"{len(shards) - len(problems)}/{len(shards)} shard(s) match their sidecars",
        file=sys.stderr,
    )
    stale = _check_merged(source, shards, out)  # what a loader reads first: checked as it checks it
    for where, what in stale.items():
        print(f"prealign index --check: {where}: {what}", file=sys.stderr)
    if stale:
        print(
            f"the merged index is stale ({len(stale)} problem(s)): a loader refuses it; run "
            f"`prealign index --merge` with the flags that built the sidecars to rewrite it",
            file=sys.stderr,
        )
    return 1 if problems or stale else 0


def _check_merged(source, shards: list[int], out: str | None) -> dict[str, str]:
    """:func:`~prealign.loaders.index.merged.check_merged` of the source (its sidecars in ``out``
    when given)."""
    import copy

    from prealign.loaders.index.merged import check_merged

    if out:
        source = copy.copy(source)
        source.index_dir = out
    return check_merged(source, shards)


def main(argv: list[str] | None = None) -> int:  # for `python -m prealign.loaders.cli.index_cmd`
    from prealign.loaders.cli.errors import run_reporting

    parser = argparse.ArgumentParser(prog="prealign")
    add_parser(parser.add_subparsers(dest="command", required=True))
    argv = ["index", *(sys.argv[1:] if argv is None else argv)]
    return run_reporting(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
