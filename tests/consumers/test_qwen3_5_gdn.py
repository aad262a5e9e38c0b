"""A tiny Qwen3.5 with a Gated DeltaNet layer packs exactly in every ``to_hf_kwargs`` mode: the fast
kernels (``fla``'s chunked gated delta rule, ``causal_conv1d``) are stood in for by packages this
test writes, which run transformers' own pure-torch functions once per segment of ``cu_seqlens`` /
``seq_idx`` (what the kernels honour). Packed logits equal each sample alone in POSITIONS and MASK
modes; the same batch without ``cu_seq_lens_q`` (what those modes gave before) leaks state between
the packed samples. A fresh interpreter:
transformers picks its kernels when its Qwen3.5 module is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prealign.collate.hf import GDN_MIN_TRANSFORMERS
from tests.consumers.models import CORRUPT, TOL

transformers = pytest.importorskip("transformers")
VERSION = tuple(int(p) for p in transformers.__version__.split(".")[:2])

FLA = """
import inspect

import torch


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, cu_seqlens=None,
                           use_qk_l2norm_in_kernel=False):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    ref = inspect.unwrap(m.torch_chunk_gated_delta_rule)
    cu = [0, q.shape[1]] if cu_seqlens is None else [int(c) for c in cu_seqlens]
    parts = [ref(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[0]
             for a, b in zip(cu[:-1], cu[1:])]
    return torch.cat(parts, 1), None
"""
CONV = """
import inspect

import torch


def causal_conv1d_fn(x, weight, bias=None, activation=None, seq_idx=None):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    ref = inspect.unwrap(m.causal_conv1d_fn)
    ids = torch.zeros(x.shape[-1], dtype=torch.int64) if seq_idx is None else seq_idx[0].long()
    cut = [0, *(torch.nonzero(ids.diff()).flatten() + 1).tolist(), x.shape[-1]]
    parts = [ref(x[..., a:b], weight, bias, activation=activation)
             for a, b in zip(cut[:-1], cut[1:])]
    return torch.cat(parts, -1)
"""
SCRIPT = """
import json

import torch
import transformers

from prealign.collate import MRoPECollator, THDCollator, to_hf_kwargs
from prealign.schemas import PadPolicy, ParallelLayout, vlm_schema
from tests.vlm_families import TOK, tiny_config, vision_sample

cfg = tiny_config("qwen3_5")
cfg.text_config.layer_types = ["linear_attention", "full_attention"]
torch.manual_seed(0)
model = transformers.Qwen3_5ForConditionalGeneration(cfg).to(torch.float64).eval()
samples = [vision_sample("qwen3_5", [5, ("image", 2, 2), 3]),
           vision_sample("qwen3_5", [7, ("image", 2, 4), 9])]
g = torch.Generator().manual_seed(1)
for s in samples:
    s["pixel_values"] = torch.randn(s["pixel_values"].shape, generator=g)
layout = ParallelLayout(tp=2, pad_policy=PadPolicy.PER_SEQUENCE)
thd = THDCollator(schema=vlm_schema(vocab_size=TOK.vocab_size), layout=layout)
batch = MRoPECollator(collator=thd, model_config=cfg)(samples)


def logits(kw):
    kw = {k: v.to(torch.float64) if k == "pixel_values" else v for k, v in kw.items()}
    with torch.no_grad():
        return model(**kw).logits[0]


alone = [logits({"input_ids": s["input_ids"][None],
                 "mm_token_type_ids": s["mm_token_type_ids"][None],
                 "pixel_values": s["pixel_values"], "image_grid_thw": s["image_grid_thw"],
                 "use_cache": False})
         for s in samples]
out = {}
for mode in ("positions", "mask"):
    kw = to_hf_kwargs(batch, attention=mode, model_config=cfg, mask_dtype=torch.float64)
    varlen = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    blind = {k: v for k, v in kw.items() if k not in varlen}
    row = []
    for packed in (logits(kw), logits(blind)):
        cu, pad = batch["cu_seqlens"], batch["cu_seqlens_padded"]
        spans = [(int(pad[i]), int(pad[i]) + int(cu[i + 1] - cu[i])) for i in range(len(alone))]
        row.append(max(float((packed[a:b] - x).abs().max()) for (a, b), x in zip(spans, alone)))
    out[mode] = row
print(json.dumps(out))
"""


def gdn_reads_cu_seq_lens_q() -> bool:
    """Whether the installed Gated DeltaNet forward takes the chunked kernel's boundaries from
    ``cu_seq_lens_q`` in its keyword arguments (not from the attention mask)."""
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5

    return '"cu_seq_lens_q"' in inspect.getsource(modeling_qwen3_5.Qwen3_5GatedDeltaNet.forward)


def test_qwen3_5_gdn_reads_cu_seq_lens_q_whatever_the_attention_mode():
    """Why ``to_hf_kwargs`` sends ``cu_seq_lens_q`` in every mode from 5.10 on (and refuses packing
    below)."""
    assert gdn_reads_cu_seq_lens_q() == (VERSION >= GDN_MIN_TRANSFORMERS)


@pytest.mark.slow
def test_gdn_packs_exactly_in_positions_and_mask_modes(tmp_path):
    from transformers.integrations import hub_kernels

    if not hasattr(hub_kernels, "use_kernel_func_from_hub_with_fallback"):
        # transformers < 5.2x takes the kernels only from installed distributions (their metadata),
        # which a test cannot stand in for; to_hf_kwargs refuses the packed row below 5.10
        # (test_vlm_gdn) and sends cu_seq_lens_q in every mode above, which this version's GDN
        # forward reads (the test above)
        assert VERSION < GDN_MIN_TRANSFORMERS or gdn_reads_cu_seq_lens_q()
        return
    kernels = tmp_path / "kernels"
    (kernels / "fla" / "ops" / "gated_delta_rule").mkdir(parents=True)
    (kernels / "causal_conv1d").mkdir()
    for path, text in (
        ("fla/__init__.py", ""),
        ("fla/ops/__init__.py", ""),
        ("fla/ops/gated_delta_rule/__init__.py", FLA),
        ("causal_conv1d/__init__.py", CONV),
    ):
        (kernels / path).write_text(textwrap.dedent(text))
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(kernels), str(root), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for mode, (worst, leak) in result.items():
        assert worst < TOL and leak > CORRUPT, (mode, worst, leak)
