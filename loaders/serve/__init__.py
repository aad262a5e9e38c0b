"""Serving through torch's ``DataLoader``: worker recovery and the typed-error path out of workers.

Layer rules (which layer may import which): ``loaders/README.md``."""
