"""A sidecar's data signatures made a schema's (issue #20's review): the index from the sidecars,
from the merged index and from the in-process pass is one index under any schema; a value error is
its sample's alone, a structure error its signature's."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from prealign.loaders import BadDataPolicy, WebDatasetSource, build_index
from prealign.loaders.errors import BadSampleError
from prealign.loaders.index.header_pass import shape_pattern, write_sidecars
from prealign.loaders.index.merged import merge_sidecars
from prealign.loaders.sources.shard_files import SUFFIX
from prealign.schemas.schema import causal_lm_schema
from tests.loader_helpers import _npy, add_member, sample_lengths, token_ids, write_shards

SKIP = BadDataPolicy(on_error="skip", warn=False, max_consecutive=1000)
OOV = (
    *range(10),
    25,
    37,
)  # an id past a 12k vocabulary: every sample of shard 0, the first of the signature,
# and two after a good one, in other shards (found by their recorded id bounds, as the in-process
# pass finds them)


def _oov(i, tf):
    if i not in OOV:
        return False
    ids = token_ids(i, 9)
    ids[3] = 15_000
    add_member(tf, f"{i:06d}.input_ids.npy", _npy(ids))
    add_member(tf, f"{i:06d}.json", b"{}")
    return True


def _three_ways(paths, schema, policy=SKIP):
    """The index in process, from the sidecars and from the merged index (each: the index or the
    error)."""

    def one(**kw):
        try:
            return build_index(WebDatasetSource(paths, **kw), schema, policy=policy)
        except BadSampleError as exc:
            return exc

    in_process = one(sidecars=False)
    from_sidecars = one()
    merge_sidecars(WebDatasetSource(paths))
    for p in paths:
        os.rename(p + SUFFIX, p + SUFFIX + ".away")
    merged = one()
    for p in paths:
        os.rename(p + SUFFIX + ".away", p + SUFFIX)
    os.remove(os.path.join(os.path.dirname(paths[0]), "prealign-index.merged.npz"))
    return in_process, from_sidecars, merged


@pytest.fixture
def shards(tmp_path):
    paths = write_shards(str(tmp_path), sample_lengths(40), num_shards=4, extra=_oov)
    write_sidecars(WebDatasetSource(paths), causal_lm_schema())
    return paths


@pytest.mark.parametrize(
    "schema, bad", [(causal_lm_schema(vocab_size=12_000), len(OOV)), (causal_lm_schema(), 0)]
)
def test_value_errors_are_their_samples_alone_whichever_the_index(shards, schema, bad):
    indexes = _three_ways(shards, schema)
    assert all(len(ix) == 40 - bad for ix in indexes)
    assert {ix.digest for ix in indexes} == {indexes[0].digest}
    assert all(ix.report.counts == ({"bad_sample": bad} if bad else {}) for ix in indexes)
    assert all(
        ix.report.to_dict() == indexes[0].report.to_dict() for ix in indexes
    )  # each sample named alike
    assert {ix.dims == indexes[0].dims for ix in indexes} == {True}


def test_a_structure_error_condemns_its_signature_everywhere(shards):
    errors = _three_ways(shards, causal_lm_schema(topk=4))  # no sample has the teacher's top-k
    assert all(
        isinstance(e, BadSampleError) and "at least one good sample" in str(e) for e in errors
    )
    assert {str(e) for e in errors} == {str(errors[0])}


def test_the_first_bad_value_raises_under_the_default_policy_whichever_the_index(shards):
    errors = _three_ways(shards, causal_lm_schema(vocab_size=12_000), policy=BadDataPolicy())
    assert all(
        isinstance(e, BadSampleError)
        and "shard-000.tar:000000" in str(e)
        and "got 15000 at token 3" in str(e)
        for e in errors
    )
    assert {str(e) for e in errors} == {str(errors[0])}


@given(
    st.lists(st.integers(0, 8), min_size=1, max_size=3),
    st.integers(0, 8),
    st.lists(st.integers(0, 8), min_size=1, max_size=3),
    st.integers(0, 8),
)
@example([4, 4], 4, [60, 60], 60).via("the review's LxL")
@example([5, 3, 5], 5, [7, 3, 7], 7).via("a trailing dim equal to L")
def test_a_shape_pattern_never_stands_for_two_shapes(shape, n, other, m):
    """Samples of one data signature have one shape up to their token count: the pattern read back
    with each sample's own token count gives its shape, so two distinct [L, K] shapes never share a
    pattern."""

    def read_back(pattern: str, tokens: int) -> list[int]:
        return [tokens if d == "L" else int(d) for d in pattern.split("x")]

    assert read_back(shape_pattern(tuple(shape), n), n) == shape
    if shape_pattern(tuple(shape), n) == shape_pattern(tuple(other), m):
        assert (
            shape[1:] == other[1:]
        )  # only the token dim may differ, and only as each one's token count
        assert shape[0] == other[0] or (shape[0] == n and other[0] == m)


def _topk_k_equal_l(lengths):
    def topk(i, tf):
        n, k = lengths[i], (60 if i == 4 else 4)
        add_member(tf, f"{i:06d}.input_ids.npy", _npy(token_ids(i, n)))
        add_member(tf, f"{i:06d}.teacher_topk_ids.npy", _npy(np.zeros((n, k), np.int64)))
        add_member(
            tf,
            f"{i:06d}.teacher_topk_log_probs.npy",
            _npy(np.tile(-np.arange(1, k + 1, dtype=np.float32), (n, 1))),
        )
        return True

    return topk


def test_top_k_with_k_equal_to_l_keeps_its_own_signature(tmp_path):
    lengths = [
        10,
        12,
        4,
        11,
        60,
        9,
    ]  # sample 2: [4, 4] (L = K = 4); sample 4: [60, 60] (K = 60, another K)
    paths = write_shards(str(tmp_path), lengths, num_shards=1, extra=_topk_k_equal_l(lengths))
    write_sidecars(WebDatasetSource(paths), causal_lm_schema())
    indexes = _three_ways(paths, causal_lm_schema(topk="K"))
    assert all(
        ix.dims["K"] == 4 and len(ix) == 5 and ix.report.counts == {"dim_mismatch": 1}
        for ix in indexes
    )
    assert {ix.digest for ix in indexes} == {indexes[0].digest}


def _word_tokenizer(path, split: str):
    """A real fast tokenizer saved to ``path`` (no download): one vocabulary and special tokens, the
    pre-tokenizer rule ``split``."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [
        "<unk>",
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
    ]
    words = ["user", "assistant", "\n", " ", "look", "at", "this", "Fine", ".", "?"]
    tok = Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(specials + words)}, unk_token="<unk>")
    )
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(split), behavior="isolated")
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", additional_special_tokens=specials[1:]
    ).save_pretrained(str(path))
    return str(path)


def test_tokenizers_that_differ_only_in_their_rules_key_two_indexes_and_the_hint_rebuilds_it(
    tmp_path,
):
    import re
    import shlex

    from PIL import Image
    from transformers import AutoTokenizer

    from prealign.loaders import PackedLoader, ShardWriter
    from prealign.loaders.cli.main import main
    from prealign.loaders.errors import StaleIndexError
    from prealign.loaders.index.sidecar import config_key
    from prealign.loaders.media.chat_tokenizer import HFChatTokenizer
    from prealign.loaders.media.vlm import VLMSampleTransform
    from prealign.schemas import ParallelLayout
    from prealign.schemas.vlm import vlm_schema

    def transform(path):
        return VLMSampleTransform(
            tokenizer=HFChatTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))
        )

    a = _word_tokenizer(tmp_path / "a", r"\n|[.?]| +")
    b = _word_tokenizer(
        tmp_path / "b", r"\n|[.?]| +|k"
    )  # same vocabulary, specials and probe; "look" splits
    with ShardWriter(str(tmp_path / "data" / "s-%03d.tar"), transform=transform(a)) as w:
        for i in range(6):
            w.write(
                {
                    "json": {
                        "messages": [
                            {"role": "user", "content": "<image>\nlook at this ?"},
                            {"role": "assistant", "content": "Fine ." + " look at this" * i},
                        ]
                    },
                    "0.png": Image.fromarray(np.full((56, 56, 3), i * 10, np.uint8)),
                }
            )
    assert config_key(WebDatasetSource(w.shards, transform=transform(a))) != config_key(
        WebDatasetSource(w.shards, transform=transform(b))
    )

    def loader():
        return PackedLoader(
            WebDatasetSource(w.shards, transform=transform(b), image="bytes"),
            schema=vlm_schema(),
            layout=ParallelLayout(),
            token_budget=8192,
        )

    with pytest.raises(StaleIndexError, match="tokenizer_definition") as exc:
        loader().prepare()
    command = re.search(r"run `(prealign index [^`]*)`", str(exc.value)).group(1)
    assert f"--tokenizer {shlex.quote(b)}" in command
    assert main(shlex.split(command)[1:]) == 0  # followed
    batches = list(loader())
    assert sum(len(x["sample_index"]) for x in batches) == 6


class _Repeat:
    """A custom transform whose ``index_key`` does not say how many times it repeats the ids."""

    def __init__(self, times: int):
        self.times = times

    def index_key(self) -> str:
        return "repeat"

    def __call__(self, sample: dict) -> dict:
        return {"input_ids": np.tile(np.asarray(sample["input_ids.npy"]), self.times)}


class _DeclaredRepeat(_Repeat):
    """:class:`_Repeat` declaring identity fields that do not name ``times`` either."""

    def identity_fields(self) -> dict:
        return {"transform": f"{__name__}._DeclaredRepeat", "index_key": self.index_key()}


def test_plain_functions_are_keyed_by_module_and_name_and_a_length_mismatch_names_the_transform(
    tmp_path,
):
    from prealign.loaders.errors import StaleIndexError
    from prealign.loaders.index.sidecar import describe_transform

    assert describe_transform(_word_tokenizer).startswith(
        f"{__name__}._word_tokenizer:"
    )  # its name, its code
    paths = write_shards(str(tmp_path), sample_lengths(20), num_shards=2)
    write_sidecars(WebDatasetSource(paths, transform=_Repeat(2)), causal_lm_schema())
    with pytest.raises(StaleIndexError, match=r"another transform \(transform_code: indexed with"):
        build_index(
            WebDatasetSource(paths, transform=_Repeat(3)), causal_lm_schema()
        )  # its state is in the key
    write_sidecars(WebDatasetSource(paths, transform=_DeclaredRepeat(2)), causal_lm_schema())
    with pytest.raises(
        StaleIndexError,
        match=r"indexed with \d+ tokens, \d+ with this loader's transform "
        r".*_DeclaredRepeat.*write_sidecars\(source, schema, force=True\)",
    ):
        build_index(WebDatasetSource(paths, transform=_DeclaredRepeat(3)), causal_lm_schema())


_VALUES = st.sampled_from([-100, -5, 0, 1, 7, 99, 100, 103])


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(
    st.lists(_VALUES, min_size=2, max_size=6),
    st.lists(_VALUES, min_size=6, max_size=6),
    st.lists(_VALUES, min_size=12, max_size=12),
    st.booleans(),
    st.booleans(),
    st.sampled_from([-100, -1]),
)
@example([1, 7], [-100, 7, 0, 0, 0, 0], [0] * 12, True, False, -100).via(
    "a label at the ignore index"
)
@example([1, 7], [-1, 7, 0, 0, 0, 0], [0] * 12, True, False, -100).via(
    "a negative label, not the ignore index"
)
@example([1, 7], [0] * 6, [0, 0, 100, 0] + [0] * 8, False, True, -100).via(
    "a top-k id past the vocabulary"
)
def test_recorded_bounds_flag_every_sample_the_collator_refuses_for_an_id(
    ids, labels, topk, with_labels, with_topk, ignore
):
    """``bound_suspects`` is a superset of the collator's id-value refusals (vocabulary 100, the
    ignore index on labels), and flags nothing where every id is in range and every negative label
    is the ignore index."""
    import torch

    from prealign.loaders.index.sample_checks import bound_suspects, validated, value_bounds

    n = len(ids)
    sample = {"input_ids": torch.tensor(ids)}
    if with_labels:
        sample["labels"] = torch.tensor(labels[:n])
    if with_topk:
        sample["teacher_topk_ids"] = torch.tensor(topk[: 2 * n]).view(n, 2)
        sample["teacher_topk_log_probs"] = torch.full((n, 2), -1.0)
    schema = causal_lm_schema(vocab_size=100, topk=2 if with_topk else None, ignore_index=ignore)
    refused = isinstance(validated([sample], schema)[0], Exception)
    flagged = bool(bound_suspects(schema, value_bounds(sample)[None])[0])
    assert flagged or not refused
    clean = (
        all(0 <= v < 100 for v in ids)
        and all(0 <= v < 100 or v == ignore for v in sample.get("labels", torch.zeros(1)).tolist())
        and all(
            0 <= v < 100 for v in sample.get("teacher_topk_ids", torch.zeros(1)).view(-1).tolist()
        )
    )
    assert not (clean and flagged)
