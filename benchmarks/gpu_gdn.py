"""GPU check: packed Gated DeltaNet (Qwen3.5 / Qwen3.6 linear-attention layers) with the fast
kernels honours prealign's packing metadata. Needs CUDA, ``flash-linear-attention`` (``fla``) and
``causal-conv1d``.

1. Kernels alone, on random data: ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` on one packed
   row ``[1, T, H, K]`` with ``cu_seqlens`` equals the per-sequence calls;
   ``causal_conv1d.causal_conv1d_fn`` on a channel-last ``[1, D, T]`` with ``seq_idx`` (int32 ``[1,
   T]``) equals the per-sequence convolutions; without the metadata the packed results differ (the
   check can fail).
2. In the model: a tiny ``Qwen3_5ForConditionalGeneration`` with its default mixed ``layer_types``
   (random weights, float32) fed prealign's packed THD batch through ``to_hf_kwargs(...,
   model_config=cfg)`` (``cu_seq_lens_q/k``, ``seq_idx``, ``[4, 1, T]`` positions): logits at every
   real token equal each sample run alone within ``--tol``; the same batch without ``cu_seq_lens_q``
   / ``seq_idx`` must not.

    python benchmarks/gpu_gdn.py            # GPU + fla + causal-conv1d: exit 0 if all hold
    python benchmarks/gpu_gdn.py --dry-run  # CPU: builds the batches and the model kwargs only

Exit codes: 0 all checks hold, 1 a check failed, 2 no CUDA / kernels missing (nothing measured).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENGTHS = (37, 128, 5, 200)


def packed_batch(device: str = "cpu"):
    """Text-only samples of ``LENGTHS`` packed by prealign's THD collator (tp=2: each sequence
    padded to even)."""
    from prealign.collate import THDCollator
    from prealign.schemas import ParallelLayout, causal_lm_schema

    g = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(8, 200, (n,), generator=g)} for n in LENGTHS]
    return samples, THDCollator(schema=causal_lm_schema(), layout=ParallelLayout(tp=2))(samples)


def model_config():
    """A 4-layer Qwen3.5 (3 linear-attention layers, 1 full) with small dims."""
    import transformers

    text = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    )
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=64,
        patch_size=16,
    )
    return transformers.Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        image_token_id=250,
        video_token_id=251,
        vision_start_token_id=252,
        vision_end_token_id=253,
    )


def model_kwargs(batch, cfg, *, check: bool = True) -> dict:
    """``to_hf_kwargs`` with the model config (``seq_idx`` added); ``check=False`` builds the same
    where the kernels are missing (the dry run), without the GDN packing check."""
    from prealign.collate.hf import HFAttention, packed_seq_idx, to_hf_kwargs

    if check:
        return to_hf_kwargs(batch, attention=HFAttention.VARLEN, model_config=cfg)
    return {
        **to_hf_kwargs(batch, attention=HFAttention.VARLEN),
        "seq_idx": packed_seq_idx(batch["cu_seqlens_padded"]),
    }


def kernel_checks(device: str, tol: float) -> list[str]:
    """The two kernels with and without the packing metadata; returns the failures."""
    from causal_conv1d import causal_conv1d_fn
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    failures = []
    g = torch.Generator(device=device).manual_seed(0)
    cu = torch.tensor(
        [0, *torch.tensor(LENGTHS).cumsum(0).tolist()], device=device, dtype=torch.int32
    )
    total, heads, dk, dv = int(cu[-1]), 4, 32, 32
    q, k = (torch.randn(1, total, heads, dk, device=device, generator=g) for _ in range(2))
    v = torch.randn(1, total, heads, dv, device=device, generator=g)
    gate = -torch.rand(1, total, heads, device=device, generator=g)  # log decay <= 0
    beta = torch.rand(1, total, heads, device=device, generator=g)
    packed, _ = chunk_gated_delta_rule(
        q, k, v, g=gate, beta=beta, cu_seqlens=cu.long(), use_qk_l2norm_in_kernel=True
    )
    blind, _ = chunk_gated_delta_rule(q, k, v, g=gate, beta=beta, use_qk_l2norm_in_kernel=True)
    alone = torch.cat(
        [
            chunk_gated_delta_rule(
                *(x[:, a:b] for x in (q, k, v)),
                g=gate[:, a:b],
                beta=beta[:, a:b],
                use_qk_l2norm_in_kernel=True,
            )[0]
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())
        ],
        dim=1,
    )
    err, leak = float((packed - alone).abs().max()), float((blind - alone).abs().max())
    print(f"fla chunk_gated_delta_rule: packed vs alone {err:.2e}, without cu_seqlens {leak:.2e}")
    if err > tol or leak <= tol:
        failures.append("chunk_gated_delta_rule")
    dim, width = 96, 4
    x = torch.randn(1, total, dim, device=device, generator=g).transpose(
        1, 2
    )  # channel-last [1, D, T]
    w = torch.randn(dim, width, device=device, generator=g)
    seq_idx = torch.repeat_interleave(
        torch.arange(len(LENGTHS), device=device, dtype=torch.int32),
        torch.tensor(LENGTHS, device=device),
    )[None]
    packed = causal_conv1d_fn(x, w, seq_idx=seq_idx, activation="silu")
    blind = causal_conv1d_fn(x, w, activation="silu")
    alone = torch.cat(
        [
            causal_conv1d_fn(x[:, :, a:b].contiguous(), w, activation="silu")
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())
        ],
        dim=2,
    )
    err, leak = float((packed - alone).abs().max()), float((blind - alone).abs().max())
    print(f"causal_conv1d_fn: packed vs alone {err:.2e}, without seq_idx {leak:.2e}")
    if err > tol or leak <= tol:
        failures.append("causal_conv1d_fn")
    return failures


def model_checks(device: str, tol: float) -> list[str]:
    import transformers

    torch.manual_seed(0)
    cfg = model_config()
    model = transformers.Qwen3_5ForConditionalGeneration(cfg).to(device).float().eval()
    samples, batch = packed_batch()
    kw = {
        k: v.to(device) if isinstance(v, torch.Tensor) else v
        for k, v in model_kwargs(batch, cfg).items()
    }
    kw.pop("labels")
    with torch.no_grad():
        packed = model(**kw).logits[0]
        blind = model(
            **{
                k: v
                for k, v in kw.items()
                if k not in ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")
            }
        ).logits[0]
        worst = leak = 0.0
        for i, s in enumerate(samples):
            alone = model(input_ids=s["input_ids"][None].to(device), use_cache=False).logits[0]
            a = int(batch["cu_seqlens_padded"][i])
            worst = max(worst, float((packed[a : a + alone.shape[0]] - alone).abs().max()))
            leak = max(leak, float((blind[a : a + alone.shape[0]] - alone).abs().max()))
    print(
        f"Qwen3.5 (3 GDN + 1 full layer): packed vs alone {worst:.2e}; without cu_seq_lens_q / "
        f"seq_idx {leak:.2e}"
    )
    return [] if worst <= tol < leak else ["Qwen3.5 packed logits"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--dry-run", action="store_true", help="CPU only: build the batch and the model kwargs"
    )
    ap.add_argument(
        "--tol",
        type=float,
        default=2e-3,
        help="max |difference| of a correct packing [%(default)s]",
    )
    args = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    if args.dry_run:
        samples, batch = packed_batch()
        kw = model_kwargs(batch, model_config(), check=False)
        print(
            f"dry run, no CUDA used: {len(samples)} sequences, T={kw['input_ids'].shape[1]}, "
            f"seq_idx {tuple(kw['seq_idx'].shape)}, cu_seq_lens_q {kw['cu_seq_lens_q'].tolist()}"
        )
        return 0
    missing = [m for m in ("fla", "causal_conv1d") if importlib.util.find_spec(m) is None]
    if not torch.cuda.is_available() or missing:
        print(
            f"needs CUDA and {', '.join(missing) or 'the kernels'}: nothing measured "
            f"(cuda={torch.cuda.is_available()}, missing={missing})"
        )
        return 2
    failures = kernel_checks("cuda", args.tol) + model_checks("cuda", args.tol)
    print("all checks hold" if not failures else f"FAILED: {', '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
