"""Loader state: small, versioned, JSON-friendly; resume by replaying the deterministic plan.

The state is the same on every rank of a run (no rank id in it): save it once, load it everywhere.

    {"version": 1, "kind": "prealign.PackedLoader", "epoch": 3, "position": 17,
     "config": {"seed": 0, "shuffle": true, "dp_size": 4, "token_budget": 8192,
                "layout": {...}, "schema": "<fingerprint>", "planner": {...}, "shuffle_window": 1024},
     "data": {"num_samples": 7473, "digest": "<16 hex>"}}
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from .errors import ResumeError

STATE_VERSION = 1
STATE_KIND = "prealign.PackedLoader"

_WHY = {
    "dp_size": "micro-batches are dealt to dp_size ranks; another dp_size would repeat or lose samples",
    "layout": "the layout sets the padded lengths, so the plan (which samples fit together) changes",
    "token_budget": "the budget sets which samples fit together",
    "schema": "batches would not have the saved run's fields",
    "planner": "another planner configuration gives another plan",
    "seed": "another seed gives another sample order",
    "shuffle": "another sample order",
    "shuffle_window": "another sample order",
}


@dataclass(frozen=True, kw_only=True)
class LoaderState:
    """Where a loader stands: ``position`` micro-batches of ``epoch`` already yielded on every rank."""

    epoch: int
    position: int
    config: dict
    data: dict

    def to_dict(self) -> dict:
        return {"version": STATE_VERSION, "kind": STATE_KIND, "epoch": self.epoch, "position": self.position,
                "config": self.config, "data": self.data}

    @classmethod
    def from_dict(cls, state) -> "LoaderState":
        if isinstance(state, (str, bytes)):
            state = json.loads(state)
        if not isinstance(state, dict) or state.get("kind") != STATE_KIND:
            raise ResumeError(f"not a {STATE_KIND} state: {str(state)[:200]}")
        if state.get("version") != STATE_VERSION:
            raise ResumeError(f"state version {state.get('version')!r} is not supported (this prealign writes "
                              f"and reads version {STATE_VERSION})")
        try:
            epoch, position = int(state["epoch"]), int(state["position"])
            config, data = dict(state["config"]), dict(state["data"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ResumeError(f"malformed loader state ({type(exc).__name__}: {exc})") from None
        if epoch < 0 or position < 0:
            raise ResumeError(f"malformed loader state: epoch {epoch}, position {position}")
        return cls(epoch=epoch, position=position, config=config, data=data)

    def check_compatible(self, config: dict, data: dict) -> None:
        """Raise :class:`ResumeError` listing every difference with this run's ``config`` / ``data``."""
        problems = []
        for key in sorted(set(config) | set(self.config)):
            saved, here = self.config.get(key), config.get(key)
            if saved != here:
                problems.append(f"{key}: saved {saved!r}, this run {here!r} ({_WHY.get(key, 'changes the plan')})")
        for key in sorted(set(data) | set(self.data)):
            if self.data.get(key) != data.get(key):
                problems.append(f"data {key}: saved {self.data.get(key)!r}, this run {data.get(key)!r} "
                                f"(the source or its transform changed)")
        if problems:
            raise ResumeError("cannot resume this loader state:\n  " + "\n  ".join(problems) +
                              "\nresume with the saved run's configuration, or start a fresh loader")
