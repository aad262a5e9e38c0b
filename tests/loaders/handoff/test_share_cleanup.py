"""Share folders leave nothing behind (issue #18): the folders of runs that are over are swept
(flock liveness, never a pid), and only names the protocol makes are ever deleted."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

import pytest

from prealign.loaders.handoff.share_folder import CLAIMED, SharedFolder

OLD = time.time() - 3600


def _folder(base, name: str, files: dict) -> str:
    d = os.path.join(base, name)
    os.makedirs(d, mode=0o700)
    for f, text in files.items():
        with open(os.path.join(d, f), "w") as fh:
            fh.write(text)
        os.utime(os.path.join(d, f), (OLD, OLD))
    return d


def test_the_folders_of_runs_that_are_over_are_swept_and_nothing_else(tmp_path):
    base = str(tmp_path)
    key = "e0-p1-" + "ab" * 16
    entries = {
        f"{key}.claim": "1",
        f"{key}.bin": "x",
        f"{key}.r0": "",
        f"{key}.err": "",
        "slot-1-2": "",
        f"{key}.12-34.tmp": "",
    }
    dead = _folder(base, "prealign-batch-" + "0" * 16, entries)
    live = _folder(base, "prealign-batch-" + "1" * 16, entries)
    held = os.open(os.path.join(live, f"{key}.claim"), os.O_RDONLY)
    fcntl.flock(
        held, fcntl.LOCK_EX
    )  # a live claimer (another open file: its lock is not the sweeper's)
    users = _folder(base, "prealign-media-" + "2" * 16, {**entries, "notes.txt": "a user's"})
    young = _folder(base, "prealign-media-" + "3" * 16, {})
    with open(os.path.join(young, f"{key}.bin"), "w") as fh:
        fh.write("x")  # a run that wrote a moment ago
    other = _folder(base, "someone-else", entries)
    here = SharedFolder(
        os.path.join(base, "prealign-batch-" + "4" * 16), 0, 2, timeout=0.5, ttl=10.0
    )
    os.makedirs(here.directory, mode=0o700)
    _folder(here.directory, "sub", {})
    for name in ("notes.txt", f"{key}.bin"):
        with open(os.path.join(here.directory, name), "w") as fh:
            fh.write("x")
        os.utime(os.path.join(here.directory, name), (OLD, OLD))
    assert here.acquire("e1-p0-" + "cd" * 16) == (CLAIMED, None)
    os.close(held)
    assert not os.path.exists(dead)
    assert sorted(os.listdir(live)) == sorted(entries)
    assert sorted(os.listdir(users)) == sorted(
        [*entries, "notes.txt"]
    )  # nothing of a folder with a user's file
    assert os.listdir(young) == [f"{key}.bin"]
    assert sorted(os.listdir(other)) == sorted(entries)
    # in its own folder the ttl sweep deletes the old record, never the user's file nor a folder
    assert "notes.txt" in os.listdir(here.directory) and "sub" in os.listdir(here.directory)
    assert f"{key}.bin" not in os.listdir(here.directory)


@pytest.mark.slow
def test_a_process_removes_its_claims_and_markers_at_exit_and_keeps_the_peers(tmp_path):
    """A claimer whose record nobody read, a failed claim (``.err``), and a reader of a peer's
    record whose other peer never came: at exit each removes its own files; the peer's record
    stays."""
    d = str(tmp_path / ("prealign-media-" + "5" * 16))
    peer = SharedFolder(d, 2, 3)
    assert peer.acquire("peerkey") == (CLAIMED, None)
    peer.publish("peerkey", {"a": 1})
    code = f"""
from prealign.loaders.handoff.share_folder import CLAIMED, HIT, SharedFolder
f = SharedFolder({d!r}, 0, 3)
assert f.acquire("k1") == (CLAIMED, None)
f.publish("k1", {{"a": 1}})
assert f.acquire("k2") == (CLAIMED, None)
f.failed("k2")
assert f.acquire("peerkey")[0] == HIT
import os
kept = {{"k1.bin", "k1.claim", "k1.r0", "k2.err", "k2.claim", "peerkey.r0"}}
assert kept <= set(os.listdir({d!r}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(os.listdir(d)) == ["peerkey.bin", "peerkey.claim", "peerkey.r2"]
