"""The offline stand-ins the family reference modules build transformers' pieces with (no download,
no torchvision): a one-token-per-character tokenizer, an image processor class by its PIL backend's
name, and a processor built with its video slot's class check skipped."""

from __future__ import annotations

import contextlib
import importlib


def char_tokenizer(specials, words=(), *, split: str = r"[\s\S]", **tokens):
    """A ``PreTrainedTokenizerFast`` of one token per printable ASCII character and ``"\\n"`` (so
    any split of a text encodes the same), ``specials`` first and ``words`` (e.g. ``"\\n\\n"``,
    matched by the ``split`` regex) last; ``tokens``: its ``unk_token``, ``eos_token``, ... by
    name."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = tuple(chr(c) for c in range(32, 127)) + ("\n",)
    vocab = {w: i for i, w in enumerate(tuple(specials) + chars + tuple(words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(split), behavior="isolated")
    tok.add_special_tokens(list(specials))
    return PreTrainedTokenizerFast(tokenizer_object=tok, **tokens)


def image_processor_class(name: str):
    """transformers' ``<name>ImageProcessorPil`` (the PIL backend, 5.10 on), else
    ``<name>ImageProcessor`` (older releases, where that one is PIL-based)."""
    transformers = importlib.import_module("transformers")
    try:
        return getattr(transformers, f"{name}ImageProcessorPil")
    except (AttributeError, ImportError):  # pragma: no cover
        return getattr(transformers, f"{name}ImageProcessor")


@contextlib.contextmanager
def any_video_processor():
    """Within: a processor's class check of its ``video_processor`` argument is skipped
    (transformers' video processors need torchvision, absent here: ``None`` or a stand-in goes in
    that slot); every other argument is checked as usual."""
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class

    def lenient(self, name, arg):
        return None if name == "video_processor" else check(self, name, arg)

    ProcessorMixin.check_argument_for_proper_class = lenient
    try:
        yield
    finally:
        ProcessorMixin.check_argument_for_proper_class = check
