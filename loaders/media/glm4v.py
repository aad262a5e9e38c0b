"""GLM-4.1V / 4.5V samples (:mod:`prealign.collate.vision.glm4v` holds the rules): the token names
its tokenizer uses, transformers' GLM-4.1V image processor, for the transform's Qwen-style path
(grids, mRoPE), and GLM's own chat frame (:class:`GlmChatFrame`: ``[gMASK]<sop>``, ``<|user|>`` ...
role tags, GLM-4.5V's think block)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

TOKEN_NAMES = {
    "im_start": None,
    "im_end": None,
    "vision_start": "<|begin_of_image|>",
    "vision_end": "<|end_of_image|>",
    "image_pad": "<|image|>",
    "video_pad": "<|video|>",
}
""":class:`~prealign.loaders.media.chat_tokenizer.HFChatTokenizer` names of GLM-4.1V's media tokens
(no ``<|im_start|>`` / ``<|im_end|>``: :class:`GlmChatFrame` writes GLM's role tags as the
template's text)."""


@functools.lru_cache(maxsize=4)
def _processor(options: tuple):
    try:  # transformers >= 5 without torchvision: the PIL backend
        from transformers import Glm4vImageProcessorPil as cls
    except ImportError:  # pragma: no cover - older transformers
        from transformers import Glm4vImageProcessor as cls
    return cls(**dict(options))


def glm4v_image_processor(**options):
    """transformers' GLM-4.1V image processor with its defaults, overridden by ``options``; cached
    per process."""
    return _processor(tuple(sorted(options.items())))


GLM_ROLES = ("system", "user", "assistant")
"""The roles GLM-4.1V / 4.5V's chat templates write (any other turn they drop: refused here, never
dropped)."""


@dataclass(frozen=True)
class GlmChatFrame:
    """GLM-4.1V / 4.5V's chat frame, as their chat templates render a conversation (no generation
    prompt): ``[gMASK]<sop>``, then per turn its role tag (``<|system|>``, ``<|user|>``,
    ``<|assistant|>``), ``"\\n"`` and the content; no end-of-turn token (the next role tag ends a
    turn; generation stops at ``<|user|>``).

    ``thinking`` (GLM-4.5V / 4.6V): an assistant turn is ``<|assistant|>`` +
    ``"\\n<think>{reasoning}</think>"`` (empty unless the turn comes after the last user turn and
    has reasoning: its ``reasoning_content``, or the text of its content up to ``</think>``) +
    ``"\\n" + content.strip()`` when that is not empty.

    :meth:`pieces` lists ``(text, trained, content)``: ``content`` texts hold ``<image>`` /
    ``<video>`` placeholders. Trained: each reply (after the ``"\\n"`` GLM-4.1V's generation prompt
    holds; with ``thinking`` its think block too) and the role tag that follows a reply (the model's
    stop). The last reply has no tag after it, as the template writes none.

    >>> [t for t, *_ in GlmChatFrame().pieces([{"role": "user", "content": "hi"},
    ...                                       {"role": "assistant", "content": "yo"}])]
    ['[gMASK]<sop>', '<|user|>', '\\n', 'hi', '<|assistant|>', '\\n', 'yo']
    """

    thinking: bool = False
    roles = GLM_ROLES

    @property
    def name(self) -> str:
        return "glm4.5v" if self.thinking else "glm4.1v"

    def pieces(self, turns: list[dict]) -> list[tuple[str, bool, bool]]:
        out = [("[gMASK]<sop>", False, False)]
        last_user = max((i for i, t in enumerate(turns) if t["role"] == "user"), default=-1)
        after_reply = False
        for i, turn in enumerate(turns):
            role, content = turn["role"], turn["content"]
            out.append((f"<|{role}|>", after_reply, False))
            after_reply = role == "assistant"
            if not after_reply:
                out += [("\n", False, False), (content, False, True)]
            elif not self.thinking:
                out += [("\n", False, False), (content, True, True)]
            else:
                out += self._thinking_reply(turn, content, i > last_user)
        return out

    @staticmethod
    def _thinking_reply(
        turn: dict, content: str, after_last_user: bool
    ) -> list[tuple[str, bool, bool]]:
        reasoning = turn.get("reasoning_content")
        if not isinstance(reasoning, str):
            reasoning = ""
            if "</think>" in content:
                reasoning = (
                    content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                )
                content = content.split("</think>")[-1].lstrip("\n")
        think = reasoning.strip() if after_last_user and reasoning else ""
        out = [(f"\n<think>{think}</think>", True, False)]
        if content.strip():
            out += [("\n", True, False), (content.strip(), True, True)]
        return out


def chat_frame(family, name: str | None = None) -> GlmChatFrame | None:
    """The chat frame a family's samples are rendered in: ``name`` (``"glm4.1v"``, ``"glm4.5v"``,
    ``"chatml"``) where given, else the family's: GLM-4.1V (``glm4v``) without thinking, GLM-4.5V /
    4.6V (``glm4v_moe``) with; ``None``: the ``<|im_start|>`` frame
    :func:`~prealign.loaders.media.vlm.render_chat` writes itself."""
    model_type = getattr(family, "model_type", "")
    if name is None:
        name = {"glm4v": "glm4.1v", "glm4v_moe": "glm4.5v"}.get(model_type, "chatml")
    frames = {"chatml": None, "glm4.1v": GlmChatFrame(), "glm4.5v": GlmChatFrame(thinking=True)}
    if name not in frames:
        from prealign.schemas.errors import ConfigError

        raise ConfigError(f"chat_frame: expected one of {sorted(frames)}, got {name!r}")
    return frames[name]
