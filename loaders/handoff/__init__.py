"""Hand-off between processes: recycled shared-memory slots, the worker -> main batch transport, the
node-local share folder, and the two sharing schemes built on it (``BatchShare``,
``SharedMediaTransform``). The protocol and its invariants: ``PROTOCOL.md`` beside this file.

Layer rules (which layer may import which): ``loaders/README.md``."""
