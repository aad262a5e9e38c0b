"""Media: the VLM sample transform (processor, placeholders, positions), chat rendering and teacher
top-k members.

Layer rules (which layer may import which): ``loaders/README.md``."""
