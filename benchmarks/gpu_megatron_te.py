"""GPU check: a small megatron-core GPT model with TransformerEngine attention trains on prealign's
THD batches whose padded offsets differ from the true ones (TE's padded-THD path), fed through
``to_packed_seq_params``; every real token's loss equals that of its sequence run alone.

One command on a machine with one CUDA GPU (installs megatron-core and TransformerEngine for the
GPU's CUDA when they are missing: the first run compiles TE's PyTorch extension, a few minutes; in
an NGC PyTorch container both are already there):

    python benchmarks/gpu_megatron_te.py

``--dry-run`` builds and checks the batches and their ``PackedSeqParams`` on the CPU only (no
install, no CUDA), as the test suite does. Exit status: 0 when every case agrees and the
deliberately broken feed (the true offsets given to TE without the padded ones) is caught wherever a
sequence before the last is padded; 1 on any mismatch; 2 when the
environment cannot run the check (no GPU, TE not installable).

Per case (a layout whose padding makes ``cu_seqlens_padded != cu_seqlens``, both offset
conventions), the packed batch runs through the model once (bf16, dropout off, labels from the
batch, per-token loss times ``loss_mask``), each sample runs alone as a one-sequence THD batch, and
the per-token losses are compared at every real token (bf16 tolerance: max |diff| <= --atol, mean
|diff| <= --atol / 10).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 512
LENGTHS = (37, 5, 120, 64, 1, 250, 19)


def import_prealign() -> None:
    """``prealign`` installed, or else loaded from this checkout (its root folders are its
    subpackages)."""
    try:
        importlib.import_module("prealign.collate")
        return
    except ImportError:
        pass
    for name, folder in (
        ("prealign", "src/prealign"),
        ("prealign.schemas", "schemas"),
        ("prealign.collate", "collate"),
        ("prealign.loaders", "loaders"),
    ):
        spec = importlib.util.spec_from_file_location(
            name, ROOT / folder / "__init__.py", submodule_search_locations=[str(ROOT / folder)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


def cases():
    """(name, layout) pairs; each pads sequences (or the last one) so the padded offsets differ."""
    from prealign.schemas import FP8Recipe, PadPolicy, ParallelLayout

    return [
        ("cp2-minimal (every P_i % 4)", ParallelLayout(cp=2)),
        (
            "tp2-cp2-per-sequence (every P_i % 8)",
            ParallelLayout(tp=2, cp=2, pad_policy=PadPolicy.PER_SEQUENCE),
        ),
        (
            "tp4-fp8-min-rows (the last sequence grows)",
            ParallelLayout(tp=4, fp8=FP8Recipe.FP8, min_local_rows=700),
        ),
    ]


def build_batches(seed: int = 0) -> list[tuple[str, object, list[dict], dict]]:
    """(name, layout, samples, unsharded THD batch) per case, validated; CPU only."""
    from prealign.collate import THDCollator
    from prealign.schemas import causal_lm_schema, validate_batch

    schema = causal_lm_schema(vocab_size=VOCAB)
    g = torch.Generator().manual_seed(seed)
    samples = [
        {
            "input_ids": torch.randint(1, VOCAB, (n,), generator=g),
            "loss_mask": (torch.rand(n, generator=g) > 0.2).float(),
        }
        for n in LENGTHS
    ]
    out = []
    for name, layout in cases():
        batch = THDCollator(schema=schema, layout=layout)(samples)
        validate_batch(batch, schema, layout)
        if torch.equal(batch["cu_seqlens"], batch["cu_seqlens_padded"]):
            raise AssertionError(f"{name}: expected padded offsets that differ from the true ones")
        out.append((name, layout, samples, batch))
    return out


def feeds(batch: dict, device=None) -> dict:
    """The PackedSeqParams each case is run with: both conventions, and the broken feed (true
    offsets, no padded ones: TE then reads the padded buffer as if it held no pads) that the check
    must catch."""
    from prealign.collate import PackedSeqConvention, to_packed_seq_params

    padded = to_packed_seq_params(batch, convention=PackedSeqConvention.PADDED, device=device)
    unpadded = to_packed_seq_params(batch, convention=PackedSeqConvention.UNPADDED, device=device)
    broken = dataclasses.replace(unpadded, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None)
    return {"padded": padded, "unpadded": unpadded, "broken": broken}


def dry_run() -> int:
    for name, _, samples, batch in build_batches():
        f = feeds(batch)
        assert torch.equal(f["padded"].cu_seqlens_q, batch["cu_seqlens_padded"])
        assert torch.equal(f["unpadded"].cu_seqlens_q, batch["cu_seqlens"])
        print(
            f"{name}: T={batch['input_ids'].shape[1]} cu_seqlens={batch['cu_seqlens'].tolist()} "
            f"cu_seqlens_padded={batch['cu_seqlens_padded'].tolist()} feeds={sorted(f)}"
        )
    print("dry run: batches and PackedSeqParams built and validated (no CUDA used)")
    return 0


# ---- the GPU part
# ---------------------------------------------------------------------------------------
def ensure_installed(allow_install: bool) -> None:
    """megatron-core and TransformerEngine (PyTorch, for the GPU's CUDA major) importable,
    pip-installed if not."""
    missing = []
    if importlib.util.find_spec("megatron.core") is None:
        missing.append("megatron-core>=0.13")
    try:
        importlib.import_module("transformer_engine.pytorch")
    except ImportError:
        cuda_major = (torch.version.cuda or "12").split(".")[0]
        missing.append(f"transformer_engine[pytorch,core_cu{cuda_major}]")
    if not missing:
        return
    if not allow_install:
        raise SystemExit(f"missing: {missing} (run without --no-install to pip-install them)")
    print(
        f"installing {missing} (TE compiles its PyTorch extension against this torch: a few "
        f"minutes)",
        flush=True,
    )
    env = {
        **os.environ,
        "MAX_JOBS": os.environ.get("MAX_JOBS", str(os.cpu_count() or 8)),
        "NVTE_FRAMEWORK": "pytorch",
    }
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-build-isolation", *missing],
        check=True,
        env=env,
    )
    importlib.invalidate_caches()


def init_megatron() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl", world_size=1, rank=0)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1
    )
    model_parallel_cuda_manual_seed(1234)


def build_model():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=128,
        ffn_hidden_size=256,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        init_method_std=0.1,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
        vocab_size=VOCAB,
        max_sequence_length=4096,
        position_embedding_type="rope",
    )
    return model.cuda().eval()


def token_losses(model, ids, positions, labels, params) -> torch.Tensor:
    """float32 ``[T]``: megatron's per-token CE of ``labels`` (clamped; the caller masks)."""
    with torch.no_grad():
        return model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=None,
            labels=labels.clamp_min(0),
            packed_seq_params=params,
        )[0].float()


def gpu_check(atol: float) -> int:
    from megatron.core.packed_seq_params import PackedSeqParams

    init_megatron()
    model = build_model()
    failures, caught, must_catch_cases = [], 0, 0
    for name, _, samples, batch in build_batches():
        b = {k: v.cuda() for k, v in batch.items() if torch.is_tensor(v)}
        mask = b["loss_mask"][0]
        want = torch.zeros_like(mask)
        for i, s in enumerate(samples):  # each sequence alone, a one-sequence THD batch
            n = s["input_ids"].numel()
            cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
            alone = PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n, max_seqlen_kv=n
            )
            ids = s["input_ids"].cuda()[None]
            labels = torch.cat((ids[0, 1:], torch.tensor([-100], device="cuda")))[None]
            start = int(b["cu_seqlens_padded"][i])
            want[start : start + n] = token_losses(
                model, ids, torch.arange(n, device="cuda")[None], labels, alone
            )
        want *= mask
        # the broken feed matters only when a sequence before the last one is padded
        must_catch = bool((batch["cu_seqlens"][:-1] != batch["cu_seqlens_padded"][:-1]).any())
        must_catch_cases += must_catch
        for feed, params in feeds(batch, device="cuda").items():
            try:
                got = (
                    token_losses(model, b["input_ids"], b["position_ids"], b["labels"], params)
                    * mask
                )
            except RuntimeError as exc:  # TE may refuse the broken feed outright: caught as well
                if feed != "broken":
                    raise
                print(f"{name:45s} {feed:9s} refused by TE ({str(exc).splitlines()[0][:80]})")
                caught += must_catch
                continue
            diff = (got - want).abs()
            worst, mean = float(diff.max()), float(diff[mask > 0].mean())
            ok = worst <= atol and mean <= atol / 10
            print(
                f"{name:45s} {feed:9s} max|diff| {worst:.2e} mean|diff| {mean:.2e} "
                f"{'agree' if ok else 'DIFFER'}",
                flush=True,
            )
            if feed == "broken":
                caught += must_catch and not ok
            elif not ok:
                failures.append((name, feed, worst, mean))
    n_cases = len(cases())
    if caught < must_catch_cases:
        print(
            f"FAIL: the broken feed went unnoticed in {must_catch_cases - caught} case(s): the "
            f"comparison is too loose"
        )
        return 1
    if failures:
        print(f"FAIL: {len(failures)} packed run(s) differ from the per-sample runs: {failures}")
        return 1
    print(
        f"OK: {n_cases} layouts x 2 conventions agree with per-sample runs; the broken feed was "
        f"caught in the {must_catch_cases} where it matters"
    )
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="build and check the batches on the CPU only"
    )
    parser.add_argument(
        "--no-install", action="store_true", help="never pip-install megatron-core / TE"
    )
    parser.add_argument(
        "--atol", type=float, default=0.1, help="max per-token loss difference (bf16)"
    )
    args = parser.parse_args(argv)
    import_prealign()
    if args.dry_run:
        return dry_run()
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to check (use --dry-run for the CPU part)")
        return 2
    start = time.perf_counter()
    try:
        ensure_installed(not args.no_install)
    except (subprocess.CalledProcessError, SystemExit) as exc:
        print(f"cannot install what the check needs: {exc}")
        return 2
    rc = gpu_check(args.atol)
    print(f"{time.perf_counter() - start:.0f} s in all")
    return rc


if __name__ == "__main__":
    sys.exit(main())
