"""Indexing: the index pass (lengths and locations of every sample, bad-data policy),
``SampleIndex``, the per-shard sidecar format and its checks, and the header-only pass that writes
sidecars.

Layer rules (which layer may import which): ``loaders/README.md``."""
