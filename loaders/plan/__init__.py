"""Planning: bin packing under a token budget, the micro-batch planner (the same plan on every rank)
and the epoch schedule (order, one rank's requests, planned a chunk at a time).

Layer rules (which layer may import which): ``loaders/README.md``."""
