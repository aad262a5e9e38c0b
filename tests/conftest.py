"""Shared test helpers: the hypothesis profile, the strict-skip gate, sample builders, layout
strategies and the independent reference implementations the collators are checked against.

The references here are written from the definitions in REFERENCE.md with one Python iteration per
sequence (slow, obvious), never from the collators' index arithmetic.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import socket
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import prealign.collate.assemble
from prealign.schemas import (
    IGNORE_INDEX,
    CPLayout,
    FP8Recipe,
    PadPolicy,
    ParallelLayout,
    causal_lm_schema,
)

# ---- hypothesis: reproducible in CI (derandomized, no example database, no deadline) -------------
# For a longer local hunt: PREALIGN_EXAMPLES_SCALE=20 PREALIGN_HYPOTHESIS_RANDOM=1 pytest tests
settings.register_profile(
    "prealign",
    max_examples=60,
    deadline=None,
    database=None,
    derandomize=not os.environ.get("PREALIGN_HYPOTHESIS_RANDOM"),
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)
settings.load_profile("prealign")
EXAMPLES_SCALE = float(
    os.environ.get("PREALIGN_EXAMPLES_SCALE", "1")
)  # e.g. 20 for a long local hunt


def examples(n: int) -> settings:
    """``@settings`` with ``n`` examples (times ``PREALIGN_EXAMPLES_SCALE``)."""
    return settings(max_examples=max(1, int(n * EXAMPLES_SCALE)))


TOPK = 3
SCHEMA = causal_lm_schema()
SCHEMA_TOPK = causal_lm_schema(topk="K")
TOPK_FIELDS = ("teacher_topk_log_probs", "teacher_topk_ids")
SAMPLE_FIELDS = ("input_ids", *TOPK_FIELDS)  # fields whose values come from the sample as given


# ---- the strict-skip gate (CI=true or PREALIGN_STRICT_SKIPS=1)
# ----------------------------------------- A skip is allowed only when the machine lacks something:
# its reason starts with "platform:" (no GPU, not Linux, no /dev/shm, too few CPUs, a tool not
# installed), or it names a missing module nobody declared. A skip for a missing (or too old) module
# that pyproject.toml declares (a dependency, the test extra, the build system's requires) or that
# the README's test command installs, and any skip of another reason, fails the run: in CI a silent
# skip would hide a broken install.
PLATFORM_PREFIX = "platform:"
INSTALLED_BY_THE_TEST_COMMAND = frozenset(
    {"verl"}
)  # `pip install --no-deps verl==...` (README, .ci/run)
_IMPORT_NAMES = {
    "pillow": "PIL",
    "megatron-core": "megatron",
}  # distribution -> top-level import name
_MISSING = re.compile(
    r"could not import '([\w.]+)'|module '([\w.]+)' has __version__|No module named '([\w.]+)'"
)
_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def strict_skips() -> bool:
    """Whether skips are checked: in CI (``CI`` set and not false) or with
    ``PREALIGN_STRICT_SKIPS=1``."""
    ci = os.environ.get("CI", "").strip().lower()
    return (ci not in ("", "0", "false", "no")) or os.environ.get("PREALIGN_STRICT_SKIPS") == "1"


def declared_modules(pyproject: Path = _PYPROJECT) -> frozenset[str]:
    """Top-level import names of what ``pyproject.toml`` declares (dependencies, the ``test`` extra,
    the build system's requires), plus :data:`INSTALLED_BY_THE_TEST_COMMAND`."""
    if sys.version_info >= (3, 11):
        import tomllib

        data = tomllib.loads(pyproject.read_text())
        reqs = [
            *data["project"]["dependencies"],
            *data["project"]["optional-dependencies"]["test"],
            *data["build-system"]["requires"],
        ]
    else:  # Python 3.10: the installed package's metadata (no build-system requires there)
        from importlib.metadata import requires

        reqs = [r for r in requires("prealign") or () if "extra ==" not in r or '"test"' in r]
    names = {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in reqs}
    return frozenset(
        {_IMPORT_NAMES.get(n, n.replace("-", "_")) for n in names} | INSTALLED_BY_THE_TEST_COMMAND
    )


def skip_verdict(reason: str, declared: frozenset[str]) -> str | None:
    """Why a skip of ``reason`` fails a strict run, or None when it is allowed."""
    if reason.lower().startswith(PLATFORM_PREFIX):
        return None
    m = _MISSING.search(reason)
    if m is None:
        return (
            f"not a platform skip (start its reason with {PLATFORM_PREFIX!r} if the machine "
            f"lacks something)"
        )
    module = next(g for g in m.groups() if g)
    if module.split(".")[0] in declared:
        return (
            f"{module} is declared in pyproject.toml or installed by the test command, so it "
            f"must be importable"
        )
    return None


class StrictSkips:
    """Collects the skips of one session; at its end a forbidden one fails the run (exit status
    1)."""

    def __init__(self):
        self.declared = declared_modules()
        self.bad: list[tuple[str, str, str]] = []

    def _record(self, report) -> None:
        if not report.skipped or hasattr(report, "wasxfail"):
            return
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        verdict = skip_verdict(reason, self.declared)
        if verdict is not None:
            self.bad.append((report.nodeid, reason, verdict))

    def pytest_runtest_logreport(self, report):
        self._record(report)

    def pytest_collectreport(
        self, report
    ):  # module-level importorskip: the whole file skipped at collection
        self._record(report)

    def pytest_sessionfinish(self, session):
        if self.bad and session.exitstatus in (
            pytest.ExitCode.OK,
            pytest.ExitCode.NO_TESTS_COLLECTED,
        ):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if self.bad:
            terminalreporter.section(
                "strict skips: these skips fail the run (CI / PREALIGN_STRICT_SKIPS=1)", red=True
            )
            for nodeid, reason, verdict in self.bad:
                terminalreporter.line(
                    f"SKIP NOT ALLOWED {nodeid or '<collection>'}: {reason} -- {verdict}", red=True
                )


def pytest_configure(config):
    if strict_skips():
        config.pluginmanager.register(StrictSkips(), "prealign-strict-skips")
    _isolate_xdist_worker(config)


# ---- pytest-xdist (`pytest -n auto`): each worker process its own temp folder and one torch thread
_WORKER_TMP: dict = {}  # {"config": the session that made the folder, "folder": it}


def _isolate_xdist_worker(config) -> None:
    """In an xdist worker: a temp folder of its own (``TMPDIR`` and ``tempfile.tempdir``, inherited
    by the processes its tests start), so a test that compares the temp folder before and after sees
    only its own worker's files; and, when the workers fill the cores, one intra-op torch thread per
    worker (and ``OMP_NUM_THREADS=1`` for its children, unless set) instead of threads spinning
    against each other. Once per process: a pytest session a test runs inside the worker (pytester)
    neither makes nor removes one."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker or _WORKER_TMP:
        return
    import tempfile

    folder = tempfile.mkdtemp(prefix=f"prealign-tests-{worker}-")
    _WORKER_TMP.update(config=config, folder=folder)
    os.environ["TMPDIR"] = tempfile.tempdir = folder
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    affinity = getattr(os, "sched_getaffinity", None)
    cores = len(affinity(0)) if affinity else (os.cpu_count() or 1)
    if workers >= cores:
        torch.set_num_threads(1)
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_unconfigure(config):
    import shutil

    if _WORKER_TMP.get("config") is config:  # the folder this session made, and what tests left
        shutil.rmtree(_WORKER_TMP["folder"], ignore_errors=True)


# ---- samples
# --------------------------------------------------------------------------------------
def make_samples(
    lengths, *, topk: int | None = None, offset: int = 0, loss_mask: bool = False
) -> list[dict]:
    """Samples whose every value is unique and non-zero, so a misplaced row is always visible.

    Token j of the whole batch (over all samples) has id ``offset + j + 1``; its top-k log-probs are
    ``-(id*K + k) / 8`` (finite, < 0, exact in float32) and ids ``id*K + k``; with ``loss_mask`` a
    sample mask that drops every third token.
    """
    samples, start = [], offset + 1
    for n in lengths:
        ids = torch.arange(start, start + n, dtype=torch.int64)
        s = {"input_ids": ids}
        if topk is not None:
            grid = ids[:, None] * topk + torch.arange(topk)
            s["teacher_topk_ids"] = grid
            s["teacher_topk_log_probs"] = -(grid.to(torch.float32) / 8)
        if loss_mask:
            s["loss_mask"] = (ids % 3 != 0).to(torch.float32)
        samples.append(s)
        start += n
    return samples


def to_nested(samples: list[dict]) -> dict:
    """The same batch as verl's dict of jagged nested tensors."""
    return {
        k: torch.nested.nested_tensor([s[k] for s in samples], layout=torch.jagged)
        for k in samples[0]
    }


def schema_for(topk) -> object:
    return SCHEMA if topk is None else SCHEMA_TOPK


def collate_ranks(collator_cls, schema, layout: ParallelLayout, batch, **kwargs) -> list[dict]:
    """One collated batch per CP rank (rank order)."""
    return [
        collator_cls(schema=schema, layout=layout, cp_rank=r, **kwargs)(batch)
        for r in range(layout.cp)
    ]


# ---- independent references
# ------------------------------------------------------------------------
def naive_round_up(n: int, m: int) -> int:
    """Smallest multiple of m that is >= n, by counting."""
    return next(x for x in itertools.count(n) if x % m == 0)


FP8_BLOCK = {
    FP8Recipe.NONE: 1,
    FP8Recipe.FP8: 16,
    FP8Recipe.MXFP8: 32,
    FP8Recipe.BLOCKWISE: 128,
}  # NVFP4 is MXFP8
"""Rows of one SP rank per recipe, from the recipes' definitions (REFERENCE.md / FIELD.md), not the
enum."""


def row_block(layout: ParallelLayout) -> int:
    """What the rows of one SP rank are a multiple of: the FP8 block and the dispatcher's token
    multiple."""
    return math.lcm(FP8_BLOCK[layout.fp8], layout.token_multiple)


def required_seq_multiple(layout: ParallelLayout) -> int:
    """Per-sequence multiple straight from the consumers' rules (REFERENCE.md)."""
    zigzag = layout.cp > 1 and layout.cp_layout is CPLayout.ZIGZAG
    if layout.pad_policy is PadPolicy.MINIMAL:
        return 2 * layout.cp if zigzag else 1
    align = layout.tp * layout.cp * (2 if zigzag else 1)  # verl / Megatron-Bridge
    return math.lcm(
        align, FP8_BLOCK[layout.fp8]
    )  # verl: every sequence also a multiple of the FP8 one


def local_ok(layout: ParallelLayout, rows_per_rank_total: int) -> bool:
    """SP scatter and FP8 constraints on a CP rank's row count: it splits evenly over the SP ranks,
    and what one SP rank holds is a multiple of the FP8 block (TE quantizes each rank's share)."""
    sp_tp = layout.tp if layout.sp else 1
    return (
        rows_per_rank_total % sp_tp == 0 and (rows_per_rank_total // sp_tp) % row_block(layout) == 0
    )


def brute_force_total(lengths, layout: ParallelLayout) -> int:
    """Smallest T a THD batch of ``lengths`` can have under ``layout``'s constraints, found by
    search: every P_i >= L_i a multiple of the per-sequence multiple m (so T >=
    sum(naive_round_up(L_i, m)) and T % m == 0), T % cp == 0, T/cp meets SP/FP8, T >=
    cp*min_local_rows, T a bucket."""
    m = required_seq_multiple(layout)
    start = max(sum(naive_round_up(n, m) for n in lengths), layout.cp * layout.min_local_rows)
    candidates = (
        (b for b in layout.length_buckets if b >= start)
        if layout.length_buckets
        else itertools.count(start)
    )
    for t in candidates:
        if t % m == 0 and t % layout.cp == 0 and local_ok(layout, t // layout.cp):
            return t
    raise AssertionError("no bucket fits")


def brute_force_bshd_length(lengths, layout: ParallelLayout) -> int:
    """Smallest row length S of a BSHD batch: S >= max L, zigzag S % 2cp (contiguous S % cp), S/cp
    meets SP per row and FP8 on B*S/(cp*sp), S >= cp*min_local_rows, S a bucket (PER_SEQUENCE: S % m
    too)."""
    b = len(lengths)
    zigzag = layout.cp > 1 and layout.cp_layout is CPLayout.ZIGZAG
    split = 2 * layout.cp if zigzag else layout.cp  # columns per CP chunk count
    per_seq = (
        layout.tp * split if layout.pad_policy is PadPolicy.PER_SEQUENCE else 1
    )  # FP8: on B*S/cp only
    sp_tp = layout.tp if layout.sp else 1
    start = max(max(lengths), layout.cp * layout.min_local_rows)
    candidates = (
        (x for x in layout.length_buckets if x >= start)
        if layout.length_buckets
        else itertools.count(start)
    )
    for s in candidates:
        if (
            s % split == 0
            and s % per_seq == 0
            and (s // layout.cp) % sp_tp == 0
            and (b * s // layout.cp // sp_tp) % row_block(layout) == 0
        ):
            return s
    raise AssertionError("no bucket fits")


def reference_sequence(sample: dict, padded_len: int, schema) -> dict:
    """One sequence padded to ``padded_len``: every TOKEN field as the docs define it."""
    ids = sample["input_ids"]
    n, pad = ids.numel(), padded_len - ids.numel()
    out = {
        "input_ids": torch.cat(
            (ids, torch.full((pad,), schema["input_ids"].pad_value, dtype=ids.dtype))
        ),
        "labels": torch.cat(
            (ids[1:], torch.full((pad + 1,), schema.ignore_index, dtype=ids.dtype))
        ),
        "position_ids": torch.arange(padded_len),
        "padding_mask": torch.arange(padded_len) >= n,
    }
    trained = out["labels"] != schema.ignore_index
    if "loss_mask" in sample:  # aligned with the tokens, so shifted like the labels
        trained &= torch.cat((sample["loss_mask"][1:], torch.zeros(pad + 1))).bool()
    out["loss_mask"] = trained.to(torch.float32)
    for name in TOPK_FIELDS:
        if name in sample:
            v = sample[name]
            out[name] = torch.cat(
                (v, torch.full((pad, *v.shape[1:]), schema[name].pad_value, dtype=v.dtype))
            )
    return out


def reference_thd(samples, padded, schema, layout: ParallelLayout, cp_rank: int | None) -> dict:
    """[T_out, ...] per field: sequences padded and packed, then the CP rule applied per sequence
    (zigzag: chunks r and 2cp-1-r of 2cp) or on the whole buffer (contiguous)."""
    seqs = [reference_sequence(s, int(p), schema) for s, p in zip(samples, padded)]
    out = {}
    for name in seqs[0]:
        parts = [s[name] for s in seqs]
        if cp_rank is not None and layout.cp > 1 and layout.cp_layout is CPLayout.ZIGZAG:
            parts = [
                torch.cat([c[cp_rank], c[2 * layout.cp - 1 - cp_rank]])
                for c in (p.chunk(2 * layout.cp) for p in parts)
            ]
        whole = torch.cat(parts)
        if cp_rank is not None and layout.cp > 1 and layout.cp_layout is CPLayout.CONTIGUOUS:
            whole = whole.chunk(layout.cp)[cp_rank]
        out[name] = whole
    return out


def reference_bshd(
    samples, seq_len: int, schema, layout: ParallelLayout, cp_rank: int | None
) -> dict:
    """[B, S_out, ...] per field: every row padded to ``seq_len`` then split as one THD sequence."""
    rows = [reference_thd([s], [seq_len], schema, layout, cp_rank) for s in samples]
    return {name: torch.stack([r[name] for r in rows]) for name in rows[0]}


def te_thd_partition_index(cu_padded: list[int], cp: int, r: int) -> torch.Tensor:
    """TransformerEngine's THD partition formula (REFERENCE.md), token by token: for local token k
    of sequence i, n = P_i/cp, idx = k - cu_padded[i]/cp, off = r if idx < n/2 else 2cp-2-r,
    src = idx + cu_padded[i] + (n/2)*off."""
    src = []
    for i in range(len(cu_padded) - 1):
        n = (cu_padded[i + 1] - cu_padded[i]) // cp
        for k in range(cu_padded[i] // cp, cu_padded[i + 1] // cp):
            idx = k - cu_padded[i] // cp
            off = r if idx < n // 2 else 2 * cp - 2 - r
            src.append(idx + cu_padded[i] + (n // 2) * off)
    return torch.tensor(src, dtype=torch.int64)


# ---- assertions shared by the THD and BSHD tests
# ---------------------------------------------------
def assert_fields_equal(batch: dict, expected: dict, *, leading: int) -> int:
    """Every field of ``expected`` equals the batch's, which has ``leading`` extra dims in front
    (THD: the batch dim of 1). Returns how many fields were compared."""
    for name, want in expected.items():
        if name not in batch:
            continue
        got = batch[name]
        assert got.shape == (*(1,) * leading, *want.shape), (name, got.shape, want.shape)
        assert torch.equal(got.reshape(want.shape), want.to(got.dtype)), name
    return sum(name in batch for name in expected)


def assert_labels_stay_in_sequence(
    ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor, lengths_of_slot: torch.Tensor
) -> int:
    """On an unsharded buffer (one sequence after another): label j is token j+1 of the same
    sequence, the last real token of each sequence and every pad hold the ignore index. Returns the
    number of sequence ends seen (the caller asserts it is > 0)."""
    real = positions < lengths_of_slot
    last = positions == lengths_of_slot - 1
    inner = real & ~last
    assert torch.equal(labels[:-1][inner[:-1]], ids[1:][inner[:-1]])
    assert not bool(inner[-1])  # the buffer never ends inside a sequence
    assert bool((labels[last | ~real] == IGNORE_INDEX).all())
    return int(last.sum())


# ---- strategies
# -------------------------------------------------------------------------------------
lengths_st = st.lists(st.one_of(st.integers(1, 24), st.integers(1, 4096)), min_size=1, max_size=6)
sizes_st = st.integers(1, 8)


@st.composite
def layout_st(draw, lengths, *, pad_policy=None, cp_layout=None, fp8=True, extras=True, bshd=False):
    """A valid ParallelLayout for ``lengths`` (buckets, when drawn, always fit the batch and are
    valid for both pad policies, so the same buckets compare MINIMAL with PER_SEQUENCE)."""
    tp, cp = draw(sizes_st), draw(sizes_st)
    kw = dict(
        tp=tp,
        cp=cp,
        sp=draw(st.sampled_from([None, None, False, True])),
        fp8=draw(st.sampled_from(list(FP8Recipe))) if fp8 else FP8Recipe.NONE,
        cp_layout=cp_layout or draw(st.sampled_from(list(CPLayout))),
        pad_policy=pad_policy or draw(st.sampled_from(list(PadPolicy))),
    )
    if extras:
        kw["min_local_rows"] = draw(st.sampled_from([0, 0, 1, draw(st.integers(0, 700))]))
    if extras and draw(st.booleans()):
        per = ParallelLayout(**{**kw, "pad_policy": PadPolicy.PER_SEQUENCE})
        m = per.total_multiple
        need = (
            per.bshd_length(max(lengths), len(lengths))
            if bshd
            else int(per.padded_lengths(torch.tensor(lengths)).sum())
        )
        top = naive_round_up(need, m) // m + draw(st.integers(0, 3))
        kw["length_buckets"] = tuple(
            sorted({top * m, *(m * k for k in draw(st.lists(st.integers(1, top), max_size=4)))})
        )
    return ParallelLayout(**kw)


@st.composite
def collate_case(draw, **layout_kw):
    """(lengths, layout, topk, options) for a property test of a collator; ``layout_kw`` as
    :func:`layout_st`. Options: a sample loss mask, and the blocked gather of large fields
    forced."""
    lengths = draw(lengths_st)
    return (
        lengths,
        draw(layout_st(lengths, **layout_kw)),
        draw(st.sampled_from([None, TOPK])),
        {"loss_mask": draw(st.booleans()), "blocked": draw(st.booleans())},
    )


def collate_case_batches(collator_cls, case):
    """Collate a :func:`collate_case` unsharded and on every CP rank:
    ``(lengths, layout, samples, schema, whole, shards)``."""
    lengths, layout, topk, options = case
    samples, schema = (
        make_samples(lengths, topk=topk, loss_mask=options["loss_mask"]),
        schema_for(topk),
    )
    with pytest.MonkeyPatch.context() as mp:
        if options[
            "blocked"
        ]:  # the path a field of >= 4 MiB takes on a CP rank, forced on small ones
            mp.setattr(prealign.collate.assemble, "BLOCK_MIN_BYTES", 0)
        whole = collator_cls(schema=schema, layout=layout)(samples)
        return (
            lengths,
            layout,
            samples,
            schema,
            whole,
            collate_ranks(collator_cls, schema, layout, samples),
        )


# ---- processes
# ----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker, world: int, *args) -> dict:
    """Run ``worker(rank, world, port, results, *args)`` in ``world`` processes (a free port on
    127.0.0.1 for their gloo group) and return ``results``, the dict each rank fills in."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(world, free_port(), results, *args), nprocs=world, join=True)
        return dict(results)


@pytest.fixture
def subprocess_env() -> dict:
    """Environment for a child Python: the installed ``prealign`` (never the checkout's root
    folders)."""
    return dict(os.environ)
