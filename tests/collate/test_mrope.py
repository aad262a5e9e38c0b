"""mRoPE position ids: equal to transformers' own Qwen2-VL ``get_rope_index`` (a tiny randomly
initialised model built from a config), per sample, packed, CP-sharded and unsharded again."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prealign.collate import BSHDCollator, THDCollator, unpack_bshd, unpack_thd, unshard_cp
from prealign.collate.mrope import MRoPECollator, mrope_position_ids
from prealign.schemas import ParallelLayout, SampleError, validate_batch, vlm_schema
from tests.conftest import examples

IMG, START, END, MERGE = 6, 4, 5, 2
SCHEMA = vlm_schema()


@functools.lru_cache(maxsize=1)
def hf_model():
    """A 30k-parameter Qwen2-VL with random weights: only its ``get_rope_index`` is used."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2VLConfig(
        text_config=dict(
            vocab_size=264,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            bos_token_id=1,
            eos_token_id=1,
            rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
        ),
        vision_config=dict(
            depth=1,
            embed_dim=16,
            hidden_size=16,
            num_heads=2,
            mlp_ratio=1,
            spatial_merge_size=MERGE,
            patch_size=14,
        ),
        image_token_id=IMG,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )
    return transformers.Qwen2VLModel(cfg).eval()


def hf_positions(samples: list[dict]) -> list[torch.Tensor]:
    """transformers' positions for a right-padded batch, cut back to each sample's ``[3, L]``."""
    lengths = [s["input_ids"].numel() for s in samples]
    width = max(lengths)
    ids = torch.zeros(len(samples), width, dtype=torch.int64)
    types = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(samples):
        ids[i, : lengths[i]] = s["input_ids"]
        types[i, : lengths[i]] = s["mm_token_type_ids"]
        mask[i, : lengths[i]] = 1
    grid = torch.cat([s["image_grid_thw"] for s in samples])
    with torch.no_grad():
        pos, _ = hf_model().get_rope_index(
            ids, types, image_grid_thw=grid if grid.numel() else None, attention_mask=mask
        )
    return [pos[:, i, :n] for i, n in enumerate(lengths)]


def vlm_sample(segments: list, *, text_id: int = 9) -> dict:
    """``segments``: ints (runs of text tokens) and (t, h, w) grids (one image each, wrapped in
    vision start/end tokens)."""
    ids, grids = [], []
    for seg in segments:
        if isinstance(seg, int):
            ids += [text_id + (k % 200) for k in range(seg)]
        else:
            t, h, w = seg
            ids += [START, *[IMG] * (t * h * w // MERGE**2), END]
            grids.append(list(seg))
    ids_t = torch.tensor(ids, dtype=torch.int64)
    n_patches = sum(t * h * w for t, h, w in grids)
    return {
        "input_ids": ids_t,
        "mm_token_type_ids": (ids_t == IMG).to(torch.int64),
        "image_grid_thw": torch.tensor(grids, dtype=torch.int64).reshape(-1, 3),
        "pixel_values": torch.zeros(n_patches, 1176),
    }


grid_st = st.tuples(
    st.integers(1, 2),
    st.integers(1, 6).map(lambda v: 2 * v),
    st.integers(1, 6).map(lambda v: 2 * v),
)
segments_st = st.lists(st.one_of(st.integers(0, 12), grid_st), min_size=1, max_size=5).filter(
    lambda segs: any(not isinstance(s, int) or s > 0 for s in segs)
)
batch_st = st.lists(segments_st, min_size=1, max_size=4)


def test_golden_trace():
    """The module docstring's trace: text, one image (1, 4, 6), text."""
    s = vlm_sample([1, (1, 4, 6), 1])
    got = mrope_position_ids(s["mm_token_type_ids"], s["image_grid_thw"], torch.tensor([0, 10]))
    assert got.tolist() == [
        [0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
        [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
        [0, 1, 2, 3, 4, 2, 3, 4, 5, 6],
    ]
    assert torch.equal(got, hf_positions([s])[0])


@given(batch_st)
@examples(60)  # 60 here, a quarter under PREALIGN_EXAMPLES_SCALE=0.25 (verl, floor)
def test_flat_batch_equals_transformers(batches):
    """One vectorised call over the concatenated batch == transformers row by row (text-only rows,
    several images per row, t=2 grids, rows starting or ending on an image)."""
    samples = [vlm_sample(segs) for segs in batches]
    lengths = torch.tensor([s["input_ids"].numel() for s in samples])
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0))
    got = mrope_position_ids(
        torch.cat([s["mm_token_type_ids"] for s in samples]),
        torch.cat([s["image_grid_thw"] for s in samples]),
        cu,
        spatial_merge_size=MERGE,
    )
    assert got.dtype == torch.int64 and got.shape == (3, int(lengths.sum()))
    for want, part in zip(hf_positions(samples), torch.split(got, lengths.tolist(), dim=1)):
        assert torch.equal(part, want)


@given(batch_st, st.sampled_from([(1, 1), (2, 1), (2, 2), (1, 4)]))
@examples(60)
def test_thd_shards_unshard_to_transformers(batches, tp_cp):
    """Through THDCollator on every CP rank: [3, 1, T_local], SP-aligned, 0 on pads; all-gathering
    the shards and unpacking gives transformers' positions for every sample."""
    tp, cp = tp_cp
    samples = [vlm_sample(segs) for segs in batches]
    layout = ParallelLayout(tp=tp, cp=cp)
    shards = [
        MRoPECollator(collator=THDCollator(schema=SCHEMA, layout=layout, cp_rank=r))(samples)
        for r in range(cp)
    ]
    for b in shards:
        validate_batch(b, SCHEMA, layout)
        pos = b["mrope_position_ids"]
        assert pos.shape == (3, 1, b["input_ids"].shape[1]) and pos.shape[-1] % tp == 0
        assert bool((pos[:, b["padding_mask"]] == 0).all())
    whole = unshard_cp(
        [b["mrope_position_ids"] for b in shards],
        cu_seqlens_padded=shards[0]["cu_seqlens_padded"],
        dim=2,
    )
    per_sample = unpack_thd(
        whole,
        cu_seqlens=shards[0]["cu_seqlens"],
        cu_seqlens_padded=shards[0]["cu_seqlens_padded"],
        dim=2,
    )
    for got, want in zip(per_sample, hf_positions(samples)):
        assert torch.equal(got, want)


def test_bshd_matches_transformers_padded_batch():
    """BSHD [3, B, S]: exactly transformers' right-padded output (pads 0 there too), widened to
    S."""
    samples = [
        vlm_sample([3, (1, 4, 4), 2]),
        vlm_sample([5]),
        vlm_sample([(2, 2, 4), 1, (1, 2, 2)]),
    ]
    b = MRoPECollator(collator=BSHDCollator(schema=SCHEMA, layout=ParallelLayout(tp=2)))(samples)
    validate_batch(b, SCHEMA, ParallelLayout(tp=2))
    pos = b["mrope_position_ids"]
    assert pos.shape[:2] == (3, 3)
    for i, (got, want) in enumerate(
        zip(unpack_bshd(pos, cu_seqlens=b["cu_seqlens"], dim=2), hf_positions(samples))
    ):
        assert torch.equal(got, want)
        assert bool((pos[:, i, want.shape[1] :] == 0).all())


def test_deferred_cp_shard_gathers_the_same_rows():
    """VLM path: the whole aligned batch plus cp_gather_index; one index_select == the sharded
    batch."""
    samples = [vlm_sample([7, (1, 4, 6), 3]), vlm_sample([(1, 6, 2), 11])]
    layout = ParallelLayout(tp=2, cp=2)
    for r in range(2):
        whole = MRoPECollator(
            collator=THDCollator(schema=SCHEMA, layout=layout, cp_rank=r, defer_cp_shard=True)
        )(samples)
        shard = MRoPECollator(collator=THDCollator(schema=SCHEMA, layout=layout, cp_rank=r))(
            samples
        )
        idx = whole["cp_gather_index"]
        assert idx.numel() % layout.tp == 0
        for name in ("mrope_position_ids", "input_ids", "mm_token_type_ids"):
            dim = SCHEMA[name].token_dim + 1
            assert torch.equal(whole[name].index_select(dim, idx), shard[name]), name


# ---- errors
# ------------------------------------------------------------------------------------------
def test_run_length_mismatch_names_the_sample():
    good, bad = vlm_sample([3, (1, 4, 4)]), vlm_sample([2, (1, 4, 4), 2])
    bad = {**bad, "image_grid_thw": torch.tensor([[1, 4, 6]])}  # grid says 6 tokens, the text has 4
    with pytest.raises(SampleError) as err:
        MRoPECollator(collator=THDCollator(schema=SCHEMA, layout=ParallelLayout()))([good, bad])
    assert (
        err.value.sample == 1
        and "6 image tokens" in str(err.value)
        and "4 image tokens" in str(err.value)
    )


def test_run_count_mismatch_names_the_sample():
    two = vlm_sample([(1, 2, 2), 1, (1, 2, 2)])
    one_grid = {**two, "image_grid_thw": two["image_grid_thw"][:1]}
    with pytest.raises(SampleError) as err:
        MRoPECollator(collator=THDCollator(schema=SCHEMA, layout=ParallelLayout()))(
            [vlm_sample([4]), one_grid]
        )
    assert err.value.sample == 1 and "2 runs" in str(err.value)


def test_unmatched_video_tokens_and_odd_grids_are_refused():
    with pytest.raises(
        SampleError, match="0 runs of image tokens and 1 runs of video tokens"
    ):  # no video grid
        mrope_position_ids(
            torch.tensor([0, 2, 2]), torch.zeros(0, 3, dtype=torch.int64), torch.tensor([0, 3])
        )
    with pytest.raises(SampleError, match="0 .text., 1 .image. or 2 .video."):
        mrope_position_ids(
            torch.tensor([0, 3, 3]), torch.zeros(0, 3, dtype=torch.int64), torch.tensor([0, 3])
        )
    with pytest.raises(SampleError, match="multiples of spatial_merge_size"):
        mrope_position_ids(torch.tensor([0, 1, 1]), torch.tensor([[1, 3, 4]]), torch.tensor([0, 3]))


def test_precomputed_positions_pass_through_and_partial_ones_are_refused():
    a, b = vlm_sample([2, (1, 2, 2), 1]), vlm_sample([4])
    own = torch.arange(3 * 6).reshape(3, 6)
    coll = MRoPECollator(collator=THDCollator(schema=SCHEMA, layout=ParallelLayout()))
    out = coll([{**a, "mrope_position_ids": own}])
    assert torch.equal(out["mrope_position_ids"][:, 0], own)
    with pytest.raises(SampleError, match="present in every sample or in none"):
        coll([{**a, "mrope_position_ids": own}, b])
    assert "mrope_position_ids" not in a  # inputs never mutated


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("precomputed", [False, True])
def test_non_finite_pixels_are_refused_naming_the_sample(bad, precomputed):
    coll = MRoPECollator(
        collator=THDCollator(schema=SCHEMA, layout=ParallelLayout(tp=2, cp=2), cp_rank=0)
    )
    samples = [vlm_sample([3, (1, 2, 4), 2]), vlm_sample([(1, 4, 4), 5])]
    if precomputed:
        samples = [
            {**s, "mrope_position_ids": torch.zeros(3, s["input_ids"].numel(), dtype=torch.int64)}
            for s in samples
        ]
    coll(samples)
    samples[1]["pixel_values"][5, 7] = bad
    with pytest.raises(SampleError) as err:
        coll(samples)
    assert err.value.sample == 1 and err.value.field == "pixel_values"


@given(grid=grid_st, delta=st.sampled_from([-4, -1, 1, 4]))
def test_pixel_rows_other_than_the_grids_patches_are_refused(grid, delta):
    """An edited image_grid_thw whose token run still fits (t*h*w / merge**2 image tokens) but whose
    patches are not the pixels' rows: refused, never collated with the other positions."""
    sample = vlm_sample([2, grid, 1])
    rows = sample["pixel_values"].shape[0]
    if rows + delta <= 0:
        return
    sample["pixel_values"] = torch.zeros(rows + delta, 1176)
    with pytest.raises(SampleError) as err:
        MRoPECollator(collator=THDCollator(schema=SCHEMA, layout=ParallelLayout()))(
            [vlm_sample([4]), sample]
        )
    assert err.value.sample == 1 and f"{rows} rows" in err.value.expected
