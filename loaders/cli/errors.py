"""How the ``prealign`` command reports a person's mistake: one line on stderr, exit code 2.

    prealign: error: --tp: expected a positive int, got 0 (hint: --tp and --cp take ints >= 1)

:class:`UsageError` carries its own hint; any other :class:`~prealign.schemas.errors.PrealignError`
gets one from its class (:func:`hint_for`). When no sample loads, :class:`NothingLoadedError` adds
one line per cause, each with an example, under the error line.

>>> error_lines(UsageError("no such file: a.tar", hint="check the path"))
['prealign: error: no such file: a.tar (hint: check the path)']
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings

from prealign.loaders.errors import (
    CorruptShardError,
    RemoteReadError,
    RemoteStallError,
    ShardTimeoutError,
    WorkerError,
)
from prealign.schemas.errors import (
    ConfigError,
    DataError,
    LayoutError,
    PrealignError,
    SampleError,
    SchemaError,
)


class UsageError(ConfigError):
    """A command-line mistake (an argument, a path); ``hint`` says how to fix it."""

    def __init__(self, message: str, *, hint: str = ""):
        self.hint = hint
        super().__init__(message)


# What each cause a bad-data report counts means, in words (reasons not listed are shown as they
# are).
CAUSES = {
    "corrupt_shard": "unreadable shard (missing, truncated, compressed or not a tar file)",
    "missing_member": "a member the samples need is absent",
    "bad_sample": "decoded, but refused by the transform or the schema (dtype, shape, values)",
    "unsafe_member": "a member format that can run code when loaded (pickle): refused",
    "dim_mismatch": "a named dim (K, ...) differs from the first sample's",
    "corrupt_image": "an image that does not decode",
    "missing_image": "an image the chat names is absent",
    "placeholder_mismatch": "<image> placeholders and images do not match in number",
    "vision_token_mismatch": "image token runs do not match image_grid_thw",
    "bad_text": "no usable chat or text",
}


# What to do about each cause, as a person would type it (the closing hint when nothing loads).
REMEDIES = {
    "corrupt_shard": "re-create the unreadable shards named below, or leave them out of the list",
    "shard_timeout": "check the mount or pipe the shards named below are read from",
    "missing_member": "write the member the samples lack (or leave those samples out)",
    "bad_sample": "write the field as the schema expects it (the example names the field, what it "
    "expects and what came), or give the transform that makes it so",
    "unsafe_member": "re-write the pickled members as .npy / .json",
    "dim_mismatch": "give every sample the same named dims (e.g. one top-k K)",
    "corrupt_image": "re-encode or drop the images named below",
    "missing_image": "add the image members the chats name",
    "placeholder_mismatch": "write one <image> placeholder per image",
    "vision_token_mismatch": "index with the model's own processor settings (--processor DIR "
    "--model-config DIR)",
    "bad_text": "give each sample a chat (json) or a text member",
}


def remedy(report) -> str:
    """The closing hint of a bad-data report: what to do about its two most frequent causes."""
    causes = [r for r, _ in sorted(report.counts.items(), key=lambda kv: -kv[1])][:2]
    fixes = [
        REMEDIES.get(r, f"fix the samples counted as {r} (an example of each below)")
        for r in causes
    ]
    return "; ".join(dict.fromkeys(fixes))


class NothingLoadedError(DataError):
    """No sample of the source could be used; ``report`` (a ``BadDataReport``) says why."""

    def __init__(self, what: str, report):
        self.report = report
        counts = (
            ", ".join(f"{k} {v}" for k, v in sorted(report.counts.items())) or "no samples at all"
        )
        self.hint = remedy(report) if report.total else "give shards or a dataset that hold samples"
        super().__init__(f"no usable sample in {what}: {counts}")

    def cause_lines(self) -> list[str]:
        return cause_lines(self.report)


def cause_lines(report, limit: int = 110) -> list[str]:
    """One line per cause of a ``BadDataReport`` (most frequent first): the count and what it means,
    then a line with its first example (sample and message)."""
    first: dict[str, tuple[str, str]] = {}
    for rec in report.examples:
        first.setdefault(rec.reason, (rec.where, rec.message))
    out = []
    for reason, n in sorted(report.counts.items(), key=lambda kv: -kv[1]):
        out.append(f"  {reason} ({n}): {CAUSES.get(reason, reason.replace('_', ' '))}")
        if reason in first:
            where, message = first[reason]
            out.append(f"      e.g. {_clip(_strip(message, where, reason), limit)}")
    return out


def hint_for(exc: BaseException) -> str:
    """The hint shown after an error of this class (the command line's spelling of it)."""
    if (
        getattr(exc, "token_budget", None) is not None
    ):  # an OversizeSampleError: the flags, not the kwargs
        return (
            f"give --token-budget {exc.token_budget} (the longest sample fits), or --oversize "
            f"truncate (or skip)"
        )
    if getattr(exc, "hint", ""):
        return exc.hint
    if isinstance(exc, LayoutError):
        return _layout_hint(str(exc))
    if isinstance(exc, SchemaError):
        return "check --topk and --vocab-size"
    if isinstance(exc, FileNotFoundError):
        return "check the path"
    if isinstance(exc, PermissionError):
        return "choose a path you can read and write"
    if isinstance(exc, ImportError):
        return (
            "install the missing package (remote shards: pip install 'prealign[remote]', gs:// "
            "also gcsfs)"
        )
    if isinstance(exc, ConfigError):
        return "check the arguments (prealign <command> --help)"
    if isinstance(exc, SYSTEM_HINTS):
        return next(h for cls, h in _SYSTEM_HINTS if isinstance(exc, cls))
    if isinstance(exc, SampleError):
        return (
            "fix or drop that sample; under BadDataPolicy(on_error='skip') it is counted and "
            "left out instead"
        )
    return "run with --debug for the traceback"


def _layout_hint(message: str) -> str:
    """The hint of a :class:`LayoutError` (its message opens with what is wrong): ``--tp`` and
    ``--cp`` are the command line's only layout flags."""
    if message.startswith(("tp:", "cp:")):
        return "--tp and --cp take ints >= 1 (sp is on when tp > 1)"
    if message.startswith("total multiple"):  # valid ints, but the shortest batch is too long
        return (
            "give a smaller --tp or --cp: the shortest batch, a multiple of tp*cp and of 2*cp, "
            "must fit int32 cu_seqlens"
        )
    return "check the arguments (prealign <command> --help)"


_SYSTEM_HINTS = (  # most specific first
    (
        RemoteStallError,
        "the server stopped sending: check it and the network, or raise RemoteOptions(timeout=)",
    ),
    (RemoteReadError, "check the server and the network, then run again"),
    (ShardTimeoutError, "check the mount or pipe the shard is read from, or raise read_timeout="),
    (CorruptShardError, "re-create the shard, or leave it out of the list"),
    (
        WorkerError,
        "run again (it continues from its state); give --workers 0 to see a worker's own error",
    ),
)
SYSTEM_HINTS = tuple(cls for cls, _ in _SYSTEM_HINTS)


def warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` for the command line: one ``prealign: warning: <Category>:
    <message>`` line on stderr, without the library's file and source line; a progress bar's open
    line is ended first."""
    stream = file or sys.stderr
    text = "; ".join(part.strip() for part in str(message).splitlines() if part.strip())
    if OPEN_LINE[0]:
        stream.write("\n")
        OPEN_LINE[0] = False
    stream.write(f"prealign: warning: {category.__name__}: {text}\n")


OPEN_LINE = [False]
"""True while a progress bar's line on stderr is not ended (a warning then starts a line of its
own)."""


def error_lines(exc: BaseException) -> list[str]:
    """``prealign: error: <message> (hint: <hint>)`` on one line, then any cause lines."""
    text = (
        "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        or type(exc).__name__
    )
    lines = [f"prealign: error: {text} (hint: {hint_for(exc)})"]
    if isinstance(exc, NothingLoadedError):
        lines += exc.cause_lines()
    return lines


def run_reporting(parser, argv: list[str]) -> int:
    """Parse ``argv`` with ``parser`` and run the command it names (``args.func(args)``); a person's
    mistake or unusable input (a :class:`PrealignError`, an ``OSError``, a missing optional package)
    becomes :func:`error_lines` on stderr and exit code 2, with the traceback when ``--debug`` is
    among ``argv``."""
    try:
        args = parser.parse_args(argv)
        with warnings.catch_warnings():
            warnings.showwarning = warning_line
            return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (PrealignError, OSError, ImportError) as exc:
        if "--debug" in argv:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.write("\n".join(error_lines(exc)) + "\n")
        return 2


def _strip(message: str, where: str, reason: str) -> str:
    """``message`` without the prefixes a bad-data report repeats (``reason: ``, ``sample <where>,
    ``), naming the sample by its base name."""
    message = message.removeprefix(f"{reason}: ")
    for lead in (f"sample {where}, ", f"sample {where}: "):
        if message.startswith(lead):
            message = message[len(lead) :]
    return (
        f"{os.path.basename(where)}: {message}"
        if where and not where.startswith("shard ")
        else message
    )


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
