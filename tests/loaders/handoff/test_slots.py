"""Recycled shared-memory slots (loaders/handoff/slots.py): the worker -> main hand-off of packed
batches."""

from __future__ import annotations

import gc
import json
import os
import pickle
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.data import DataLoader

from prealign.loaders.handoff import slots
from prealign.loaders.handoff.transport import PackedBatch, pack_batch, unpack_batch

pytestmark = pytest.mark.skipif(
    not slots.available(), reason="platform: slots need memfd_create (Linux)"
)


def _batch(items):
    i = items[0]
    return pack_batch(
        {
            "x": torch.full((300, 257), float(i)),
            "i": torch.tensor([i, -i]),
            "e": torch.zeros(0, 2),
            "n": i,
        }
    )


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _settled_fds(at_most: int) -> int:
    """Open fds once the DataLoader's exiting workers let go of their pipes (torch closes them as
    they shut down, asynchronously): polled up to 2 s for at most ``at_most``."""
    deadline = time.monotonic() + 2.0
    while (n := _open_fds()) > at_most and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


def _slot_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum("prealign-slot" in line for line in f)


@pytest.mark.slow
def test_held_batches_are_never_overwritten_and_hold_no_file_descriptor():
    """20 batches from 2 workers, all kept (more than a pool holds): each still has its own values
    at the end and costs a mapping, not an open file (a list of batches never runs out of fds); once
    dropped, nothing is left mapped."""
    before = _open_fds()
    kept = []
    for b in DataLoader(range(20), batch_size=1, num_workers=2, collate_fn=_batch):
        assert isinstance(b, PackedBatch)
        kept.append(unpack_batch(b))
    assert [d["n"] for d in kept] == list(range(20))
    for d in kept:
        n = d["n"]
        assert bool((d["x"] == n).all()) and d["i"].tolist() == [n, -n] and d["e"].shape == (0, 2)
    assert _settled_fds(before + 1) <= before + 1 and _slot_mappings() >= 20
    del kept, b, d
    gc.collect()
    assert _open_fds() <= before + 1 and _slot_mappings() == 0


def _same(buf):
    return buf


def _ref(slot, n):
    """The slot as a main process receives it (pickled and unpickled: a duplicated fd, a private
    map)."""
    return pickle.loads(pickle.dumps(slots.send(slot, n, 0, _same)))


def test_a_slot_is_reused_only_after_its_holder_lets_go():
    pool = slots.SlotPool(cap=4)
    first = pool.take(100)
    first.write([bytes([7]) * 100])
    first.hold([0])
    got = _ref(first, 100)
    assert pool.take(100) is not first  # held: a new slot
    view = got[10:20]  # a view keeps the mapping (and the hold) alive
    del got
    gc.collect()
    assert not first.free()
    assert view.tolist() == [7] * 10
    del view
    gc.collect()
    assert (
        first.free() and pool.take(50) is first
    )  # released: the same slot (the largest free) again
    pool.close()


def test_the_receivers_writes_never_reach_the_slot():
    """Mapped copy-on-write: a training loop writing into its batch changes nothing a peer or the
    next batch sees."""
    pool = slots.SlotPool()
    slot = pool.take(64)
    slot.write([bytes([1]) * 64])
    slot.hold([0])
    got = _ref(slot, 64)
    got.fill_(9)
    assert os.pread(slot.fd, 64, slots.HEADER) == bytes([1]) * 64
    pool.close()


def test_a_full_pool_drops_a_held_slot_which_lives_on_in_its_holder():
    pool = slots.SlotPool(cap=2, files=2)
    held = []
    for v in range(5):
        s = pool.take(4096)
        s.write([bytes([v]) * 4096])
        s.hold([0])
        held.append(_ref(s, 4096))
    assert len(pool.slots) == 2
    assert [int(h[0]) for h in held] == [0, 1, 2, 3, 4] and all(
        bool((h == h[0]).all()) for h in held
    )
    pool.close()


def test_a_slot_grows_to_the_batch():
    pool = slots.SlotPool()
    s = pool.take(10)
    s.write([bytes([3]) * 10])
    s.hold([0])
    got = _ref(s, 10)
    del got
    gc.collect()
    big = pool.take(3 * 1024 * 1024)
    assert big is s and big.capacity >= 3 * 1024 * 1024
    assert os.fstat(big.fd).st_blocks * 512 >= 3 * 1024 * 1024  # allocated up front, not sparse
    assert big.write([(3 * 1024 * 1024 - 1, b"\5")]) == 3 * 1024 * 1024
    pool.close()


def test_in_the_main_process_pack_batch_stays_a_plain_buffer():
    packed = pack_batch({"x": torch.arange(3), "e": torch.zeros(0, 2), "n": 1})
    out = unpack_batch(packed)
    assert isinstance(packed, PackedBatch) and not packed.buffer.is_shared()
    assert out["x"].tolist() == [0, 1, 2] and out["e"].shape == (0, 2) and out["n"] == 1


# ---- published slots (BatchShare)
# -----------------------------------------------------------------------
def _named_pool(directory):
    os.makedirs(directory, mode=0o700, exist_ok=True)
    return slots.SlotPool(slots.named_in(str(directory)))


def _publish(folder, pool, key, values):
    from prealign.loaders.handoff.share_folder import encode_record

    parts = encode_record({"x": torch.tensor(values)})
    nbytes = sum(memoryview(p).nbytes for p in parts)
    slot = pool.take(nbytes)
    assert slot.write(parts) == nbytes
    slot.hold(range(folder.cp_size))
    slot.set_key(key)
    assert folder.publish_slot(key, slot)
    return slot, nbytes


def test_a_published_slot_is_read_by_fd_and_reused_only_after_every_rank_let_go(tmp_path):
    from prealign.loaders.handoff.share_folder import HIT, SharedFolder, decode_record

    d = str(tmp_path / "f")
    claimer, reader = SharedFolder(d, 0, 2), SharedFolder(d, 1, 2)
    assert claimer.acquire("k1")[0] == "claimed"
    pool = _named_pool(d)
    slot, nbytes = _publish(claimer, pool, "k1", [1, 2, 3])
    state, (fd, size) = reader.acquire("k1", by_fd=True)
    assert state == HIT and size >= nbytes  # the whole slot file (its capacity, page-rounded)
    got = pickle.loads(pickle.dumps(slots.send(fd, size, 1, _same)))
    os.close(fd)
    assert decode_record(got.numpy())["x"].tolist() == [1, 2, 3]
    assert not os.path.exists(os.path.join(d, "k1.bin"))  # both ranks have it: the name is gone
    mine = _ref(slot, nbytes)  # the claimer's own main process (holder 0)
    del mine
    gc.collect()
    assert not slot.free()  # rank 1 still maps it
    del got
    gc.collect()
    assert slot.free() and pool.take(10) is slot and slots.key_of(slot.fd) == ""
    pool.close()
    assert os.listdir(d) == []  # a closed pool removes its named slots


def test_a_slot_a_late_reader_took_hold_of_is_given_up_not_overwritten(tmp_path, monkeypatch):
    """A reader that opened the old name sets its flag before reading the key: if it did so while
    the pool was taking the slot for reuse, the pool leaves that slot to the reader and makes a new
    one."""
    from prealign.loaders.handoff.share_folder import SharedFolder

    d = str(tmp_path / "f")
    folder = SharedFolder(d, 0, 1)
    folder.acquire("old")
    pool = _named_pool(d)
    slot, nbytes = _publish(folder, pool, "old", [5, 6])
    os.pwrite(slot.fd, bytes(slots.MAX_HOLDERS), 64)  # every holder let go
    late = os.open(
        os.path.join(d, "old.bin"), os.O_RDWR
    )  # a reader that opened the name before it went
    real = slots.Slot.set_key

    def reader_arrives(self, key):
        real(self, key)
        if key == "":
            slots.hold(late, 0)  # the late reader's flag lands in the window

    monkeypatch.setattr(slots.Slot, "set_key", reader_arrives)
    fresh = pool.take(nbytes)
    assert fresh is not slot and slot not in pool.slots
    assert slots.key_of(late) == ""  # the reader then sees the key gone and does not serve it
    os.close(late)
    pool.close()


def test_a_stale_published_name_of_another_record_is_left_alone(tmp_path):
    """Reusing a slot removes its old published name only while that name is still this slot's
    file."""
    from prealign.loaders.handoff.share_folder import SharedFolder

    d = str(tmp_path / "f")
    folder = SharedFolder(d, 0, 1)
    folder.acquire("k")
    pool = _named_pool(d)
    slot, _ = _publish(folder, pool, "k", [1])
    name = os.path.join(d, "k.bin")
    os.unlink(name)
    with open(name, "wb") as f:  # a later publication of the same key by someone else
        f.write(b"other")
    os.pwrite(slot.fd, bytes(slots.MAX_HOLDERS), 64)
    assert pool.take(8) is slot
    assert open(name, "rb").read() == b"other"
    pool.close()


def test_a_rank_asking_again_for_a_record_it_maps_gets_a_copy(tmp_path):
    """One holder flag per rank: a second request of the same key by a rank that already has it (the
    claimer's own batch, a new iterator re-asking prefetched positions) is served as a copy, so
    dropping one of the two never frees the slot under the other."""
    from prealign.loaders.handoff.share_folder import HIT, SharedFolder, decode_record

    d = str(tmp_path / "f")
    r0, r1 = SharedFolder(d, 0, 2), SharedFolder(d, 1, 2)
    r0.acquire("K1")
    pool = _named_pool(d)
    slot, n = _publish(r0, pool, "K1", [1] * 1024)
    first = _ref(slot, n)  # rank 0's main process: the claimer's own batch (holder 0)
    state, record = r0.acquire("K1", by_fd=True)  # rank 0 asks for K1 again
    assert state == HIT and isinstance(
        record, dict
    )  # decoded in place: a copy path, not the slot's fd
    held = record["x"].clone()
    state, (fd, size) = r1.acquire("K1", by_fd=True)
    got = pickle.loads(pickle.dumps(slots.send(fd, size, 1, _same)))
    os.close(fd)
    assert decode_record(got.numpy())["x"].tolist() == [1] * 1024
    del got, first
    gc.collect()
    assert (
        slot.free()
    )  # both holders let go: reusable, and rank 0's second batch does not live in it
    assert held.tolist() == [1] * 1024
    pool.close()


def test_a_full_file_system_is_an_oserror_not_a_bus_error(tmp_path, monkeypatch):
    """Slots are allocated up front: when /dev/shm is full, taking one fails (and the caller falls
    back) instead of the first write into a sparse file killing the worker with SIGBUS."""

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError):
        slots.SlotPool().take(1 << 20)
    out = unpack_batch(
        pack_batch({"x": torch.arange(4)}, shared=True)
    )  # pack_batch falls back to memory
    assert out["x"].tolist() == [0, 1, 2, 3]


def test_a_forked_child_dropping_its_copy_keeps_the_parents_hold():
    pool = slots.SlotPool()
    slot = pool.take(64)
    slot.write([bytes(64)])
    slot.hold([0])
    got = _ref(slot, 64)
    pid = os.fork()
    if pid == 0:  # the child drops its copy of the batch and exits normally
        del got
        gc.collect()
        os._exit(0 if not slot.free() else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and not slot.free()
    del got
    gc.collect()
    assert slot.free()
    pool.close()


def test_an_error_building_a_received_batch_is_carried_not_raised_in_the_queue():
    from prealign.loaders.errors import ShareRecordError

    pool = slots.SlotPool()
    slot = pool.take(8)
    slot.hold([0])
    got = pickle.loads(pickle.dumps(slots.send(slot, 8, 0, _broken)))
    assert isinstance(got, ShareRecordError) and "could not be mapped or built" in got.args[0]
    gc.collect()
    assert slot.free()  # the mapping it made was let go
    pool.close()


def _broken(buffer):
    raise ValueError("no")


def test_a_slot_is_published_again_after_its_last_name_went(tmp_path):
    """The readers remove a record's name once all have it; the claimer then reuses the slot for the
    next record and publishes it again (the bug an O_TMPFILE slot had: it can be linked only
    once)."""
    from prealign.loaders.handoff.share_folder import HIT, SharedFolder

    d = str(tmp_path / "f")
    r0, r1 = SharedFolder(d, 0, 2), SharedFolder(d, 1, 2)
    pool = _named_pool(d)
    for key, value in (("a", 1), ("b", 2), ("c", 3)):
        r0.acquire(key)
        slot, n = _publish(r0, pool, key, [value] * 8)
        os.pwrite(slot.fd, b"\0", 64)  # rank 0's main process let go
        state, record = r1.acquire(key)
        assert state == HIT and record["x"].tolist() == [value] * 8
        os.pwrite(slot.fd, b"\0", 65)  # and rank 1's
        assert not os.path.exists(os.path.join(d, f"{key}.bin"))
    assert len(pool.slots) == 1  # one slot, reused for all three
    pool.close()


@pytest.mark.slow
def test_the_sweep_removes_the_slots_of_a_dead_process_at_once(tmp_path):
    """A pooled slot is held with a lock by its process: the sweep removes those nobody holds (a
    killed worker's) at once and never one a live process holds, whatever the pid in its name
    says."""
    from prealign.loaders.handoff.share_folder import SharedFolder

    d = tmp_path / "f"
    d.mkdir(mode=0o700)
    live = slots.SlotPool(slots.named_in(str(d)))
    held = live.take(8)
    code = (
        f"from prealign.loaders.handoff import slots; "
        f"slots.SlotPool(slots.named_in({str(d)!r})).take(8)"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True
    )  # exits without closing its pool (as if killed)
    (d / "slot-1-0").write_bytes(b"x")  # a name whose pid is alive (init) but nobody holds: stale
    assert len(os.listdir(d)) == 3
    SharedFolder(str(d), 0, 2, ttl=1000.0)._sweep()
    assert os.listdir(d) == [os.path.basename(held.path)]
    live.close()


def test_a_slot_that_cannot_grow_stays_pooled(tmp_path, monkeypatch):
    pool = _named_pool(tmp_path / "f")
    slot = pool.take(8)
    real = os.posix_fallocate
    monkeypatch.setattr(
        os, "posix_fallocate", lambda fd, off, n: (_ for _ in ()).throw(OSError(28, "full"))
    )
    with pytest.raises(OSError):
        pool.take(1 << 20)
    monkeypatch.setattr(os, "posix_fallocate", real)
    assert pool.slots == [slot] and pool.take(8) is slot  # neither leaked nor lost
    pool.close()
    assert os.listdir(tmp_path / "f") == []


def test_two_requests_of_one_rank_get_one_fd_and_one_private_copy(tmp_path):
    """Only a rank's first turn maps the slot (one holder flag per rank); any other request of that
    rank reads the record into private memory, which a later rewrite of the slot never reaches."""
    from prealign.loaders.handoff.share_folder import HIT, SharedFolder

    d = str(tmp_path / "f")
    r0, r1, r1b = SharedFolder(d, 0, 3), SharedFolder(d, 1, 3), SharedFolder(d, 1, 3)
    r0.acquire("K")
    pool = _named_pool(d)
    slot, n = _publish(r0, pool, "K", [4] * 16)
    first = r1.acquire("K", by_fd=True)
    second = r1b.acquire(
        "K", by_fd=True
    )  # e.g. another worker of rank 1, before the first marked it
    assert (
        first[0] == second[0] == HIT and isinstance(first[1], tuple) and isinstance(second[1], dict)
    )
    os.close(first[1][0])
    copy = second[1]["x"]
    os.pwrite(slot.fd, bytes(64), slots.HEADER + 100)  # the slot rewritten later
    assert copy.tolist() == [4] * 16
    pool.close()


def test_record_orders_and_dtype_aliases_are_refused_or_served_never_raised():
    from prealign.loaders.errors import ShareRecordError
    from prealign.loaders.handoff.share_folder import decode_record, encode_record

    parts = encode_record({"a": torch.arange(3)})
    head = json.loads(bytes(parts[0][10:]))
    for order in (
        [1],
        [[1]],
        ["a", "a"],
        ["b"],
    ):  # non-str / repeated / unknown names: written order ignored
        head["order"] = order
        raw = json.dumps(head).encode()
        buf = bytearray(parts[0][:6] + len(raw).to_bytes(4, "little") + raw + bytes(parts[1]))
        assert decode_record(buf)["a"].tolist() == [0, 1, 2]
    head = {
        "tensors": {"q": ["Q", [2], 0, 16]},
        "values": {},
        "order": ["q"],
    }  # "Q": numpy's ulonglong
    raw = json.dumps(head).encode()
    buf = bytearray(parts[0][:6] + len(raw).to_bytes(4, "little") + raw + bytes(16))
    assert decode_record(buf)["q"].dtype == torch.uint64  # served as the canonical uint64
    with pytest.raises(ShareRecordError):
        decode_record(bytearray(buf).replace(b'"Q"', b'"g"'))  # longdouble: refused


# ---- small fields are copied out; a byte cap on slots
# ----------------------------------------------------
def _thd(items):
    i = items[0]
    return pack_batch(
        {
            "input_ids": torch.full((1, 32768), i, dtype=torch.int64),  # 256 KiB: a view
            "cu_seqlens": torch.tensor([0, 100 + i, 32768], dtype=torch.int32),
            "sample_index": torch.tensor([i, i + 1]),
            "n": i,
        }
    )


@pytest.mark.slow
def test_kept_metadata_pins_no_slot():
    """A training loop keeping each batch's ``cu_seqlens`` (60 batches, 2 workers) keeps no slot
    mapped: small fields are copied out when unpacked; the token field stays a view of the slot."""
    kept, big = [], None
    for b in DataLoader(range(60), batch_size=1, num_workers=2, collate_fn=_thd):
        d = unpack_batch(b)
        kept.append((d["n"], d["cu_seqlens"], d["sample_index"]))
        big = d["input_ids"]
        assert (
            big.untyped_storage().data_ptr() == b.buffer.untyped_storage().data_ptr()
        )  # zero-copy view
    del b, d
    gc.collect()
    assert _slot_mappings() == 2  # the last input_ids only
    del big
    gc.collect()
    assert [(n, c.tolist(), s.tolist()) for n, c, s in kept] == [
        (n, [0, 100 + n, 32768], [n, n + 1]) for n in range(60)
    ]
    assert _slot_mappings() <= 12, _slot_mappings()


def test_past_the_byte_cap_a_pool_makes_nothing_and_the_batch_is_copied(monkeypatch):
    from prealign.loaders.errors import ShmBudgetError

    monkeypatch.setattr(
        slots, "_pools", {}
    )  # (the cap is per process: no other test's pool counted)
    pool = slots.SlotPool(limit=2 * (slots.HEADER + 8192))
    a = pool.take(8192)
    a.hold([0])
    b = pool.take(100)
    b.hold([0])
    with pytest.raises(ShmBudgetError):
        pool.take(1)  # both held: a third would pass the cap
    b.hold([])
    with pytest.raises(ShmBudgetError):
        pool.take(3 * 8192)  # growing the free one would pass it too
    assert pool.take(4096) is b and len(pool.slots) == 2
    pool.close()
    monkeypatch.setenv("PREALIGN_SHM_CAP", "1000")
    out = pack_batch({"x": torch.arange(4)}, shared=True)
    assert isinstance(out, PackedBatch) and unpack_batch(out)["x"].tolist() == [
        0,
        1,
        2,
        3,
    ]  # the copying path


def _capped(worker_id):
    os.environ["PREALIGN_SHM_CAP"] = (
        "700000"  # two slots of a _batch (about 315 kB each), not three
    )


@pytest.mark.slow
def test_a_loop_keeping_every_batch_stays_under_the_cap():
    """Two workers, each capped at two slots' bytes; the loop keeps all 20 batches whole: at most
    two slots per worker stay mapped, the other batches come as copies, every value right, nothing
    left behind."""
    before = _open_fds()
    kept = [
        unpack_batch(b)
        for b in DataLoader(
            range(20), batch_size=1, num_workers=2, collate_fn=_batch, worker_init_fn=_capped
        )
    ]
    assert [d["n"] for d in kept] == list(range(20))
    assert all(
        bool((d["x"] == d["n"]).all()) and d["i"].tolist() == [d["n"], -d["n"]] for d in kept
    )
    assert 0 < _slot_mappings() <= 2 * 2 * 2, _slot_mappings()  # (two mappings per slot)
    del kept
    gc.collect()
    assert _slot_mappings() == 0 and _open_fds() <= before + 1


@pytest.mark.slow
def test_the_loaders_shm_cap_reaches_their_workers(tmp_path):
    """``LoadingOptions(shm_cap=0)``: a PackedLoader's two workers hand every batch over by copy (no
    slot is mapped while the loop keeps them all), and the batches equal those of the default
    hand-off."""
    from prealign.loaders import LoadingOptions, PackedLoader, WebDatasetSource
    from prealign.schemas import ParallelLayout
    from prealign.schemas.schema import causal_lm_schema
    from tests.loader_helpers import sample_lengths, write_shards

    paths = write_shards(str(tmp_path), sample_lengths(200, low=500, high=3000), num_shards=4)

    def batches(**loading):
        loader = PackedLoader(
            WebDatasetSource(paths),
            schema=causal_lm_schema(),
            layout=ParallelLayout(),
            token_budget=16384,
            num_workers=2,
            loading=LoadingOptions(**loading),
        )
        return list(loader)

    kept = batches(shm_cap=0)
    assert len(kept) > 4 and _slot_mappings() == 0
    reference = batches()
    assert (
        _slot_mappings() > 0
    )  # the default hands the same batches over in slots (input_ids > 64 KiB)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(kept, reference))
    with pytest.raises(ValueError, match="shm_cap"):
        LoadingOptions(shm_cap=-1)


def test_a_record_no_peer_reads_stays_under_the_cap(tmp_path):
    """cp=2, rank 1 fell back and never reads: rank 0's published slots hold rank 1's flag forever.
    The pool lets the oldest go past ``files`` and unpublishes it, so the records in the folder stay
    under the cap instead of growing one per micro-batch until the sweep."""
    from prealign.loaders.errors import ShmBudgetError
    from prealign.loaders.handoff.share_folder import CLAIMED, SharedFolder, encode_record

    d = tmp_path / "f"
    d.mkdir(mode=0o700)
    folder = SharedFolder(str(d), 0, 2, timeout=1.0, ttl=300.0)
    mb = 1 << 20
    pool = slots.SlotPool(slots.named_in(str(d)), cap=2, files=2, limit=4 * (mb + 2 * slots.HEADER))
    for i in range(20):
        key = f"k{i}"
        assert folder.acquire(key)[0] == CLAIMED
        parts = encode_record({"x": torch.zeros(mb // 8 - 64, dtype=torch.int64)})
        try:
            slot = pool.take(sum(memoryview(p).nbytes for p in parts))
        except ShmBudgetError:
            folder.publish(key, {"x": torch.zeros(1)})
            continue
        slot.write(parts)
        slot.hold(range(2))
        slot.set_key(key)
        folder.publish_slot(key, slot)
        os.pwrite(
            slot.fd, b"\0", 64
        )  # rank 0's main process let go of its copy; rank 1 never reads
    held = sum(os.stat(d / n).st_blocks * 512 for n in os.listdir(d) if n.endswith(".bin"))
    assert held <= pool.limit, held
    pool.close()
