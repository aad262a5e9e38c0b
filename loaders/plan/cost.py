"""What a sequence costs to train on, and dealing micro-batches so every DP rank's step costs the same.

A sequence of ``L`` tokens costs ``linear * L + quadratic * L**2`` (:class:`CostModel`): the linear
term is the per-token work (projections, MLP, LM head), the quadratic one the attention scores. Only
ratios matter to the planner, so any unit works (:meth:`CostModel.from_hf_config` uses forward FLOPs).

Dealing (:func:`balanced_steps`): the micro-batches of a pool of steps are grouped into rank-shares of
``k`` micro-batches each by LPT with a cardinality cap (costliest micro-batch first, into the cheapest
share that still has room: the costliest micro-batches pair with the cheapest), then the shares are
sorted by cost and cut into steps of ``dp`` consecutive shares, so that the shares of one step cost
about the same. Micro-batches are never re-packed: the token budget stays the only cap on their size.
"""
from __future__ import annotations

import heapq
import numbers
from dataclasses import dataclass

import numpy as np

from prealign.loaders.errors import PlanError


def _attr(cfg, *names, default=None):
    """The first of ``names`` set on ``cfg`` (an HF config, its ``text_config`` for a VLM)."""
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    if default is not None:
        return default
    raise PlanError(f"from_hf_config: the config ({type(cfg).__name__}) has none of {list(names)}")


@dataclass(frozen=True)
class CostModel:
    """Cost of one sequence of ``L`` tokens: ``linear * L + quadratic * L**2`` (both >= 0, finite).

    >>> CostModel(linear=24576, quadratic=1).of([1024, 4096]).tolist()
    [26214400.0, 117440512.0]
    """

    linear: float = 1.0
    quadratic: float = 0.0

    def __post_init__(self):
        for name in ("linear", "quadratic"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not np.isfinite(value) or value < 0:
                raise PlanError(f"CostModel.{name}: expected a finite number >= 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.linear == 0 and self.quadratic == 0:
            raise PlanError("CostModel: linear and quadratic are both 0 (every sequence would cost nothing)")

    def of(self, lengths) -> np.ndarray:
        """float64 ``[N]`` cost of each of ``lengths`` (int ``[N]``)."""
        n = np.asarray(lengths, dtype=np.float64)
        return n * (self.linear + self.quadratic * n)

    def to_dict(self) -> dict:
        return {"linear": self.linear, "quadratic": self.quadratic}

    @classmethod
    def from_hf_config(cls, cfg, *, causal: bool = True, lm_head: bool = True, gated: bool | None = None) -> "CostModel":
        """Forward FLOPs of one sequence through a decoder described by a ``transformers`` config.

        With ``h`` the hidden size, ``n`` the layers, ``q = heads * head_dim``, ``kv = kv_heads *
        head_dim``, ``f`` the FFN width (``intermediate_size``; MoE: ``moe_intermediate_size`` times
        the experts each token visits, plus the shared experts) and ``V`` the vocabulary, a matmul
        ``[L, a] x [a, b]`` costs ``2*L*a*b``, so per token and layer::

            Q, K, V projections   2*h*(q + 2*kv)
            attention output      2*q*h
            MLP                   2*m*h*f      m = 3 gated (SwiGLU / GeGLU: gate, up, down), 2 otherwise
            MoE router            2*h*E        E routed experts (MoE configs only)
        and once per token the LM head ``2*h*V`` (``lm_head=False`` leaves it out). The attention
        scores ``Q K^T`` and ``P V`` cost ``2*L*L*q`` each per layer; a causal kernel computes half
        of them (``causal=True``), so ``quadratic = 2*n*q`` (``4*n*q`` with ``causal=False``).
        ``gated`` (None: read from the config: a SiLU / GLU activation or a Gemma model) picks ``m``.
        Backward costs about twice the forward in both terms, so the ratio (all the planner uses)
        is that of a training step. Norms, rotary and activations are left out (a few per cent).
        verl's ``24576*L + L**2`` for a 7B model is this formula for Llama-2-7B (``h = 4096``) with
        ``causal=False``, without the LM head, divided by ``4*n*h``, up to the MLP's width.

        >>> from types import SimpleNamespace
        >>> cfg = SimpleNamespace(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        ...                       intermediate_size=128, vocab_size=100, hidden_act="silu")
        >>> CostModel.from_hf_config(cfg, lm_head=False)
        CostModel(linear=163840.0, quadratic=256.0)
        """
        cfg = getattr(cfg, "text_config", None) or cfg
        h = int(_attr(cfg, "hidden_size", "n_embd", "d_model"))
        layers = int(_attr(cfg, "num_hidden_layers", "n_layer", "num_layers"))
        heads = int(_attr(cfg, "num_attention_heads", "n_head", "num_heads"))
        kv_heads = int(_attr(cfg, "num_key_value_heads", default=heads))
        head_dim = int(_attr(cfg, "head_dim", default=h // heads))
        q, kv = heads * head_dim, kv_heads * head_dim
        ffn = int(_attr(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * h))
        router = 0
        visited = getattr(cfg, "num_experts_per_tok", None)
        if visited:  # MoE in every layer: the experts a token visits, the shared ones, the router
            width = int(getattr(cfg, "moe_intermediate_size", None) or ffn)
            shared = int(getattr(cfg, "shared_expert_intermediate_size", None) or 0)
            shared += width * int(getattr(cfg, "n_shared_experts", None) or 0)
            ffn = width * int(visited) + shared
            router = 2 * h * int(_attr(cfg, "num_experts", "num_local_experts", "n_routed_experts"))
        if gated is None:
            act = str(_attr(cfg, "hidden_act", "hidden_activation", "activation_function", default="gelu"))
            gemma = str(getattr(cfg, "model_type", "")).startswith("gemma")  # GeGLU under a gelu name
            gated = "glu" in act or act in ("silu", "swish") or gemma
        per_layer = 2 * h * (q + 2 * kv) + 2 * q * h + 2 * (3 if gated else 2) * h * ffn + router
        linear = layers * per_layer + (2 * h * int(_attr(cfg, "vocab_size")) if lm_head else 0)
        return cls(linear=float(linear), quadratic=float((2 if causal else 4) * layers * q))


def balanced_steps(bins: list, costs: np.ndarray, dp: int, k: int) -> list[list]:
    """One pool of whole steps -> steps, each ``dp * k`` of ``bins`` in rank-major order (rank r's
    ``k`` micro-batches are ``step[r*k:(r+1)*k]``), the ``dp`` shares of a step as equal in cost as
    the pool allows. ``costs``: float64 ``[len(bins)]``; ``len(bins)`` a multiple of ``dp * k``.

    >>> balanced_steps(list("abcd"), np.array([4.0, 3.0, 2.0, 1.0]), dp=2, k=1)
    [['a', 'b'], ['c', 'd']]
    >>> balanced_steps(list("abcd"), np.array([4.0, 3.0, 2.0, 1.0]), dp=2, k=2)
    [['a', 'd', 'b', 'c']]
    """
    shares = len(bins) // k
    heap = [(0.0, s) for s in range(shares)]
    members: list[list[int]] = [[] for _ in range(shares)]
    total = np.zeros(shares)
    for j in np.argsort(-costs, kind="stable").tolist():  # LPT with at most k per share
        load, s = heapq.heappop(heap)
        members[s].append(j)
        total[s] = load + costs[j]
        if len(members[s]) < k:
            heapq.heappush(heap, (total[s], s))
    order = np.argsort(-total, kind="stable").tolist()
    steps = []
    for i in range(0, shares, dp):
        steps.append([bins[j] for s in order[i:i + dp] for j in members[s]])
    return steps
