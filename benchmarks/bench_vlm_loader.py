"""Multimodal loading: prealign's VLM loader against a hand-written pipeline on the same shards, and
the CPU of a whole CP group with :class:`~prealign.loaders.handoff.batch_share.BatchShare` (and the
per-sample :class:`~prealign.loaders.handoff.media_share.SharedMediaTransform`).

Data: ``build_demo_dataset`` (no planted bad samples), ``--samples`` samples (default 2,000) in
shards of 100; images 48..360 px, JPEG and PNG, 0-2 per sample.

- prealign: ``WebDatasetSource`` + ``VLMSampleTransform`` (no teacher) + ``PackedLoader`` (tp=1,
  cp=1: whole micro-batches, every token field, as the baseline builds them; budget ``--budget``
  tokens, ``--workers`` workers), index built once beforehand (timed apart).
- baseline: ``webdataset.WebDataset(shards)`` -> per sample: PIL decode, transformers' Qwen2-VL
  image processor, the same chat rendering and tokenizer -> ``.batched(B)`` with transformers'
  ``DataCollatorWithFlattening`` for the tokens plus ``torch.cat`` of ``pixel_values`` /
  ``image_grid_thw``; ``B`` = the budget over the mean sample length (about the same tokens per
  batch); a DataLoader with the same number of workers.
- Rounds alternate which runs first. Throughput: samples/s and real (unpadded) tokens/s of one
  epoch; CPU ms per sample: ``resource.getrusage`` of this process and its (joined) workers.
- Per-stage split: in-process, each stage timed on the same samples with ``time.process_time``
  (without what only a worker does: the recycled hand-off slots and the kept heap, so "collate +
  hand-off" here pays fresh memory per batch as the baseline's collate does).
- CP group: ``cp`` real processes (one per CP rank, one worker each), without sharing, with
  ``SharedMediaTransform`` (per sample) and with ``BatchShare`` (per collated micro-batch), sharing
  through a directory in /dev/shm, against one process loading the same rank alone without sharing;
  CPU = each process's own load phase (self + workers), imports and index excluded.

With ``--model {qwen2_vl,qwen2_5_vl,qwen3_vl,qwen3_5}`` the data is that family's (``prealign demo
--model``: its patch size, and short videos in about 40% of the samples) and prealign's transform
reads the family from the config; the baseline then also decodes every video frame and runs the
family's image processor on the frames (transformers' video processors need torchvision) with the
video processor's pixel range, so frames are resized to about the same size, and writes each video's
tokens with the same arithmetic. The CP group runs are for the default data only.

With ``--video`` (a family via ``--model``, default ``qwen3_vl``): every sample holds one mp4 clip
(30-90 frames at 24 or 30 fps, 160x120 to 320x240, written by ``ShardWriter``, whose sidecars come
from the mp4 headers); prealign's loader (only the sampled frames decoded, resized as decoded)
against the path a user writes today: per sample, transformers' PyAV reader
(``load_video(backend="pyav")``'s ``read_video_pyav`` on the member's bytes: every frame decoded),
the family's video processor frame choice (its ``sample_frames``, from the processor class; the
processor itself needs torchvision, so its resize and normalisation are stood in for by the family's
image processor on the sampled frames, at the video pixel range), the same chat rendering, then
``DataCollatorWithFlattening``. Same clips, same workers, rounds alternating; samples/s and CPU ms
per sample, median [min..max] of the per-round ratios.

    python benchmarks/bench_vlm_loader.py                 # full run (several minutes on 2 cores)
    python benchmarks/bench_vlm_loader.py --video --samples 96 --rounds 3
    python benchmarks/bench_vlm_loader.py --samples 300 --rounds 1 --quick
    for m in qwen2_vl qwen2_5_vl qwen3_vl qwen3_5; do
        python benchmarks/bench_vlm_loader.py --model $m --quick
    done
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_seconds() -> float:
    """CPU seconds of this process and its joined children."""
    usage = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def _spread(xs: list[float], fmt: str = "{:.2f}") -> str:
    """``median [min..max]`` of ``xs``."""
    return f"{fmt.format(float(np.median(xs)))} [{fmt.format(min(xs))}..{fmt.format(max(xs))}]"


# ---- the two pipelines
# ------------------------------------------------------------------------------
def make_transform(
    *,
    cp_rank: int = 0,
    cp_size: int = 1,
    share: bool = False,
    run: str = "bench",
    cache=None,
    model: str | None = None,
):
    from prealign.loaders.cli.demo_data import demo_model_config
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.loaders.handoff.media_share import SharedMediaTransform
    from prealign.loaders.media.vlm import VLMSampleTransform

    transform = VLMSampleTransform(
        tokenizer=ByteTokenizer(), model_config=None if model is None else demo_model_config(model)
    )
    if share:
        transform = SharedMediaTransform(
            transform=transform, run=run, cp_rank=cp_rank, cp_size=cp_size, cache_dir=cache
        )
    return transform


def prealign_loader(
    shards,
    index,
    *,
    budget: int,
    workers: int,
    cp: int = 2,
    cp_rank: int = 0,
    mode: str = "none",
    run: str = "bench",
    cache=None,
    model: str | None = None,
):
    """``mode``: ``"none"``, ``"sample"`` (SharedMediaTransform) or ``"batch"`` (BatchShare)."""
    from prealign.loaders import BatchShare, IndexOptions, PackedLoader, WebDatasetSource
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.schemas import ParallelLayout, vlm_schema

    transform = make_transform(
        cp_rank=cp_rank, cp_size=cp, share=mode == "sample", run=run, cache=cache, model=model
    )
    source = WebDatasetSource(list(shards), transform=transform, image="bytes")
    return PackedLoader(
        source,
        schema=vlm_schema(vocab_size=ByteTokenizer().vocab_size),
        layout=ParallelLayout(cp=cp),
        token_budget=budget,
        cp_rank=cp_rank,
        num_workers=workers,
        indexing=IndexOptions(prebuilt=index),
        share=BatchShare(run=run, cache_dir=cache) if mode == "batch" else None,
    )


class BaselineSample:
    """What a user writes: decode, the image processor, the chat with vision tokens expanded,
    labels."""

    def __init__(self, model: str | None = None):
        from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
        from prealign.loaders.media.vlm import image_processor

        self.tok, self.processor = ByteTokenizer(), image_processor()
        self.videos = None
        if model is not None:  # the family's processor settings; its video token arithmetic
            self.videos = make_transform(model=model)
            self.processor = self.videos.image_processor

    def frame_processor(self, frames: int):
        """The family's image processor with the video processor's pixel range per frame (the clip's
        range shared by its temporal groups where the family bounds the volume): frames resized to
        about the same size."""
        from prealign.loaders.media.vlm import image_processor

        geo, fam = self.videos.video_geometry, self.videos.family
        share = 2 * -(-frames // 2) if fam.volume_resize else 1
        return image_processor(
            patch_size=geo.patch_size,
            merge_size=geo.merge_size,
            min_pixels=geo.min_pixels // share,
            max_pixels=geo.max_pixels // share,
            image_mean=tuple(fam.video_defaults["image_mean"]),
            image_std=tuple(fam.video_defaults["image_std"]),
            temporal_patch_size=1,
        )

    def frame_pixels(self, frames: list) -> torch.Tensor:
        """A video's pixel rows float32 ``[t*h*w, 3*2*p*p]`` as the video processor lays them out:
        the image processor on each frame (one temporal slice each), then consecutive frames paired
        into temporal patches, the last frame repeated to an even count (the image processor alone
        would duplicate every frame into its own temporal patch: twice the rows prealign writes)."""
        frames = frames + frames[-1:] if len(frames) % 2 else frames
        x = self.frame_processor(len(frames))(images=frames, return_tensors="pt")["pixel_values"]
        p, pairs = self.videos.video_geometry.patch_size, len(frames) // 2
        x = x.view(pairs, 2, x.shape[0] // len(frames), 3, p * p)
        return x.permute(0, 2, 3, 1, 4).reshape(-1, 3 * 2 * p * p)

    def sampler(self, metadata):
        """The family's video processor ``sample_frames`` (Qwen3-VL's; Qwen2's default keeps every
        frame)."""
        import types

        if not self.videos.family.volume_resize:
            return np.arange(metadata.total_num_frames)
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
            Qwen3VLVideoProcessor as cls,
        )

        me = types.SimpleNamespace(
            fps=cls.fps, num_frames=None, min_frames=cls.min_frames, max_frames=cls.max_frames
        )
        return np.asarray(cls.sample_frames(me, metadata))

    def file_frames(self, data: bytes) -> list:
        """An mp4 member's frames as a user reads them: transformers' PyAV reader decodes every
        frame, then the family's frame choice (:meth:`sampler`)."""
        from transformers.video_utils import read_video_pyav

        video, metadata = read_video_pyav(
            io.BytesIO(data), lambda metadata, **kw: np.arange(metadata.total_num_frames)
        )
        return list(video[self.sampler(metadata)])

    def __call__(self, sample: dict) -> dict:
        from PIL import Image

        from prealign.loaders.media.vlm import render_chat

        meta = _json(sample["json"])
        images = [Image.open(io.BytesIO(sample[n])).convert("RGB") for n in meta.get("images", [])]
        dim = 3 * 2 * self.processor.patch_size**2
        if images:
            out = self.processor(images=images, return_tensors="pt")
            pixels, grid = out["pixel_values"], out["image_grid_thw"]
        else:
            pixels, grid = torch.zeros(0, dim), torch.zeros(0, 3, dtype=torch.int64)
        videos, video_pixels = None, torch.zeros(0, dim)
        if self.videos is not None:
            pieces = []
            for v in meta.get("videos", []):
                frames = (
                    self.file_frames(sample[v])
                    if isinstance(v, str)  # an mp4 member
                    else [Image.open(io.BytesIO(sample[n])).convert("RGB") for n in v["frames"]]
                )
                pieces.append(self.frame_pixels(frames))
            if pieces:
                video_pixels = torch.cat(pieces)
            videos = self.videos.header_video_ids(
                sample, meta, sample["__key__"], lambda n, v: Image.open(io.BytesIO(v)).size
            )
        ids, mask = render_chat(
            meta, self.tok, (grid.prod(-1) // 4).tolist(), sample=sample["__key__"], videos=videos
        )
        labels = np.where(mask > 0, ids, -100)
        return {
            "input_ids": ids.tolist(),
            "labels": labels.tolist(),
            "pixel_values": pixels,
            "image_grid_thw": grid,
            "pixel_values_videos": video_pixels,
        }


class BaselineCollate:
    def __init__(self):
        from transformers import DataCollatorWithFlattening

        self.flatten = DataCollatorWithFlattening(return_position_ids=True, return_tensors="pt")

    def __call__(self, samples: list[dict]) -> dict:
        batch = self.flatten(
            [{"input_ids": s["input_ids"], "labels": s["labels"]} for s in samples]
        )
        batch["pixel_values"] = torch.cat([s["pixel_values"] for s in samples])
        batch["image_grid_thw"] = torch.cat([s["image_grid_thw"] for s in samples])
        batch["pixel_values_videos"] = torch.cat([s["pixel_values_videos"] for s in samples])
        return batch


def baseline_loader(shards, *, batch_size: int, workers: int, model: str | None = None):
    import webdataset as wds

    dataset = (
        wds.WebDataset(list(shards), shardshuffle=False, empty_check=False)
        .map(BaselineSample(model))
        .batched(batch_size, collation_fn=BaselineCollate(), partial=True)
    )
    return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers)


def run_prealign(shards, index, args) -> dict:
    lengths = index.lengths
    c0, t0 = cpu_seconds(), time.perf_counter()
    n = tokens = 0
    # cp=1: whole micro-batches, as the baseline builds them (a CP rank of cp=2 would build half the
    # tokens)
    for batch in prealign_loader(
        shards, index, budget=args.budget, workers=args.workers, cp=1, model=args.model
    ):
        rows = batch["sample_index"]
        n += rows.numel()
        tokens += int(lengths[rows].sum())
    return {
        "samples": n,
        "tokens": tokens,
        "wall": time.perf_counter() - t0,
        "cpu": cpu_seconds() - c0,
    }


def run_baseline(shards, batch_size: int, args) -> dict:
    c0, t0 = cpu_seconds(), time.perf_counter()
    n = tokens = 0
    for batch in baseline_loader(
        shards, batch_size=batch_size, workers=args.workers, model=args.model
    ):
        n += int((batch["position_ids"] == 0).sum())
        tokens += batch["input_ids"].numel()
    return {
        "samples": n,
        "tokens": tokens,
        "wall": time.perf_counter() - t0,
        "cpu": cpu_seconds() - c0,
    }


# ---- per-stage split
# ----------------------------------------------------------------------------------
def stages(shards, index, n: int, model: str | None = None) -> dict:
    """ms of CPU per sample in each stage, both pipelines, in this process (one thread)."""
    from PIL import Image

    from prealign.collate import THDCollator
    from prealign.loaders import WebDatasetSource
    from prealign.loaders.handoff.fetched import Fetched
    from prealign.loaders.loader import _CollatePlanned
    from prealign.loaders.media.vlm import (
        decode_image,
        image_members,
        process_images,
        render_chat,
        sample_metadata,
        vision_types_and_mrope,
    )
    from prealign.loaders.plan.schedule import Request
    from prealign.schemas import ParallelLayout, vlm_schema

    torch.set_num_threads(1)  # as in a DataLoader worker
    transform = make_transform(model=model)
    source = WebDatasetSource(list(shards), image="bytes")
    locs = [tuple(index.locations[i].tolist()) for i in range(min(n, len(index)))]
    out: dict[str, dict[str, float]] = {"prealign": {}, "baseline": {}}

    def timed(pipe, name, fn, items):
        c = time.process_time()
        res = [fn(x) for x in items]
        out[pipe][name] = (time.process_time() - c) / len(locs) * 1e3
        return res

    raws = timed("prealign", "tar read + member decode", source.read, locs)
    metas = [sample_metadata(r, "json", r["__key__"]) for r in raws]
    members = [image_members(r, m, r["__key__"]) for r, m in zip(raws, metas)]
    images = timed(
        "prealign",
        "image decode",
        lambda ms: [decode_image(v, sample=0, name=k) for k, v in ms],
        members,
    )
    proc = transform.image_processor
    done = timed("prealign", "image processor", lambda im: process_images(im, proc), images)
    vision = transform.vision
    ids = timed(
        "prealign",
        "chat + tokens",
        lambda x: render_chat(
            x[0], transform.tokenizer, vision.tokens_per_image(x[1][1]).tolist(), sample=0
        ),
        list(zip(metas, done)),
    )

    def check_mrope(x):
        (i, _), (_, grid) = x
        return vision_types_and_mrope(
            torch.from_numpy(i), grid, vision, sample=0, mrope=transform.mrope
        )

    timed("prealign", "vision-token check + mRoPE", check_mrope, list(zip(ids, done)))
    samples = [transform(dict(r)) for r in raws]
    per = max(1, len(samples) // 8)
    collate = _CollatePlanned(
        THDCollator(
            schema=vlm_schema(vocab_size=transform.tokenizer.vocab_size),
            layout=ParallelLayout(cp=1),
            cp_rank=0,
        ),
        pack=True,
    )  # whole batches
    reqs = [
        Fetched(
            Request(epoch=0, position=k, indices=tuple(range(k, min(k + per, len(samples))))),
            samples[k : k + per],
            str,
        )
        for k in range(0, len(samples), per)
    ]
    timed("prealign", "collate + hand-off packing", collate, reqs)
    # baseline
    timed(
        "baseline", "tar read + member decode", source.read, locs
    )  # webdataset's own read is similar
    base = BaselineSample(model)
    pil = timed(
        "baseline",
        "image decode",
        lambda r: [
            Image.open(io.BytesIO(r[n])).convert("RGB") for n in _json(r["json"]).get("images", [])
        ],
        raws,
    )
    timed(
        "baseline",
        "image processor",
        lambda im: base.processor(images=im, return_tensors="pt") if im else None,
        pil,
    )
    bs = [base(r) for r in raws]
    coll = BaselineCollate()
    timed(
        "baseline",
        "collate (DataCollatorWithFlattening + cat)",
        coll,
        [bs[k : k + per] for k in range(0, len(bs), per)],
    )
    return out


# ---- CP group CPU
# ---------------------------------------------------------------------------------------
def group_rank(
    shards: list[str],
    index_path: str,
    out: str,
    cp: int,
    cp_rank: int,
    mode: str,
    cache: str,
    budget: int,
) -> None:
    """One CP rank of a group (run in its own process): load one epoch, write its CPU seconds."""
    from prealign.loaders import SampleIndex

    torch.set_num_threads(1)  # as in DataLoader workers (intra-op threads spin on a shared machine)
    index = SampleIndex.load(index_path)
    loader = prealign_loader(
        shards,
        index,
        budget=budget,
        workers=1,
        cp=cp,
        cp_rank=cp_rank,
        mode=mode,
        run="group",
        cache=cache,
    )
    loader.source.transform.image_processor
    c0 = cpu_seconds()
    n = sum(b["sample_index"].numel() for b in loader)
    with open(out, "w") as f:
        json.dump({"cpu": cpu_seconds() - c0, "samples": n}, f)


def group_cpu(
    shards, index_path: str, cp: int, mode: str, budget: int, tmp: str, ranks: int | None = None
) -> tuple[float, int]:
    """Total CPU seconds of ``ranks`` (default ``cp``) CP-rank processes run at once, and samples
    per rank."""
    cache = tempfile.mkdtemp(
        prefix="bench-share-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    ranks = range(cp if ranks is None else ranks)
    outs = [os.path.join(tmp, f"g{cp}-{mode}-{r}.json") for r in ranks]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; sys.path.insert(0, %r); from benchmarks.bench_vlm_loader import "
                "group_rank; group_rank(%r, %r, %r, %d, %d, %r, %r, %d)"
                % (ROOT, list(shards), index_path, o, cp, r, mode, cache, budget),
            ],
            cwd=ROOT,
        )
        for r, o in zip(ranks, outs)
    ]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"group rank failed ({p.returncode})")
    res = [json.load(open(o)) for o in outs]
    if os.environ.get("BENCH_VERBOSE"):
        print(f"  cp={cp} {mode}: per rank CPU s {[round(r['cpu'], 2) for r in res]}", flush=True)
    shutil.rmtree(cache, ignore_errors=True)
    return sum(r["cpu"] for r in res), res[0]["samples"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--stage-samples", type=int, default=300)
    ap.add_argument("--group-rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="skip the CP group runs")
    ap.add_argument(
        "--group-only", action="store_true", help="only the CP group runs (and the stage split)"
    )
    ap.add_argument(
        "--model",
        choices=("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"),
        help="that family's data with videos (module docstring); implies --quick",
    )
    ap.add_argument(
        "--video", action="store_true", help="mp4 clips in every sample (module docstring)"
    )
    args = ap.parse_args()
    if args.video:
        return video_main(args)
    args.quick = args.quick or args.model is not None

    from prealign.loaders import BadDataPolicy, WebDatasetSource, build_index
    from prealign.loaders.cli.demo_data import build_demo_dataset
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.schemas import vlm_schema

    tmp = tempfile.mkdtemp(prefix="bench-vlm-")
    try:
        data = build_demo_dataset(
            os.path.join(tmp, "shards"),
            num_samples=args.samples,
            samples_per_shard=100,
            bad=(),
            model=args.model,
        )
        t0 = time.perf_counter()
        source = WebDatasetSource(
            list(data.shards), transform=make_transform(model=args.model), image="bytes"
        )
        index = build_index(
            source,
            vlm_schema(vocab_size=ByteTokenizer().vocab_size),
            policy=BadDataPolicy(on_error="raise"),
            num_workers=args.workers,
        )
        index_s = time.perf_counter() - t0
        index_path = os.path.join(tmp, "index.npz")
        index.save(index_path)
        batch_size = max(
            1,
            round(
                args.budget
                / float(
                    index.lengths.float().mean()
                    if hasattr(index.lengths, "float")
                    else np.mean(index.lengths)
                )
            ),
        )
        metas = [_json(r["json"]) for r in _raws(data)]
        print(
            f"model {args.model or 'default (Qwen2-VL images)'}: {args.samples} samples, "
            f"{sum(len(m.get('images', [])) for m in metas)} images, "
            f"{sum(len(m.get('videos', [])) for m in metas)} "
            f"videos; index pass {index_s:.1f} s; budget {args.budget} tokens (baseline batch "
            f"{batch_size} samples); "
            f"{args.workers} workers; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} "
            f"cores"
        )
        rows = {"prealign": [], "baseline": []}
        for r in range(0 if args.group_only else args.rounds):
            order = ("baseline", "prealign") if r % 2 == 0 else ("prealign", "baseline")
            for name in order:
                res = (
                    run_prealign(data.shards, index, args)
                    if name == "prealign"
                    else run_baseline(data.shards, batch_size, args)
                )
                rows[name].append(res)
                print(
                    f"round {r} {name:9s} {res['samples'] / res['wall']:7.1f} samples/s "
                    f"{res['tokens'] / res['wall']:9.0f} tokens/s "
                    f"{res['cpu'] / res['samples'] * 1e3:6.2f} CPU ms/sample"
                    f"  (load {os.getloadavg()[0]:.2f})",
                    flush=True,
                )
        ratio = [
            p["samples"] / p["wall"] / (b["samples"] / b["wall"])
            for p, b in zip(rows["prealign"], rows["baseline"])
        ]
        cpu = [
            b["cpu"] / b["samples"] / (p["cpu"] / p["samples"])
            for p, b in zip(rows["prealign"], rows["baseline"])
        ]
        if ratio:
            for name, rs in rows.items():
                print(
                    f"{name}: wall s {_spread([r['wall'] for r in rs])}, CPU s "
                    f"{_spread([r['cpu'] for r in rs])}, CPU ms/sample "
                    f"{_spread([r['cpu'] / r['samples'] * 1e3 for r in rs])}, samples/s "
                    f"{_spread([r['samples'] / r['wall'] for r in rs], '{:.1f}')} "
                    f"(median [min..max] of {len(rs)} rounds)"
                )
            print(
                f"baseline / prealign CPU per sample per round: "
                f"{', '.join(f'{x:.2f}' for x in cpu)} (median [min..max] {_spread(cpu)})"
            )
            print(
                f"prealign / baseline samples/s per round: {', '.join(f'{x:.2f}' for x in ratio)} "
                f"(median [min..max] {_spread(ratio)})"
            )
        split = stages(data.shards, index, args.stage_samples, args.model)
        for name, parts in split.items():
            print(
                f"{name} per-stage CPU ms/sample: "
                + ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
                + f"; total {sum(parts.values()):.2f}"
            )
        if not args.quick:
            ratios: dict[tuple[int, str], list[float]] = {}
            for r in range(args.group_rounds):  # one loader re-measured each round: the load drifts
                one, n = group_cpu(data.shards, index_path, 2, "none", args.budget, tmp, ranks=1)
                print(
                    f"group round {r}: one loader alone (cp rank 0, 1 worker, no sharing) "
                    f"{one:.1f} CPU s for {n} samples (load {os.getloadavg()[0]:.2f})",
                    flush=True,
                )
                for cp in (2, 4):
                    cpu = {
                        mode: group_cpu(data.shards, index_path, cp, mode, args.budget, tmp)[0]
                        for mode in ("none", "sample", "batch")
                    }
                    for mode, c in cpu.items():
                        ratios.setdefault((cp, mode), []).append(c / one)
                    print(
                        f"  cp={cp} group (its {cp} ranks at once), CPU / one loader: no sharing "
                        f"{cpu['none'] / one:.2f}x, SharedMediaTransform "
                        f"{cpu['sample'] / one:.2f}x, BatchShare "
                        f"{cpu['batch'] / one:.2f}x ({cpu['batch']:.1f} s); load "
                        f"{os.getloadavg()[0]:.2f}",
                        flush=True,
                    )
            for cp in (2, 4):
                print(
                    f"cp={cp} group CPU / one loader, median of {args.group_rounds} rounds: "
                    + ", ".join(
                        f"{label} {float(np.median(ratios[(cp, mode)])):.2f}x"
                        for mode, label in (
                            ("none", "no sharing"),
                            ("sample", "SharedMediaTransform"),
                            ("batch", "BatchShare"),
                        )
                    )
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---- --video: mp4 members, prealign against load_video + the processor's sampling +
# DataCollatorWithFlattening ----
def write_video_shards(folder: str, n: int, model: str) -> list[str]:
    """``n`` samples of one mp4 clip each (moving gradients), in shards of 32 samples, sidecars from
    headers."""
    from prealign.loaders import ShardWriter

    rng = np.random.default_rng(0)
    with ShardWriter(
        os.path.join(folder, "v-%05d.tar"), max_samples=32, transform=make_transform(model=model)
    ) as w:
        for i in range(n):
            frames, (h, wd) = int(rng.integers(30, 91)), [(120, 160), (180, 240), (240, 320)][i % 3]
            y, x = np.mgrid[0:h, 0:wd]
            clip = np.stack(
                [
                    np.stack([(x + 5 * t) % 256, (y + 3 * t) % 256, (x + y + 7 * i) % 256], -1)
                    for t in range(frames)
                ]
            ).astype(np.uint8)
            chat = {
                "messages": [
                    {"role": "user", "content": "<video>\nWhat happens in the clip?"},
                    {"role": "assistant", "content": "Colours drift across the frame."},
                ]
            }
            w.write(
                {
                    "__key__": f"c{i:06d}",
                    "json": chat,
                    "clip.mp4": {"frames": clip, "fps": float(rng.choice([24.0, 30.0]))},
                }
            )
    return w.shards


class BaselineVideoSample(BaselineSample):
    """A user's per-sample code today: PyAV reader of transformers (every frame decoded), the family
    video processor's frame choice, the family's image processor on the chosen frames (module
    docstring)."""

    def __call__(self, sample: dict) -> dict:
        from prealign.loaders.media.vlm import render_chat

        meta = _json(sample["json"])
        frames = self.file_frames(sample["clip.mp4"])
        pixels = self.frame_pixels(frames)
        blocks = self.videos.header_video_ids(sample, meta, sample["__key__"], None)
        ids, mask = render_chat(meta, self.tok, [], sample=sample["__key__"], videos=blocks)
        labels = np.where(mask > 0, ids, -100)
        dim = pixels.shape[-1]
        return {
            "input_ids": ids.tolist(),
            "labels": labels.tolist(),
            "pixel_values": torch.zeros(0, dim),
            "image_grid_thw": torch.zeros(0, 3, dtype=torch.int64),
            "pixel_values_videos": pixels,
        }


def video_main(args) -> None:
    from prealign.loaders import IndexOptions, PackedLoader, WebDatasetSource, build_index
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.schemas import ParallelLayout, vlm_schema

    model = args.model or "qwen3_vl"
    n = args.samples if args.samples != 2000 else 96
    tmp = tempfile.mkdtemp(prefix="bench-video-")
    try:
        t0 = time.perf_counter()
        shards = write_video_shards(tmp, n, model)
        written = time.perf_counter() - t0
        schema = vlm_schema(vocab_size=ByteTokenizer().vocab_size)
        transform = make_transform(model=model)
        index = build_index(WebDatasetSource(shards, transform=transform, image="bytes"), schema)
        batch_size = max(1, round(args.budget / float(np.mean(np.asarray(index.lengths)))))
        print(
            f"--video {model}: {n} mp4 clips (shards + header sidecars written in {written:.1f} "
            f"s); budget "
            f"{args.budget} tokens (baseline batch {batch_size}); {args.workers} workers; load "
            f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores",
            flush=True,
        )

        def ours():
            loader = PackedLoader(
                WebDatasetSource(shards, transform=transform, image="bytes"),
                schema=schema,
                layout=ParallelLayout(tp=1, cp=1),
                token_budget=args.budget,
                cp_rank=None,
                num_workers=args.workers,
                seed=0,
                indexing=IndexOptions(prebuilt=index),
            )
            return sum(int(b["sample_index"].numel()) for b in loader)

        def theirs():
            import webdataset as wds

            dataset = (
                wds.WebDataset(list(shards), shardshuffle=False, empty_check=False)
                .map(BaselineVideoSample(model))
                .batched(batch_size, collation_fn=BaselineCollate(), partial=True)
            )
            loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=args.workers)
            return sum(int((b["position_ids"] == 0).sum()) for b in loader)

        rows = {"prealign": [], "baseline": []}
        for r in range(args.rounds):
            for name in ("baseline", "prealign") if r % 2 == 0 else ("prealign", "baseline"):
                c0, t0 = cpu_seconds(), time.perf_counter()
                got = (ours if name == "prealign" else theirs)()
                wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
                assert got == n, (name, got, n)
                rows[name].append((got / wall, cpu / got * 1e3))
                print(
                    f"round {r} {name:9s} {got / wall:7.2f} samples/s {cpu / got * 1e3:8.1f} CPU "
                    f"ms/sample (load {os.getloadavg()[0]:.2f})",
                    flush=True,
                )
        for name, rs in rows.items():
            print(
                f"{name}: samples/s {_spread([r[0] for r in rs])}, CPU ms/sample "
                f"{_spread([r[1] for r in rs], '{:.1f}')} (median [min..max] of {len(rs)} rounds)"
            )
        speed = [p[0] / b[0] for p, b in zip(rows["prealign"], rows["baseline"])]
        cpu = [b[1] / p[1] for p, b in zip(rows["prealign"], rows["baseline"])]
        for label, v in (
            ("prealign / baseline samples/s", speed),
            ("baseline / prealign CPU per sample", cpu),
        ):
            print(
                f"{label}: median {float(np.median(v)):.2f} [{min(v):.2f}..{max(v):.2f}] over "
                f"{len(v)} rounds"
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _json(value) -> dict:
    return value if isinstance(value, dict) else json.loads(value)


def _raws(data):
    from prealign.loaders import WebDatasetSource

    source = WebDatasetSource(list(data.shards), image="bytes")
    for s in range(source.num_shards):
        for _, raw in source.scan(s):
            yield raw


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
