"""prealign loaders: sources, token-budget micro-batch planning, DP-balanced packed loading."""
