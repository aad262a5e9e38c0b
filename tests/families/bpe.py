"""A small byte-level BPE tokenizer trained on the spot (merges of newlines and spaces, so how a
text is split before encoding matters, as with real tokenizers) with a family's special tokens: what
the family tests build their processors on (no download)."""

from __future__ import annotations


def byte_bpe_tokenizer(specials: list[str], corpus: list[str], **tokens):
    """A ``PreTrainedTokenizerFast`` of 300 ids, ``specials`` first, trained on ``corpus``
    (repeated); ``tokens``: its ``bos_token``, ``eos_token``, ``pad_token``, ... by name."""
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\s*[\r\n]+|\s+(?!\S)|\s+|[^\s]+"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus * 50,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=specials,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **tokens)
