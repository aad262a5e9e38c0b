"""The one module that reads ``torch.distributed`` / ``megatron.core.parallel_state``.

Everything else takes ranks and sizes as plain ints, so multi-rank logic is testable in one process.
"""
from __future__ import annotations

import hashlib
import json
import time

import torch.distributed as dist

from .errors import BatchValidationError, ConfigError, StartupMismatchError
from .layout import ParallelLayout
from .schema import BatchSchema


def _group_size_rank(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def megatron_parallel_sizes(pg_collection=None) -> dict[str, int]:
    """``{"tp", "cp", "dp", "tp_rank", "cp_rank", "dp_rank"}`` from megatron-core.

    Reads ``pg_collection`` (a megatron-core ``ProcessGroupCollection``, the API newer releases pass
    around) when given, else the initialised ``parallel_state`` (0.x), falling back to
    ``ProcessGroupCollection.use_mpu_process_groups()`` where the getters moved.
    """
    not_ready = ("megatron-core parallel state is not (fully) initialised{}; call "
                 "parallel_state.initialize_model_parallel(...) first, or pass sizes as ints")
    if pg_collection is None:
        from megatron.core import parallel_state as ps

        try:
            if hasattr(ps, "get_tensor_model_parallel_world_size"):  # 0.x: module-level getters
                if not ps.model_parallel_is_initialized():
                    raise ConfigError(not_ready.format(""))
                return {"tp": ps.get_tensor_model_parallel_world_size(), "cp": ps.get_context_parallel_world_size(),
                        "dp": ps.get_data_parallel_world_size(), "tp_rank": ps.get_tensor_model_parallel_rank(),
                        "cp_rank": ps.get_context_parallel_rank(), "dp_rank": ps.get_data_parallel_rank()}
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        except (AssertionError, ImportError) as exc:  # a group megatron-core did not build
            raise ConfigError(not_ready.format(f" ({exc})")) from None
    (tp, tp_rank), (cp, cp_rank), (dp, dp_rank) = (
        _group_size_rank(getattr(pg_collection, name)) for name in ("tp", "cp", "dp"))
    return {"tp": tp, "cp": cp, "dp": dp, "tp_rank": tp_rank, "cp_rank": cp_rank, "dp_rank": dp_rank}


def data_parallel_info() -> dict[str, int]:
    """``{"dp", "dp_rank", "cp", "cp_rank", "tp", "tp_rank"}`` of this process, for data loaders.

    megatron-core's ``parallel_state`` when initialised; else ``torch.distributed`` (every rank a DP
    rank, tp = cp = 1); else a single process.
    """
    try:
        return megatron_parallel_sizes()
    except (ConfigError, ImportError, AssertionError):  # no megatron-core parallel state here
        pass
    if dist.is_available() and dist.is_initialized():
        return {"dp": dist.get_world_size(), "dp_rank": dist.get_rank(), "cp": 1, "cp_rank": 0, "tp": 1, "tp_rank": 0}
    return {"dp": 1, "dp_rank": 0, "cp": 1, "cp_rank": 0, "tp": 1, "tp_rank": 0}


def all_gather_objects(obj, group=None) -> list:
    """Every rank's ``obj`` (picklable, produced by this library, never by data), in rank order;
    ``[obj]`` without an initialised process group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def process_rank_world(group=None) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) without an initialised process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def layout_fingerprint(schema: BatchSchema, layout: ParallelLayout) -> str:
    """16-hex-digit digest of schema + layout: equal on every rank that builds the same batches."""
    text = json.dumps({"schema": json.loads(schema.to_json()), "layout": layout.to_dict()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


DEFAULT_STARTUP_TIMEOUT_S = 300.0
_startup_calls: dict[tuple[int, ...], int] = {}


class _Rendezvous:
    """Every rank of ``ranks`` posts a JSON payload under ``prefix`` in the process group's key-value
    store; :meth:`gather` waits at most ``timeout`` s for all of them. A rank that gives up marks the
    round aborted (naming who was absent), so a rank arriving later fails too instead of passing alone."""

    def __init__(self, store, prefix: str, ranks: list[int]):
        self.store, self.prefix, self.ranks = store, prefix, ranks

    def _key(self, name) -> str:
        return f"{self.prefix}/{name}"

    def post(self, rank: int, payload: dict) -> None:
        self.store.set(self._key(f"rank{rank}"), json.dumps(payload))
        self.store.add(self._key("arrived"), 1)

    def _aborted(self) -> dict | None:
        if self.store.check([self._key("abort")]):
            return json.loads(self.store.get(self._key("abort")))
        return None

    def _error(self, absent: list[int], timeout: float) -> StartupMismatchError:
        return StartupMismatchError(f"startup check failed: rank(s) {absent} did not call check_startup within "
                                    f"{timeout:g} s (of ranks {self.ranks}); every rank must call it once, after "
                                    f"building its first batch")

    def gather(self, timeout: float) -> list[dict]:
        deadline, pause = time.monotonic() + timeout, 0.01
        while True:
            aborted = self._aborted()
            if aborted is not None:  # another rank gave up first: fail alike, never pass alone
                raise self._error(aborted["absent"], aborted["timeout"])
            if self.store.add(self._key("arrived"), 0) >= len(self.ranks):
                return [json.loads(self.store.get(self._key(f"rank{r}"))) for r in self.ranks]
            if time.monotonic() > deadline:
                absent = [r for r in self.ranks if not self.store.check([self._key(f"rank{r}")])]
                self.store.set(self._key("abort"), json.dumps({"absent": absent, "timeout": timeout}))
                raise self._error(absent, timeout)
            time.sleep(pause)
            pause = min(pause * 2, 0.2)


def _rendezvous(group) -> _Rendezvous:
    """The rendezvous of this ``check_startup`` call (calls are numbered per group, so repeated checks
    use fresh keys); on the default store of the process group."""
    store = dist.distributed_c10d._get_default_store()  # noqa: SLF001 - the one public-enough handle on it
    ranks = sorted(dist.get_process_group_ranks(group)) if group is not None else list(range(dist.get_world_size()))
    call = _startup_calls.get(tuple(ranks), 0)
    _startup_calls[tuple(ranks)] = call + 1
    tag = hashlib.sha256(json.dumps(ranks).encode()).hexdigest()[:12]
    return _Rendezvous(store, f"prealign/startup/{tag}/{call}", ranks)


def check_startup(batch: dict, schema: BatchSchema, layout: ParallelLayout, group=None, *,
                  timeout: float = DEFAULT_STARTUP_TIMEOUT_S) -> str:
    """Validate a first batch on every rank, then compare schema+layout fingerprints across ranks.

    Every rank posts its outcome (fingerprint, violations) to the process group's store whatever its
    local outcome and waits for the others, so a bad batch or a mismatched config on one rank raises
    :class:`StartupMismatchError` on **every** rank (no rank is left waiting in a later collective).
    A rank that does not call within ``timeout`` seconds is named in the :class:`StartupMismatchError`
    every calling rank raises (a rank calling after that raises too), instead of a wait until the
    process group's own timeout. Without an initialised process group it only validates.
    Returns the fingerprint.
    """
    from .validate import Violation, validate_batch

    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ConfigError(f"check_startup: timeout: expected seconds > 0, got {timeout!r}")
    fingerprint = layout_fingerprint(schema, layout)
    collective = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    try:
        violations = validate_batch(batch, schema, layout, raise_on_error=False)
    except Exception as exc:  # noqa: BLE001 - reported on every rank (not skipped): a rank must not miss the rendezvous
        if not collective:
            raise
        violations = [Violation("batch", "a batch the validator can read", f"{type(exc).__name__}: {exc}")]
    local = {"rank": dist.get_rank() if collective else 0, "fingerprint": fingerprint,
             "violations": [str(v) for v in violations[:20]], "num_violations": len(violations)}
    if not collective:
        if violations:
            raise BatchValidationError(violations)
        return fingerprint
    meeting = _rendezvous(group)
    try:
        meeting.post(local["rank"], local)
        gathered = meeting.gather(float(timeout))
    except RuntimeError as exc:  # the store itself failed (its host process is gone): every rank says so
        raise StartupMismatchError(f"startup check failed: the process group's store is unreachable "
                                   f"({type(exc).__name__}: {exc})") from exc
    problems = []
    prints = {g["fingerprint"] for g in gathered}
    if len(prints) > 1:
        by_print = {p: [g["rank"] for g in gathered if g["fingerprint"] == p] for p in sorted(prints)}
        problems.append(f"schema/layout fingerprints differ across ranks: {by_print} "
                        f"(this rank {local['rank']}: {schema.name}, {layout.to_dict()})")
    for g in gathered:
        if g["num_violations"]:
            problems.append(f"rank {g['rank']}: {g['num_violations']} violation(s): " + "; ".join(g["violations"]))
    if problems:
        raise StartupMismatchError("startup check failed on every rank:\n  " + "\n  ".join(problems))
    return fingerprint
