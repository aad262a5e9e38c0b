"""Typed errors keep their type across processes: pickled (returned from a DataLoader worker,
gathered across ranks) they keep their attributes; re-raised by torch from a worker's exception they
keep their type."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.utils.data import DataLoader

from prealign.collate import THDCollator
from prealign.loaders.errors import (
    BadSampleError,
    CorruptShardError,
    IndexFileError,
    MissingShardError,
    RemotePermissionError,
    RemoteReadError,
    RemoteStallError,
    ShmBudgetError,
)
from prealign.loaders.media.vlm import MediaError, MediaProblem
from prealign.schemas import ParallelLayout
from prealign.schemas.errors import BatchValidationError, SampleError
from prealign.schemas.schema import causal_lm_schema

ERRORS = [
    SampleError(sample=3, field="labels", expected="int64", actual="float32", hint="cast it"),
    BadSampleError(
        sample="s/0", field="jpg", expected="an image", actual="bytes", reason="corrupt_image"
    ),
    MediaError(
        MediaProblem.CORRUPT_IMAGE, sample="k", field="jpg", expected="an image", actual="junk"
    ),
    CorruptShardError("s-0.tar", 512, "truncated"),
    MissingShardError("s-1.tar", "no such file"),
    IndexFileError("index x.npz: no such file"),
    BatchValidationError(["a", "b"]),
    RemoteReadError("http://h/s-0.tar", "connection reset"),
    RemoteStallError("http://h/s-0.tar", "no byte for 30 s"),
    RemotePermissionError("http://h/s-0.tar", 403, "Forbidden"),
    ShmBudgetError("past the cap"),
]


@pytest.mark.parametrize("err", ERRORS, ids=lambda e: type(e).__name__)
def test_a_pickled_error_is_the_same_error(err):
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and back.args == err.args and str(back) == str(err)
    assert vars(back) == vars(err)


@pytest.mark.parametrize("err", ERRORS, ids=lambda e: type(e).__name__)
def test_an_error_rebuilt_from_its_message_alone_keeps_its_type(err):
    """What torch's ExceptionWrapper.reraise does with a worker's exception:
    ``type(exc)(message)``."""
    back = type(err)(str(err))
    assert type(back) is type(err) and str(err) in str(back)
    for name in vars(
        err
    ):  # every attribute a handler may read exists (None when the message is all there is)
        assert hasattr(back, name), name


@pytest.mark.slow
def test_a_plain_dataloader_with_workers_raises_the_collators_sample_error_as_itself():
    schema = causal_lm_schema(pad_token_id=0)
    samples = [
        {"input_ids": torch.tensor([1, 2, 3])},
        {"input_ids": torch.tensor([[1, 2]])},
    ]  # a 2-D sample
    loader = DataLoader(
        samples,
        batch_size=2,
        num_workers=1,
        collate_fn=THDCollator(schema=schema, layout=ParallelLayout(), cp_rank=None),
    )
    with pytest.raises(SampleError) as caught:
        next(iter(loader))
    assert "input_ids" in str(caught.value) and "sample 1" in str(caught.value)
