"""Worker -> main process transport of a batch as ONE shared-memory buffer.

A DataLoader worker hands each tensor to the main process through its own shared-memory segment,
which costs a few hundred microseconds per tensor; a packed THD batch has ~10 of them. Packing them
into one ``uint8`` buffer (offsets aligned to 16 bytes) costs one copy of the batch and makes the
hand-over one segment. The main process rebuilds the fields as views of that buffer.

>>> b = {"ids": torch.arange(5), "rank": 1, "mask": torch.tensor([True, False])}
>>> out = unpack_batch(pack_batch(b))
>>> list(out), out["ids"].tolist(), out["mask"].tolist(), out["rank"]
(['ids', 'rank', 'mask'], [0, 1, 2, 3, 4], [True, False], 1)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import get_worker_info

from prealign.loaders.handoff import slots

_ALIGN = 16
SMALL = 64 * 1024
"""Fields of fewer bytes (``cu_seqlens``, ``sample_index``, ...) are copied out of a received
buffer: a kept one then pins no shared slot (:func:`own_small`). Token-sized fields (``input_ids``,
pixels) stay views."""


@dataclass(frozen=True)
class PackedBatch:
    """``buffer`` uint8 ``[nbytes]``; ``fields`` ``(name, dtype, shape, offset)`` per tensor;
    ``other`` the non-tensor entries as they were; ``order`` the batch's keys in their order."""

    buffer: torch.Tensor
    fields: tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...]
    other: dict
    order: tuple = ()

    def pin_memory(self, device=None) -> "PackedBatch":  # called by DataLoader's pin-memory thread
        return PackedBatch(self.buffer.pin_memory(), self.fields, self.other, self.order)


def pack_batch(batch: dict, *, shared: bool | None = None) -> "PackedBatch | slots.SlotRef":
    """Every tensor value of ``batch`` copied into one buffer; other values kept aside. ``shared``
    (default: inside a DataLoader worker): the buffer is a recycled shared slot of this process
    (:mod:`prealign.loaders.handoff.slots`) and the result a
    :class:`~prealign.loaders.handoff.slots.SlotRef` that arrives in the receiving process (once
    pickled) as the :class:`PackedBatch`: no fresh shared memory per batch,
    no second copy. A slot that cannot be had (no memfd, a full file system) falls back to plain
    memory."""
    tensors = [(k, v.contiguous()) for k, v in batch.items() if isinstance(v, torch.Tensor)]
    fields, offset = [], 0
    for k, t in tensors:
        fields.append((k, t.dtype, tuple(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    other = {k: v for k, v in batch.items() if not isinstance(v, torch.Tensor)}
    if shared is None:
        shared = get_worker_info() is not None
    if shared and slots.available():
        try:
            slot = slots.pool().take(offset)
            slot.write(
                [
                    (off, _bytes_of(t))
                    for (_, t), (_, _, _, off) in zip(tensors, fields)
                    if t.numel()
                ]
            )
            slot.hold([0])
        except OSError:
            pass
        else:
            return slots.send(slot, offset, 0, _AsPacked(tuple(fields), other, tuple(batch)))
    buffer = torch.empty(offset, dtype=torch.uint8)
    for (_, t), (_, _, _, off) in zip(tensors, fields):
        n = t.numel() * t.element_size()
        if n:
            buffer[off : off + n] = t.reshape(-1).view(torch.uint8)
    return PackedBatch(buffer, tuple(fields), other, tuple(batch))


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """The bytes of contiguous CPU tensor ``t`` as a uint8 array (no copy)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


@dataclass(frozen=True)
class _AsPacked:
    """Rebuilds the :class:`PackedBatch` around a received slot's buffer."""

    fields: tuple
    other: dict
    order: tuple

    def __call__(self, buffer: torch.Tensor) -> PackedBatch:
        return PackedBatch(buffer, self.fields, self.other, self.order)


def own_small(batch: dict) -> dict:
    """``batch`` with each tensor of fewer than :data:`SMALL` bytes replaced by a copy of its own,
    so that keeping it (a training loop keeping ``cu_seqlens``) does not keep the buffer it views
    mapped."""
    return {
        k: v.clone() if isinstance(v, torch.Tensor) and v.numel() * v.element_size() < SMALL else v
        for k, v in batch.items()
    }


def unpack_batch(packed: PackedBatch) -> dict:
    """The batch of :func:`pack_batch`, tensors as views of the one buffer (keys in their order),
    but small ones copied out (:func:`own_small`)."""
    out = {}
    for name, dtype, shape, off in packed.fields:
        n = 1
        for d in shape:
            n *= d
        nbytes = n * torch.empty(0, dtype=dtype).element_size()
        out[name] = (
            packed.buffer[off : off + nbytes].view(dtype).view(shape)
            if nbytes
            else torch.empty(shape, dtype=dtype)
        )
    out = own_small(out)
    out.update(packed.other)
    return (
        {k: out[k] for k in packed.order}
        if len(packed.order) == len(out) and set(packed.order) == out.keys()
        else out
    )
