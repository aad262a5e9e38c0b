"""A stable fingerprint of a transform's configuration, part of every share key
(:class:`~prealign.loaders.handoff.batch_share.BatchShare`,
:class:`~prealign.loaders.handoff.media_share.SharedMediaTransform`): two jobs (or two loaders) with one
``run`` but differently configured transforms never read each other's results.

The fingerprint is, in order of preference:

- ``key`` when the caller gives one (``transform_key=``: the same on every CP peer, another for another
  configuration);
- the transform's qualified name, its ``index_key()`` when it has one, and a digest of its pickled state
  (protocol 4, sets and frozensets pickled sorted so that string hashing does not reorder them). Only
  ``pickle.dumps`` is run: nothing is ever unpickled;
- when it cannot be pickled (a lambda, a local class, an open handle): its qualified name and
  ``index_key()`` when it has one (``index_key`` must then name every setting the output depends on);
- else a :class:`~prealign.schemas.errors.ConfigError` naming the fix.

The fingerprint is taken once, in the process that sets the share up, and travels to the workers as a
string: a transform whose pickled state changes with use (a cache it fills) gives another fingerprint
on a rank that used it first, which then only stops sharing (never mixes results); give such a transform
an ``index_key()`` and ``__getstate__`` without the cache, or pass ``transform_key``.
"""
from __future__ import annotations

import hashlib
import io
import pickle

from prealign.schemas.errors import ConfigError


class _StablePickler(pickle.Pickler):
    """Pickles sets and frozensets in a fixed order (their iteration order depends on string hashing,
    randomised per process)."""

    def reducer_override(self, obj):
        if type(obj) in (set, frozenset):
            return type(obj), (sorted(obj, key=repr),)
        return NotImplemented


def transform_fingerprint(transform, *, owner: str, key: str | None = None) -> str:
    """The fingerprint of ``transform`` (see the module docstring); ``owner`` names the caller in errors."""
    if key is not None:
        if not isinstance(key, str) or not key:
            raise ConfigError(f"{owner}.transform_key: expected a non-empty str, got {key!r}")
        return f"key:{key}"
    if transform is None:
        return "none"
    named = transform if hasattr(transform, "__qualname__") else type(transform)  # a function, or an instance
    name = f"{named.__module__}.{named.__qualname__}"
    index_key = getattr(transform, "index_key", None)
    keyed = f"{name}:index_key={index_key()!s}" if callable(index_key) else name
    buf = io.BytesIO()
    try:
        _StablePickler(buf, protocol=4).dump(transform)
    except Exception as exc:  # (pickling raises PicklingError, AttributeError, TypeError, ...)
        if callable(index_key):
            return keyed
        raise ConfigError(
            f"{owner}: the transform {name} cannot be fingerprinted ({type(exc).__name__}: {exc}), so two jobs "
            f"with the same run but other settings could read each other's results. Give the transform an "
            f"index_key() method returning a str that names every setting its output depends on, or pass "
            f"transform_key='...' (the same on every CP peer, another for another configuration)") from None
    return f"{keyed}:pickle={hashlib.blake2b(buf.getvalue(), digest_size=16).hexdigest()}"
