"""A transform's fingerprint, part of every share key
(:class:`~prealign.loaders.handoff.batch_share.BatchShare`,
:class:`~prealign.loaders.handoff.media_share.SharedMediaTransform`): two jobs (or two loaders) with
one ``run`` but another transform (other code, other settings, other module globals it reads) never
read each other's results.

The fingerprint is ``key`` when the caller gives one (``transform_key=``: the same on every CP peer,
another for another configuration), else the digest of the transform's identity
(:func:`~prealign.loaders.handoff.identity.identity_fields`: its code, the globals it reads, its
state; the same in every process), the same identity a sidecar's key is a digest of. A transform
with no stable form (an open handle in its state) is a :class:`~prealign.schemas.errors.ConfigError`
naming it and the fix, never guessed.

The fingerprint is taken once, in the process that sets the share up, and travels to the workers as
a string: a transform whose state changes with use (a cache it fills) gives another fingerprint on a
rank that used it first, which then only stops sharing (never mixes results); give such a transform
``__getstate__`` without the cache (or ``identity_fields()``), or pass ``transform_key``.
"""

from __future__ import annotations

from prealign.loaders.handoff.identity import checked_identity_fields, identity_digest
from prealign.schemas.errors import ConfigError


def transform_fingerprint(transform, *, owner: str, key: str | None = None) -> str:
    """The fingerprint of ``transform`` (see the module docstring); ``owner`` names the caller in
    errors."""
    if key is not None:
        if not isinstance(key, str) or not key:
            raise ConfigError(f"{owner}.transform_key: expected a non-empty str, got {key!r}")
        return f"key:{key}"
    fields = checked_identity_fields(transform, owner=owner)
    return f"{fields['transform']}:{identity_digest(fields)}"
