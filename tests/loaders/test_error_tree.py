"""The error tree (docs/errors.md): configuration and bad data are ``ValueError``s, system errors
(I/O, timeouts, dead workers) are ``OSError`` / ``RuntimeError`` and never ``ValueError``, so a
transform's ``except ValueError`` cannot swallow a stalled read and no bad-data policy counts
one."""

from __future__ import annotations

import http.server
import os
import pickle
import threading

import pytest
import torch

from prealign.loaders import BadDataPolicy, PackedLoader, WebDatasetSource
from prealign.loaders import errors as loader_errors
from prealign.loaders.errors import (
    SYSTEM_ERRORS,
    CollectiveTimeoutError,
    CorruptShardError,
    RemoteReadError,
    RemoteStallError,
    ShardTimeoutError,
    ShmBudgetError,
    WorkerError,
)
from prealign.loaders.sources.remote import RemoteOptions, read_whole
from prealign.schemas import ParallelLayout, causal_lm_schema
from prealign.schemas import errors as schema_errors
from prealign.schemas.errors import ConfigError, DataError, PrealignError, SampleError
from tests.loader_helpers import sample_lengths, write_shards

SYSTEM = [
    CorruptShardError,
    ShardTimeoutError,
    RemoteReadError,
    RemoteStallError,
    ShmBudgetError,
    CollectiveTimeoutError,
    WorkerError,
]


def _every_error() -> list[type]:
    found = set()
    for module in (schema_errors, loader_errors):
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, PrealignError):
                found.add(value)
    return sorted(found, key=lambda c: c.__name__)


def test_the_tree_splits_system_errors_from_configuration_and_data():
    assert PrealignError.__bases__ == (Exception,) and not issubclass(PrealignError, ValueError)
    assert isinstance(RemoteStallError("http://h/s.tar", "no byte for 1 s"), ValueError) is False
    for cls in _every_error():
        if cls is PrealignError:
            continue
        system = issubclass(cls, SYSTEM_ERRORS)
        assert system != issubclass(cls, ValueError), cls  # exactly one of the two families
        assert system == (cls in SYSTEM), cls
        assert system or issubclass(
            cls, (ConfigError, DataError, schema_errors.StartupMismatchError)
        ), cls
    assert issubclass(SampleError, DataError) and issubclass(ShardTimeoutError, TimeoutError)
    assert issubclass(RemoteStallError, TimeoutError) and issubclass(WorkerError, RuntimeError)


@pytest.mark.parametrize("cls", SYSTEM)
def test_a_system_error_crosses_processes_as_itself(cls):
    args = {
        CorruptShardError: ("s.tar", 7, "truncated"),
        ShardTimeoutError: ("s.tar", 7, "no data for 1 s"),
        RemoteReadError: ("http://h/s.tar", "HTTP 500"),
        RemoteStallError: ("http://h/s.tar", "no byte"),
    }
    err = cls(*args.get(cls, ("a message",)))
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls and str(back) == str(err) and back.__dict__ == err.__dict__
    again = cls(
        str(err)
    )  # as torch's DataLoader re-raises a worker's exception: type(exc)(message)
    assert type(again) is cls and str(again) == str(err)


class _Stalling(http.server.BaseHTTPRequestHandler):
    """Announces a body, sends none of it, and holds the connection until the test ends."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        self.wfile.flush()
        self.server.release.wait(30)


@pytest.fixture
def stalling_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stalling)
    server.daemon_threads, server.release = True, threading.Event()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/caption.txt"
    server.release.set()
    server.shutdown()
    server.server_close()


class _CaptionFromServer:
    """A transform that fetches a caption over http once ``flag`` exists, and falls back to a
    default on any ``ValueError`` (what a user writes around bad data)."""

    def __init__(self, url: str, flag: str):
        self.url, self.flag, self.fell_back = url, flag, 0

    def __call__(self, sample: dict) -> dict:
        ids = torch.as_tensor(sample["input_ids.npy"]).long()
        if os.path.exists(self.flag):
            try:
                read_whole(self.url, RemoteOptions(retries=0, timeout=0.5))
            except ValueError:
                self.fell_back += 1
        return {"input_ids": ids}


def test_a_transform_catching_value_error_does_not_swallow_a_stalled_read(tmp_path, stalling_url):
    shards = write_shards(str(tmp_path), sample_lengths(12), num_shards=2)
    flag = str(tmp_path / "now")
    transform = _CaptionFromServer(stalling_url, flag)
    loader = PackedLoader(
        WebDatasetSource(shards, transform=transform),
        schema=causal_lm_schema(),
        layout=ParallelLayout(),
        token_budget=256,
        seed=1,
        bad_data=BadDataPolicy(on_error="skip", warn=False),
    ).prepare()
    open(flag, "w").close()
    with pytest.raises(RemoteStallError, match="caption.txt.*no byte"):
        list(loader)
    assert (
        transform.fell_back == 0 and loader.report.total == 0
    )  # neither swallowed nor counted as bad data
