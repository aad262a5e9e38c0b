"""What a sequence costs to train on, and dealing micro-batches so every DP rank's step costs the
same.

A sequence of ``L`` tokens costs ``linear * L + quadratic * L**2`` (:class:`CostModel`): the linear
term is the per-token work (projections, MLP, LM head), the quadratic one the attention scores. Only
ratios matter to the planner, so any unit works (:meth:`CostModel.from_hf_config` uses forward
FLOPs).

Dealing (:func:`balanced_steps`): the micro-batches of a pool of steps are grouped into rank-shares
of ``k`` micro-batches each by LPT with a cardinality cap (costliest micro-batch first, into the
cheapest share that still has room: the costliest micro-batches pair with the cheapest), then the
shares are sorted by cost and cut into steps of ``dp`` consecutive shares, so that the shares of one
step cost about the same. Micro-batches are never re-packed: the token budget stays the only cap on
their size.
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
    """Cost of one sequence of ``L`` tokens: ``linear * L + quadratic * L**2``, plus, for each
    ``(w, c)`` of ``windows`` (sliding-window attention layers, window ``w``), ``c * (m**2 + 2*w*(L
    - m))`` with ``m = min(L, w)``: quadratic up to the window, linear beyond it (all >= 0, finite).

    >>> CostModel(linear=24576, quadratic=1).of([1024, 4096]).tolist()
    [26214400.0, 117440512.0]
    >>> CostModel(linear=1, windows=((4, 1.0),)).of([2, 4, 8]).tolist()  # 2+4, 4+16, 8+16+32
    [6.0, 20.0, 56.0]
    """

    linear: float = 1.0
    quadratic: float = 0.0
    windows: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        for name in ("linear", "quadratic"):
            object.__setattr__(self, name, _finite(f"CostModel.{name}", getattr(self, name)))
        try:
            windows = tuple(
                (int(w), _finite("CostModel.windows[*] coefficient", c)) for w, c in self.windows
            )
        except (TypeError, ValueError):
            raise PlanError(
                f"CostModel.windows: expected (window, coefficient) pairs, got {self.windows!r}"
            ) from None
        if any(w < 1 for w, _ in windows):
            raise PlanError(f"CostModel.windows: expected windows >= 1, got {self.windows!r}")
        object.__setattr__(self, "windows", windows)
        if self.linear == 0 and self.quadratic == 0 and not any(c for _, c in windows):
            raise PlanError(
                "CostModel: linear and quadratic are both 0 (every sequence would cost nothing)"
            )

    def of(self, lengths) -> np.ndarray:
        """float64 ``[N]`` cost of each of ``lengths`` (int ``[N]``)."""
        n = np.asarray(lengths, dtype=np.float64)
        out = n * (self.linear + self.quadratic * n)
        for w, c in self.windows:
            m = np.minimum(n, w)
            out = out + c * (m * m + 2 * w * (n - m))
        return out

    def to_dict(self) -> dict:
        windows = (
            {"windows": [[w, c] for w, c in self.windows]} if self.windows else {}
        )  # (fingerprints of before)
        return {"linear": self.linear, "quadratic": self.quadratic, **windows}

    @classmethod
    def from_hf_config(
        cls, cfg, *, causal: bool = True, lm_head: bool = True, gated: bool | None = None
    ) -> "CostModel":
        """Forward FLOPs of one sequence through a decoder described by a ``transformers`` config.

        A matmul ``[L, a] x [a, b]`` costs ``2*L*a*b``. With ``h`` the hidden size, ``n`` the
        layers, ``H`` the heads, ``d_qk`` / ``d_v`` the query-key / value head dims (``head_dim``
        for both; MLA: ``qk_nope_head_dim + qk_rope_head_dim`` and ``v_head_dim``), ``q = H*d_qk``,
        ``kv = kv_heads*d_qk`` and ``V`` the vocabulary, per token and layer::

            Q, K, V projections   2*h*(q + 2*kv)
                MLA: 2*h*r_q + 2*r_q*q (2*h*q without a q LoRA) + 2*h*(r_kv + rope)
                     + 2*r_kv*H*(nope + d_v)
            attention output      2*H*d_v*h
            MLP                   2*m*h*f    m = 3 gated (SwiGLU / GeGLU: gate, up, down), else 2
            MoE layer             2*m*h*(f_e*k + f_s) + 2*h*E (+ 2*h for Qwen's shared-expert gate)

        ``f`` the dense width (``intermediate_size``); a MoE layer's token visits ``k`` of ``E``
        experts of width ``f_e`` (``moe_intermediate_size``) plus shared experts of total width
        ``f_s``. Which layers are MoE follows the model's own rule: ``first_k_dense_replace`` and
        ``moe_layer_freq`` (DeepSeek), ``mlp_only_layers`` and ``decoder_sparse_step`` (Qwen-MoE);
        other MoE layouts (``moe_layers``, ``interleave_moe_layer_step``, ``mlp_layer_types``) are a
        :class:`PlanError` naming the key. Once per token, the LM head ``2*h*V`` (``lm_head=False``
        leaves it out). The scores ``Q K^T`` and ``P V`` cost ``2*H*(d_qk + d_v)`` per (query, key)
        pair and layer; a causal kernel computes half the pairs (``quadratic = H*(d_qk + d_v)`` per
        layer, ``2*H*(d_qk + d_v)`` with ``causal=False``, what eager attention computes). A
        sliding-window layer (``layer_types`` "sliding_attention", or every layer when a config has
        ``sliding_window`` and no ``layer_types``, like Mistral) is causal over at most ``w`` keys:
        it goes into ``windows`` (quadratic up to ``w``, linear beyond); with ``causal=False`` it
        counts in full, as eager computes it. Other ``layer_types`` are a :class:`PlanError`.
        ``gated`` (None: read from the config: a SiLU / GLU activation or a Gemma model) picks
        ``m``. Backward costs about twice the forward in every term, so the ratio (all the planner
        uses) is that of a training step. Norms, rotary and activations are left out (a few per
        cent). verl's ``24576*L + L**2`` for a 7B model is this formula for Llama-2-7B (``h =
        4096``) with ``causal=False``, without the LM head, divided by ``4*n*h``, up to the MLP's
        width.

        >>> from types import SimpleNamespace
        >>> cfg = SimpleNamespace(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        ...                       intermediate_size=128, vocab_size=100, hidden_act="silu")
        >>> CostModel.from_hf_config(cfg, lm_head=False)
        CostModel(linear=163840.0, quadratic=256.0, windows=())
        """
        try:
            return cls._from_hf_config(cfg, causal=causal, lm_head=lm_head, gated=gated)
        except (TypeError, ValueError, OverflowError, ZeroDivisionError, AttributeError) as exc:
            if isinstance(exc, PlanError):
                raise
            raise PlanError(
                f"CostModel.from_hf_config: the config's sizes are not positive ints "
                f"({type(exc).__name__}: {exc}); give a transformers config of a decoder"
            ) from None

    @classmethod
    def _from_hf_config(
        cls, cfg, *, causal: bool, lm_head: bool, gated: bool | None
    ) -> "CostModel":
        cfg = getattr(cfg, "text_config", None) or cfg
        h = int(_attr(cfg, "hidden_size", "n_embd", "d_model"))
        layers = int(_attr(cfg, "num_hidden_layers", "n_layer", "num_layers"))
        heads = int(_attr(cfg, "num_attention_heads", "n_head", "num_heads"))
        projections, pair = _attention_flops(cfg, h, heads)
        if gated is None:
            act = str(
                _attr(cfg, "hidden_act", "hidden_activation", "activation_function", default="gelu")
            )
            gemma = str(getattr(cfg, "model_type", "")).startswith(
                "gemma"
            )  # GeGLU under a gelu name
            gated = "glu" in act or act in ("silu", "swish") or gemma
        mlp = _mlp_flops(cfg, h, layers, 3 if gated else 2)
        linear = (
            layers * projections
            + sum(mlp)
            + (2 * h * int(_attr(cfg, "vocab_size")) if lm_head else 0)
        )
        if not causal:  # eager: every pair of every layer, windowed or not
            return cls(linear=float(linear), quadratic=float(layers * pair))
        windows = _windows(cfg, layers)
        full = sum(w is None for w in windows)
        merged: dict[int, float] = {}
        for w in windows:
            if w is not None:
                merged[w] = merged.get(w, 0.0) + pair / 2
        return cls(
            linear=float(linear),
            quadratic=float(full * pair / 2),
            windows=tuple(sorted(merged.items())),
        )


def _finite(name: str, value) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not np.isfinite(value)
        or value < 0
    ):
        raise PlanError(f"{name}: expected a finite number >= 0, got {value!r}")
    return float(value)


def _attention_flops(cfg, h: int, heads: int) -> tuple[int, int]:
    """(FLOPs per token of one layer's Q/K/V/output projections, FLOPs per (query, key) pair of its
    scores)."""
    if getattr(
        cfg, "kv_lora_rank", None
    ):  # MLA (DeepSeek-V2/V3): low-rank K/V (and Q), split rope dims
        nope, rope = int(_attr(cfg, "qk_nope_head_dim")), int(_attr(cfg, "qk_rope_head_dim"))
        d_v, r_kv, r_q = (
            int(_attr(cfg, "v_head_dim")),
            int(cfg.kv_lora_rank),
            getattr(cfg, "q_lora_rank", None),
        )
        q = heads * (nope + rope)
        q_proj = 2 * h * int(r_q) + 2 * int(r_q) * q if r_q else 2 * h * q
        kv_proj = 2 * h * (r_kv + rope) + 2 * r_kv * heads * (nope + d_v)
        return q_proj + kv_proj + 2 * heads * d_v * h, 2 * heads * (nope + rope + d_v)
    kv_heads = int(_attr(cfg, "num_key_value_heads", default=heads))
    head_dim = int(_attr(cfg, "head_dim", default=h // heads))
    q, kv = heads * head_dim, kv_heads * head_dim
    return 2 * h * (q + 2 * kv) + 2 * q * h, 4 * q


def _mlp_flops(cfg, h: int, layers: int, m: int) -> list[int]:
    """FLOPs per token of each layer's MLP (dense or MoE, by the model's own rule)."""
    dense = 2 * m * h * int(_attr(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * h))
    visited = getattr(cfg, "num_experts_per_tok", None)
    if not visited:
        return [dense] * layers
    for key in ("moe_layers", "interleave_moe_layer_step", "mlp_layer_types"):
        if getattr(cfg, key, None) not in (None, 1):
            raise PlanError(
                f"from_hf_config: cannot model which layers are MoE from "
                f"{key}={getattr(cfg, key)!r}; "
                "pass CostModel(linear=, quadratic=) yourself"
            )
    width = int(getattr(cfg, "moe_intermediate_size", None) or _attr(cfg, "intermediate_size"))
    shared = int(getattr(cfg, "shared_expert_intermediate_size", None) or 0)
    shared_gate = 2 * h if shared else 0  # Qwen-MoE's sigmoid gate on the shared expert
    shared += width * int(getattr(cfg, "n_shared_experts", None) or 0)
    experts = int(_attr(cfg, "num_experts", "num_local_experts", "n_routed_experts"))
    moe = 2 * m * h * (width * int(visited) + shared) + 2 * h * experts + shared_gate
    first_dense = int(getattr(cfg, "first_k_dense_replace", None) or 0)
    freq = int(getattr(cfg, "moe_layer_freq", None) or 1)
    only_mlp = set(getattr(cfg, "mlp_only_layers", None) or ())
    step = int(getattr(cfg, "decoder_sparse_step", None) or 1)
    return [
        moe
        if i >= first_dense and i % freq == 0 and i not in only_mlp and (i + 1) % step == 0
        else dense
        for i in range(layers)
    ]


def _windows(cfg, layers: int) -> list[int | None]:
    """Each layer's attention window (None: full causal attention)."""
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        on = window is not None and getattr(cfg, "use_sliding_window", True) is not False
        return [int(window) if on else None] * layers
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown or len(types) != layers or ("sliding_attention" in types and not window):
        raise PlanError(
            f"from_hf_config: cannot model layer_types {unknown or list(types)[:8]} "
            f"(sliding_window="
            f"{window!r}, {layers} layers); pass CostModel(linear=, quadratic=, windows=) yourself"
        )
    return [int(window) if t == "sliding_attention" else None for t in types]


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
        steps.append([bins[j] for s in order[i : i + dp] for j in members[s]])
    return steps
