"""Edge cases: labels present in only some samples, mixed allowed dtypes, narrowed nested tensors,
the CP layout travelling with the batch, fields that skip CP sharding, an uninitialised Megatron."""

import pytest
import torch

from prealign.collate import BSHDCollator, THDCollator, to_packed_seq_params, unshard_cp
from prealign.schemas import (
    ArgumentError,
    ConfigError,
    FieldSpec,
    ParallelLayout,
    SampleError,
    SchemaError,
    causal_lm_schema,
    topk_fields,
    validate_batch,
)

SCHEMA = causal_lm_schema()


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_labels_of_a_later_sample_are_never_ignored(order):
    plain = {"input_ids": torch.arange(1, 5)}
    with_labels = {"input_ids": torch.arange(5, 9), "labels": torch.tensor([-100, -100, 7, 8])}
    batch = [(plain, with_labels)[i] for i in order]
    with pytest.raises(SampleError) as err:
        THDCollator(schema=SCHEMA, layout=ParallelLayout())(batch)
    assert (err.value.sample, err.value.field) == (order.index(0), "labels")


def test_allowed_but_mixed_dtypes_are_refused_naming_the_sample():
    schema = causal_lm_schema(topk=2)
    samples = [
        {
            "input_ids": torch.arange(3),
            "teacher_topk_log_probs": -torch.rand(3, 2).to(dt),
            "teacher_topk_ids": torch.zeros(3, 2, dtype=torch.long),
        }
        for dt in (torch.float32, torch.bfloat16)
    ]
    with pytest.raises(SampleError) as err:
        THDCollator(schema=schema, layout=ParallelLayout())(samples)
    assert (err.value.sample, err.value.field) == (1, "teacher_topk_log_probs")
    for dt in (torch.float32, torch.bfloat16):  # one dtype per batch: kept as it came
        same = [dict(s, teacher_topk_log_probs=s["teacher_topk_log_probs"].to(dt)) for s in samples]
        assert (
            THDCollator(schema=schema, layout=ParallelLayout())(same)[
                "teacher_topk_log_probs"
            ].dtype
            == dt
        )


def test_a_narrowed_nested_tensor_is_refused_and_its_contiguous_copy_collates():
    dense = torch.arange(200).reshape(2, 100)
    nt = torch.nested.narrow(
        dense, 1, torch.tensor([3, 50]), torch.tensor([4, 2]), layout=torch.jagged
    )
    coll = THDCollator(schema=SCHEMA, layout=ParallelLayout())
    with pytest.raises(SampleError, match="contiguous jagged") as err:
        coll({"input_ids": nt})
    assert err.value.field == "input_ids"
    assert coll({"input_ids": nt.contiguous()})["input_ids"].tolist() == [[3, 4, 5, 6, 150, 151]]


def test_the_batch_carries_its_cp_layout_to_the_inverse_and_packed_seq_params():
    layout = ParallelLayout(cp=2, cp_layout="contiguous")
    samples = [{"input_ids": torch.arange(1, 6)}, {"input_ids": torch.arange(6, 9)}]
    shards = [THDCollator(schema=SCHEMA, layout=layout, cp_rank=r)(samples) for r in range(2)]
    assert {s["cp_layout"] for s in shards} == {"contiguous"}
    ids, cu = [s["input_ids"] for s in shards], shards[0]["cu_seqlens_padded"]
    with pytest.raises(
        ArgumentError, match="not cut zigzag"
    ):  # defaulting to zigzag would scramble them
        unshard_cp(ids, cu_seqlens_padded=cu)
    assert unshard_cp(ids, cu_seqlens_padded=cu, cp_layout=shards[0]["cp_layout"]).tolist() == [
        list(range(1, 9))
    ]
    import dataclasses

    from megatron.core.packed_seq_params import PackedSeqParams

    if "cp_partition_mode" not in {f.name for f in dataclasses.fields(PackedSeqParams)}:
        with pytest.raises(ArgumentError, match="contiguous"):  # never silently treated as zigzag
            to_packed_seq_params(shards[0])
    else:
        assert to_packed_seq_params(shards[0]).cp_partition_mode == "contiguous"


@pytest.mark.parametrize("collator", [THDCollator, BSHDCollator])
def test_a_field_that_skips_cp_sharding_holds_the_whole_batch_and_validates(collator):
    schema = SCHEMA.with_fields(
        FieldSpec(name="ref_log_probs", dtypes=("float32",), cp_sharded=False)
    )
    layout = ParallelLayout(tp=2, cp=2)
    samples = [
        {"input_ids": torch.arange(1, n + 1), "ref_log_probs": -torch.rand(n)} for n in (5, 3)
    ]
    whole = collator(schema=schema, layout=layout)(samples)
    for rank in range(2):
        b = collator(schema=schema, layout=layout, cp_rank=rank)(samples)
        assert torch.equal(b["ref_log_probs"], whole["ref_log_probs"])
        assert b["input_ids"].numel() * 2 == whole["input_ids"].numel()
        assert validate_batch(b, schema, layout) == []


def test_only_sample_fields_can_skip_cp_sharding():
    with pytest.raises(SchemaError, match="cp_sharded"):
        FieldSpec(name="labels2", source="next_token", sample_keys=("input_ids",), cp_sharded=False)
    assert all(f.cp_sharded for f in topk_fields())


def test_from_megatron_without_parallel_state_says_what_to_do():
    with pytest.raises(ConfigError, match="initialize_model_parallel"):
        ParallelLayout.from_megatron()


def test_media_and_sequence_fields_keep_their_declared_dims():
    schema = SCHEMA.with_fields(
        FieldSpec(name="pixels", role="media", dtypes=("float32",), dense_shape=("P",)),
        FieldSpec(name="reward", role="sequence", dtypes=("float32",), dense_shape=(2,)),
    )
    ok = [
        {"input_ids": torch.arange(1, 4), "pixels": torch.rand(n, 4), "reward": torch.rand(2)}
        for n in (0, 3)
    ]
    out = THDCollator(schema=schema, layout=ParallelLayout())(ok)
    assert out["pixels"].shape == (3, 4) and out["reward"].shape == (2, 2)
    for field, bad in (("pixels", torch.rand(2, 6)), ("reward", torch.rand(3))):
        with pytest.raises(SampleError) as err:
            THDCollator(schema=schema, layout=ParallelLayout())(
                [ok[0], dict(ok[1], **{field: bad})]
            )
        assert (err.value.sample, err.value.field) == (1, field)
