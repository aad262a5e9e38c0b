"""Teacher top-k distillation tensors of one sample: decode, convert and validate.

A sample may carry ``teacher_topk_log_probs`` ``[L, K]`` (float32 or bf16; finite, <= 0) and
``teacher_topk_ids`` ``[L, K]`` (int64 in ``[0, vocab_size)``), aligned with its ``L`` tokens. They
arrive as webdataset ``.npy`` members (bytes, read with ``allow_pickle=False``: untrusted data is
never unpickled), as arrays / nested lists (an HF dataset column) or as tensors.

Checking each sample here, before batching, lets a loader skip exactly the bad sample; the
collator checks the same bounds again on the whole batch (``schemas.topk_fields``).
"""

from __future__ import annotations

import io

import numpy as np
import torch

from prealign.loaders.errors import BadSampleError

LOG_PROBS, IDS = "teacher_topk_log_probs", "teacher_topk_ids"
_NPY_SUFFIXES = (".npy",)


def read_member(raw: dict, name: str):
    """``raw[name]`` or ``raw[name + ".npy"]``, or None when neither is there."""
    for key in (name, *(name + s for s in _NPY_SUFFIXES)):
        if key in raw:
            return raw[key]
    return None


def to_tensor(value, *, sample, field: str) -> torch.Tensor:
    """``.npy`` bytes, array, nested list or tensor -> tensor (never unpickles)."""
    if isinstance(value, torch.Tensor):
        return value
    try:
        if isinstance(value, (bytes, bytearray, memoryview)):
            value = np.load(io.BytesIO(bytes(value)), allow_pickle=False)
        arr = np.asarray(value)
        if arr.dtype == object:
            raise ValueError("ragged rows or objects")
        return torch.from_numpy(np.ascontiguousarray(arr))
    except (ValueError, TypeError, OSError, EOFError) as exc:
        raise BadSampleError(
            sample=sample,
            field=field,
            expected="an .npy array or a nested list of numbers, rows of "
            "one length (K must be constant)",
            actual=f"{type(value).__name__}: {exc}",
        ) from None


def teacher_topk(
    raw: dict,
    *,
    sample,
    length: int,
    topk: int | None,
    vocab_size: int,
    log_prob_dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Validated ``{LOG_PROBS: [L, K] log_prob_dtype, IDS: [L, K] int64}`` from a raw sample.

    ``topk`` None accepts any K (still one K for both tensors). Raises
    :class:`~prealign.loaders.errors.BadSampleError` (a ``SampleError``) naming ``sample``, the
    field, what was expected and what came.
    """
    values = {}
    for name in (LOG_PROBS, IDS):
        v = read_member(raw, name)
        if v is None:
            raise BadSampleError(
                sample=sample,
                field=name,
                expected=f"a member {name}.npy or a column {name}",
                actual=f"fields {sorted(k for k in raw if not k.startswith('__'))}",
            )
        values[name] = to_tensor(v, sample=sample, field=name)
    lp, ids = values[LOG_PROBS], values[IDS]
    k = topk if topk is not None else (lp.shape[-1] if lp.ndim == 2 else -1)
    for name, t in values.items():
        if t.ndim != 2 or t.shape[0] != length or t.shape[1] != k:
            raise BadSampleError(
                sample=sample,
                field=name,
                expected=f"shape [L={length}, K={k}]",
                actual=f"shape {list(t.shape)}",
                hint="one row per token, constant K",
            )
    if not (
        lp.is_floating_point()
        and lp.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    ):
        raise BadSampleError(
            sample=sample, field=LOG_PROBS, expected="float log-probs", actual=str(lp.dtype)
        )
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise BadSampleError(
            sample=sample, field=IDS, expected="integer ids", actual=str(ids.dtype)
        )
    bad_lp = ~torch.isfinite(lp) | (lp > 0)
    if bool(bad_lp.any()):
        row, col = (int(i) for i in torch.nonzero(bad_lp)[0])
        raise BadSampleError(
            sample=sample,
            field=LOG_PROBS,
            expected="finite log-probs <= 0",
            actual=f"{lp[row, col].item()} at token {row}, rank {col}",
        )
    bad_id = (ids < 0) | (ids >= vocab_size)
    if bool(bad_id.any()):
        row, col = (int(i) for i in torch.nonzero(bad_id)[0])
        raise BadSampleError(
            sample=sample,
            field=IDS,
            expected=f"ids in [0, {vocab_size})",
            actual=f"{int(ids[row, col])} at token {row}, rank {col}",
        )
    return {LOG_PROBS: lp.to(log_prob_dtype), IDS: ids.to(torch.int64)}


def with_teacher_topk(out: dict, raw: dict, transform) -> dict:
    """``out`` (a transform's sample dict: ``__key__``, ``input_ids`` ``[L]``) with the teacher
    top-k fields of ``raw`` added when ``transform.topk`` is set (checked against
    ``transform.tokenizer.vocab_size``, log-probs cast to ``transform.log_prob_dtype``)."""
    if transform.topk is not None:
        out.update(
            teacher_topk(
                raw,
                sample=out["__key__"],
                length=out["input_ids"].numel(),
                topk=transform.topk,
                vocab_size=transform.tokenizer.vocab_size,
                log_prob_dtype=getattr(torch, transform.log_prob_dtype),
            )
        )
    return out


def encode_npy(array: np.ndarray) -> bytes:
    """An array -> ``.npy`` bytes (for writing webdataset members)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()
