"""The per-model data contract: what a model needs from a packed batch, and which consumers can run
it.

A :class:`ModelContract` is declared by the model's family
(:class:`prealign.collate.vision.VisionFamily` class attributes, or
:func:`prealign.collate.model_contract` for any transformers config) and names

- ``position_kind``: ``"1d"`` (one position per token, restarting per sequence) or ``"mrope"``
  (Qwen-style 3-D positions ``mrope_position_ids`` as well);
- ``media_attention``: ``"causal"`` (image tokens attend like text) or ``"bidirectional"`` (each
  image's tokens see each other: Gemma 3 / 4; packing then needs a per-token mask, never
  ``cu_seqlens`` alone);
- ``local_attention``: ``None``, ``"sliding"`` (a window counted inside each sequence) or
  ``"chunked"`` (Llama 4: chunk boundaries counted from each sequence's start);
- ``linear_attention``: Gated DeltaNet / causal-conv layers (packed rows need ``seq_idx`` and
  ``cu_seq_lens``).

:meth:`ModelContract.fields` lists what the loader emits for it. A :class:`Consumer` is what runs
the batch: a Hugging Face model under one ``attn_implementation``, or megatron-core at one version.
:func:`check_consumer` refuses, with a :class:`ConsumerUnsupportedError` naming the model, the layer
kind, the installed version and the way out, what the consumer cannot run; ``check_startup(...,
contract=, consumer=)`` runs it on every rank before step 1.

=======================  ==============================================  ===========================
layer kind               HF (packed)                                     megatron-core (packed / CP)
=======================  ==============================================  ===========================
plain causal             every implementation                            yes / yes
bidirectional media      eager, sdpa (4-D mask per layer type),          refused (its THD attention
                         flex_attention (block mask); flash no           is causal only)
sliding window           every implementation                            yes / yes
chunked (Llama 4)        eager, sdpa (4-D mask per layer type, chunks    refused
                         counted per sequence), flex_attention
                         (mask_mod); flash no
linear (Gated DeltaNet)  with fla + causal-conv1d kernels and            refused through 0.16.x
                         transformers >= 5.10 (``to_hf_kwargs``)         (``GatedDeltaNet`` raises
                                                                         for packed_seq_params; CP
                                                                         must be 1)
=======================  ==============================================  ===========================
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError, PackingUnsupportedError

POSITION_KINDS = ("1d", "mrope")
MEDIA_ATTENTION = ("causal", "bidirectional")
LOCAL_ATTENTION = (None, "sliding", "chunked")
HF_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
MASK_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention")
"""HF attention implementations that take the per-token mask prealign emits (4-D or a flex block
mask)."""
GDN_KERNELS = ("fla", "causal_conv1d")
"""The packages whose kernels honour ``cu_seq_lens_q`` (``fla``'s chunked gated delta rule) and
``seq_idx`` (``causal_conv1d``); transformers' pure-torch fallbacks ignore both."""
GDN_MIN_TRANSFORMERS = (5, 10)
"""The oldest transformers checked to hand ``cu_seq_lens_q`` and ``seq_idx`` on to those kernels
(5.6 does not)."""
MEGATRON_GDN_PACKED = None
"""The first megatron-core release whose ``GatedDeltaNet`` takes ``packed_seq_params`` and context
parallelism: none released yet (0.16.1 raises ``NotImplementedError("GDN does not support packed
sequence for now.")`` and ``TransformerConfig`` asserts ``context_parallel_size == 1``). Set it to a
version tuple when one does."""


class ConsumerUnsupportedError(PackingUnsupportedError):
    """The consumer (an HF attention implementation, a megatron-core version) cannot run the model's
    batches as configured. ``.model``, ``.layer``, ``.consumer``, ``.version`` and ``.way_out`` say
    which, why and what to do."""

    model = layer = consumer = version = problem = way_out = (
        None  # when rebuilt from its message alone
    )

    def __init__(
        self, *, model: str, layer: str, consumer: str, version: str, problem: str, way_out: str
    ):
        self.model, self.layer, self.consumer, self.version = model, layer, consumer, version
        self.problem, self.way_out = problem, way_out
        super().__init__(
            f"{model}: its {layer} layers cannot run on {consumer} (installed {version}): "
            f"{problem}. Way out: {way_out}"
        )

    def details(self) -> dict:
        """The constructor's arguments (what ``check_startup`` posts to the other ranks)."""
        return {
            k: getattr(self, k)
            for k in ("model", "layer", "consumer", "version", "problem", "way_out")
        }


@dataclass(frozen=True, kw_only=True)
class ModelContract:
    """What one model needs from a packed batch (module docstring).

    >>> ModelContract(model="gemma3", media_attention="bidirectional",
    ...               local_attention="sliding").fields()
    ('position_ids', 'cu_seqlens_padded', 'attention_mask')
    """

    model: str
    position_kind: str = "1d"
    media_attention: str = "causal"
    local_attention: str | None = None
    linear_attention: bool = False
    bidirectional_layers: tuple[str, ...] | None = None
    """With bidirectional media: the layer types (``layer_types`` values) whose mask has the image
    blocks; ``None``: every layer (Gemma 3). Gemma 4 in transformers >= 5.17:
    ``("sliding_attention",)``."""
    media_over_window: bool = False
    """With bidirectional media and a sliding window: the image block is ORed over the windowed
    causal mask (``OR(AND(window, causal), block)``: an image token sees its whole image however
    long; Gemma 3 / 4 in transformers 5.6 to 5.16) rather than the window ANDed after it (``False``:
    ``AND(window, OR(causal, block))``, transformers >= 5.17)."""

    def __post_init__(self):
        for name, allowed in (
            ("position_kind", POSITION_KINDS),
            ("media_attention", MEDIA_ATTENTION),
            ("local_attention", LOCAL_ATTENTION),
        ):
            if getattr(self, name) not in allowed:
                raise ConfigError(
                    f"ModelContract({self.model}).{name}: expected one of {allowed}, "
                    f"got {getattr(self, name)!r}"
                )

    @property
    def needs_token_mask(self) -> bool:
        """Whether packed sequences need a per-token mask (``cu_seqlens`` alone is wrong)."""
        return self.media_attention == "bidirectional" or self.local_attention == "chunked"

    def fields(self) -> tuple[str, ...]:
        """The batch keys a packed consumer reads besides the tokens: positions
        (``mrope_position_ids`` too for mRoPE), the padded offsets, ``seq_idx`` for linear
        attention, a per-token ``attention_mask`` where
        :attr:`needs_token_mask`."""
        out = ("position_ids",) + (("mrope_position_ids",) if self.position_kind == "mrope" else ())
        out += ("cu_seqlens_padded",)
        if self.linear_attention:
            out += ("seq_idx",)
        if self.needs_token_mask:
            out += ("attention_mask",)
        return out

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "position_kind": self.position_kind,
            "media_attention": self.media_attention,
            "local_attention": self.local_attention,
            "linear_attention": self.linear_attention,
            **(
                {"bidirectional_layers": list(self.bidirectional_layers)}
                if self.bidirectional_layers
                else {}
            ),
            **({"media_over_window": True} if self.media_over_window else {}),
        }


@dataclass(frozen=True, kw_only=True)
class Consumer:
    """What runs the batches: ``kind`` ``"hf"`` with its ``attn_implementation``, or ``"megatron"``;
    ``version``: the installed package's (transformers / megatron-core), looked up when left
    ``None``.

    >>> Consumer.hf("sdpa").attn_implementation
    'sdpa'
    """

    kind: str
    attn_implementation: str | None = None
    version: str | None = None

    def __post_init__(self):
        if self.kind not in ("hf", "megatron"):
            raise ConfigError(f"Consumer.kind: expected 'hf' or 'megatron', got {self.kind!r}")
        if self.kind == "hf" and self.attn_implementation not in HF_IMPLEMENTATIONS:
            raise ConfigError(
                f"Consumer.hf: attn_implementation expected one of {HF_IMPLEMENTATIONS}, "
                f"got {self.attn_implementation!r}"
            )

    @classmethod
    def hf(cls, attn_implementation: str, version: str | None = None) -> "Consumer":
        return cls(kind="hf", attn_implementation=attn_implementation, version=version)

    @classmethod
    def megatron(cls, version: str | None = None) -> "Consumer":
        return cls(kind="megatron", version=version)

    def installed_version(self) -> str:
        """``version``, else the installed transformers' / megatron-core's (``"not installed"`` when
        absent)."""
        if self.version is not None:
            return self.version
        import importlib.metadata

        package = "transformers" if self.kind == "hf" else "megatron-core"
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    def describe(self) -> str:
        return (
            f"transformers attn_implementation={self.attn_implementation!r}"
            if self.kind == "hf"
            else "megatron-core"
        )


def hf_linear_attention_gap(transformers_version: str) -> str | None:
    """Why transformers ``transformers_version`` cannot keep packed sequences apart in Gated
    DeltaNet layers here (a kernel package not importable, or a release that does not hand them the
    offsets), else ``None``."""
    import importlib.util

    missing = [name for name in GDN_KERNELS if importlib.util.find_spec(name) is None]
    if missing:
        return f"{', '.join(missing)} not importable"
    version = tuple(int(p) for p in transformers_version.split(".")[:2] if p.isdigit())
    if version < GDN_MIN_TRANSFORMERS:
        return f"transformers {transformers_version} does not pass cu_seq_lens_q / seq_idx to them"
    return None


def check_consumer(
    contract: ModelContract, consumer: Consumer, *, packed: bool = True, cp: int = 1
) -> None:
    """Raise :class:`ConsumerUnsupportedError` where ``consumer`` cannot run ``contract``'s model
    with packed rows (``packed``) or context parallelism ``cp`` (module docstring's table); return
    otherwise."""
    version = consumer.installed_version()
    pkg = "transformers" if consumer.kind == "hf" else "megatron-core"

    def refuse(layer: str, problem: str, way_out: str):
        raise ConsumerUnsupportedError(
            model=contract.model,
            layer=layer,
            consumer=consumer.describe(),
            version=f"{pkg} {version}",
            problem=problem,
            way_out=way_out,
        )

    impl = consumer.attn_implementation
    if consumer.kind == "hf":
        if contract.media_attention == "bidirectional" and impl not in MASK_IMPLEMENTATIONS:
            refuse(
                "bidirectional image-attention",
                f"{impl} drops the bidirectional mask over each image's tokens "
                "(transformers sets _supports_flash_attn = False for this model), packed or not",
                "attn_implementation='sdpa' or 'eager' (prealign emits the per-layer 4-D masks: "
                "to_hf_kwargs(attention='mask', model_config=...)) or 'flex_attention'",
            )
        if packed and contract.local_attention == "chunked" and impl not in MASK_IMPLEMENTATIONS:
            refuse(
                "chunked local-attention",
                f"{impl} takes no chunked mask (transformers sets "
                "_supports_flash_attn = False for Llama 4), and varlen offsets alone give each "
                "sequence whole causal attention, not its chunks",
                "attn_implementation='sdpa' or 'eager' (prealign emits "
                "the per-sequence chunked masks: to_hf_kwargs(attention='mask', "
                "model_config=...)) or "
                "'flex_attention' (model_layer_masks(flex=True)), or packing off "
                "(ParallelLayout(max_seqs=1))",
            )
        gap = hf_linear_attention_gap(version) if packed and contract.linear_attention else None
        if gap:
            refuse(
                "Gated DeltaNet (linear_attention)",
                f"{gap}: its pure-torch path runs each packed sequence's "
                "recurrent and convolution state into the next",
                "install flash-linear-attention and "
                f"causal-conv1d (GPU) with transformers >= "
                f"{'.'.join(map(str, GDN_MIN_TRANSFORMERS))}, or "
                "packing off (ParallelLayout(max_seqs=1))",
            )
        return
    if contract.media_attention == "bidirectional" and packed:
        refuse(
            "bidirectional image-attention",
            "megatron-core's THD attention is causal only; it cannot "
            "take a bidirectional block per image",
            "packing off, or a Hugging Face consumer with "
            "attn_implementation='sdpa' / 'eager' / 'flex_attention'",
        )
    if contract.local_attention == "chunked" and packed:
        refuse(
            "chunked local-attention",
            "chunk boundaries must restart in every packed sequence",
            "packing off (ParallelLayout(max_seqs=1))",
        )
    if contract.linear_attention and MEGATRON_GDN_PACKED is None:
        if packed:
            refuse(
                "Gated DeltaNet (linear_attention)",
                "GatedDeltaNet.forward raises NotImplementedError('GDN does "
                "not support packed sequence for now.') for packed_seq_params",
                "packing off (BSHD batches from BSHDCollator, no packed_seq_params), or a "
                "megatron-core release whose GatedDeltaNet takes packed sequences",
            )
        if cp > 1:
            refuse(
                "Gated DeltaNet (linear_attention)",
                f"TransformerConfig asserts context_parallel_size == 1 "
                f"for gated_delta_net (layout cp={cp})",
                "cp=1, or a megatron-core release with context parallelism for Gated DeltaNet",
            )
