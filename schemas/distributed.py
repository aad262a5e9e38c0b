"""Collectives over ``torch.distributed``: the startup check every rank runs (schemas and layouts
agree, the first batch validates), with a rendezvous that names absent ranks instead of hanging.

Ranks and sizes come from :mod:`prealign.schemas.parallel_state`; everything else takes them as
plain ints.
"""

from __future__ import annotations

import hashlib
import json
import time

import torch.distributed as dist

from .contract import Consumer, ConsumerUnsupportedError, ModelContract, check_consumer
from .errors import BatchValidationError, ConfigError, StartupMismatchError
from .layout import ParallelLayout
from .schema import BatchSchema
from .validate import Violation, check_schema_layout, validate_batch


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
    text = json.dumps(
        {"schema": json.loads(schema.to_json()), "layout": layout.to_dict()}, sort_keys=True
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


DEFAULT_STARTUP_TIMEOUT_S = 300.0
_startup_calls: dict[tuple[int, ...], int] = {}


class _Rendezvous:
    """Every rank of ``ranks`` posts a JSON payload under ``prefix`` in the process group's
    key-value store; :meth:`gather` waits at most ``timeout`` s for all of them. A rank that gives
    up marks the round aborted (naming who was absent), so a rank arriving later fails too instead
    of passing alone."""

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
        return StartupMismatchError(
            f"startup check failed: rank(s) {absent} did not call check_startup within "
            f"{timeout:g} s (of ranks {self.ranks}); every rank must call it once, after "
            f"building its first batch"
        )

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
                self.store.set(
                    self._key("abort"), json.dumps({"absent": absent, "timeout": timeout})
                )
                raise self._error(absent, timeout)
            time.sleep(pause)
            pause = min(pause * 2, 0.2)


def _rendezvous(group) -> _Rendezvous:
    """The rendezvous of this ``check_startup`` call (calls are numbered per group, so repeated
    checks use fresh keys); on the default store of the process group."""
    store = dist.distributed_c10d._get_default_store()  # noqa: SLF001 - the one public-enough handle on it
    ranks = (
        sorted(dist.get_process_group_ranks(group))
        if group is not None
        else list(range(dist.get_world_size()))
    )
    call = _startup_calls.get(tuple(ranks), 0)
    _startup_calls[tuple(ranks)] = call + 1
    tag = hashlib.sha256(json.dumps(ranks).encode()).hexdigest()[:12]
    return _Rendezvous(store, f"prealign/startup/{tag}/{call}", ranks)


def check_startup(
    batch: dict,
    schema: BatchSchema,
    layout: ParallelLayout,
    group=None,
    *,
    timeout: float = DEFAULT_STARTUP_TIMEOUT_S,
    contract: ModelContract | None = None,
    consumer: Consumer | None = None,
    packed: bool | None = None,
) -> str:
    """Validate a first batch on every rank, then compare schema+layout fingerprints across ranks.

    With ``contract`` (the model's :class:`~prealign.schemas.contract.ModelContract`, e.g.
    ``vision_family(config).contract()`` or ``model_contract(config)``) and ``consumer`` (what runs
    the batches: ``Consumer.hf("sdpa")``, ``Consumer.megatron()``), the consumer is checked first
    (:func:`~prealign.schemas.contract.check_consumer`, with ``packed`` rows, default: a THD batch
    under a layout that allows more than one sequence per row, and
    ``layout.cp``) before the batch is validated: what it cannot run raises
    :class:`~prealign.schemas.contract.ConsumerUnsupportedError` on **every** rank, naming the
    model, the layer kind, the installed version and the way out, before the batch reaches the
    model.

    Every rank posts its outcome (fingerprint, violations) to the process group's store whatever its
    local outcome and waits for the others, so a bad batch or a mismatched config on one rank raises
    :class:`StartupMismatchError` on **every** rank (no rank is left waiting in a later collective).
    A rank that does not call within ``timeout`` seconds is named in the
    :class:`StartupMismatchError` every calling rank raises (a rank calling after that raises too),
    instead of a wait until the process group's own timeout. Without an initialised process group it
    only validates. Returns the fingerprint.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ConfigError(f"check_startup: timeout: expected seconds > 0, got {timeout!r}")
    if (contract is None) != (consumer is None):
        raise ConfigError(
            "check_startup: give contract= and consumer= together (the model's ModelContract and "
            "what runs it)"
        )
    check_schema_layout(schema, layout)  # (as before, raised before any rendezvous)
    fingerprint = layout_fingerprint(schema, layout)
    collective = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    refused = None
    if contract is not None:
        if packed is None:
            packed = (
                layout.max_seqs != 1 and isinstance(batch, dict) and "cu_seqlens_padded" in batch
            )
        try:
            check_consumer(contract, consumer, packed=packed, cp=layout.cp)
        except ConsumerUnsupportedError as exc:
            if not collective:
                raise
            refused = exc.details()
    try:
        violations = validate_batch(batch, schema, layout, raise_on_error=False)
    except Exception as exc:  # noqa: BLE001 - reported on every rank (not skipped): a rank must not miss the rendezvous
        if not collective:
            raise
        violations = [
            Violation("batch", "a batch the validator can read", f"{type(exc).__name__}: {exc}")
        ]
    local = {
        "rank": dist.get_rank() if collective else 0,
        "fingerprint": fingerprint,
        "refused": refused,
        "violations": [str(v) for v in violations[:20]],
        "num_violations": len(violations),
    }
    if not collective:
        if violations:
            raise BatchValidationError(violations)
        return fingerprint
    meeting = _rendezvous(group)
    try:
        meeting.post(local["rank"], local)
        gathered = meeting.gather(float(timeout))
    except (
        RuntimeError
    ) as exc:  # the store itself failed (its host process is gone): every rank says so
        raise StartupMismatchError(
            f"startup check failed: the process group's store is unreachable "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    for g in gathered:  # the consumer cannot run the model: the same typed error on every rank
        if g.get("refused"):
            raise ConsumerUnsupportedError(**g["refused"])
    problems = []
    prints = {g["fingerprint"] for g in gathered}
    if len(prints) > 1:
        by_print = {
            p: [g["rank"] for g in gathered if g["fingerprint"] == p] for p in sorted(prints)
        }
        problems.append(
            f"schema/layout fingerprints differ across ranks: {by_print} "
            f"(this rank {local['rank']}: {schema.name}, {layout.to_dict()})"
        )
    for g in gathered:
        if g["num_violations"]:
            problems.append(
                f"rank {g['rank']}: {g['num_violations']} violation(s): "
                + "; ".join(g["violations"])
            )
    if problems:
        raise StartupMismatchError(
            "startup check failed on every rank:\n  " + "\n  ".join(problems)
        )
    return fingerprint
