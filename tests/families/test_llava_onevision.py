"""LLaVA-OneVision: the token count of an image from its size alone (AnyRes pinpoint, unpadding,
pooling past ``anyres_max_9``, a newline per row; the base view plus one newline for an image among
several) equals what transformers' ``LlavaOnevisionProcessor`` writes, and its tile count equals the
image processor's rows."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prealign.collate.vision import LlavaOneVision, vision_family
from prealign.collate.vision.llava_onevision import best_resolution
from tests.conftest import examples

transformers = pytest.importorskip("transformers")


@functools.lru_cache(maxsize=None)
def processor(strategy: str = "full"):
    """``LlavaOnevisionProcessor`` with a word-level tokenizer and transformers' image processor;
    without a video processor (transformers' needs torchvision), its class check of that one
    argument skipped."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlavaOnevisionProcessor, PreTrainedTokenizerFast
    from transformers.processing_utils import ProcessorMixin

    try:
        from transformers import LlavaOnevisionImageProcessorPil as image_cls
    except ImportError:  # pragma: no cover
        from transformers import LlavaOnevisionImageProcessor as image_cls
    tok = Tokenizer(
        models.WordLevel({"<unk>": 0, "<image>": 1, "<video>": 2, "a": 3}, unk_token="<unk>")
    )
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<image>", "<video>"])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: (
        None if name == "video_processor" and arg is None else check(self, name, arg)
    )
    try:
        return LlavaOnevisionProcessor(
            image_processor=image_cls(),
            tokenizer=hf,
            num_image_tokens=729,
            vision_feature_select_strategy=strategy,
        )
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def family(strategy: str = "full") -> LlavaOneVision:
    return vision_family(
        transformers.LlavaOnevisionConfig(
            image_token_index=1, video_token_index=2, vision_feature_select_strategy=strategy
        )
    )


sizes = st.tuples(st.integers(1, 3000), st.integers(1, 3000))


@given(st.lists(sizes, min_size=1, max_size=3), st.sampled_from(["full", "default"]))
@examples(40)
def test_image_tokens_equal_the_processor(images, strategy):
    """The processor's own count (``_get_number_of_features``; the multi-image rule of its
    expansion) per image."""
    p, fam = processor(strategy), family(strategy)
    for h, w in images:
        if len(images) == 1:
            want = p._get_number_of_features(h, w, 384, 384) - (strategy == "default")
        else:
            want = p.num_image_tokens + 1 - (strategy == "default")
        assert fam.image_tokens(h, w, images_in_sample=len(images)) == want


@pytest.mark.slow
@given(st.lists(st.tuples(st.integers(8, 800), st.integers(8, 800)), min_size=1, max_size=2))
@examples(4)
def test_tokens_and_tiles_equal_the_processors_output(images):
    """The processor run on real images (one prompt's images nested in one list, as a chat
    sample's): ``<image>`` tokens written and ``pixel_values`` rows per image."""
    from PIL import Image

    p, fam = processor(), family()
    pil = [Image.fromarray(np.zeros((h, w, 3), np.uint8)) for h, w in images]
    out = p(text=" ".join(["<image>"] * len(pil)), images=[pil], return_tensors="np")
    assert int((out["input_ids"] == 1).sum()) == sum(
        fam.image_tokens(h, w, images_in_sample=len(pil)) for h, w in images
    )
    tiles = [fam.tiles(h, w, images_in_sample=len(images)) for h, w in images]
    assert out["pixel_values"].shape[:2] == (
        len(pil),
        max(tiles),
    )  # padded to the sample's most tiles
    assert out["image_sizes"].tolist() == [[h, w] for h, w in images]


@given(sizes)
@examples(200)
def test_best_resolution_equals_transformers(size):
    from transformers.image_processing_utils import select_best_resolution

    pins = family().pinpoints
    assert best_resolution(*size, pins) == tuple(
        select_best_resolution(size, [list(p) for p in pins])
    )


def test_golden_counts():
    fam = family()
    assert (fam.base_tokens, fam.max_tiles, fam.position_kind, fam.media_attention) == (
        729,
        9,
        "1d",
        "causal",
    )
    # 384x384: pinpoint 384x384, one tile, 27x27 features unpadded as is, 27 newlines
    assert fam.image_tokens(384, 384) == 729 + 27 * 27 + 27 and fam.tiles(384, 384) == 2
    assert fam.image_tokens(384, 384, images_in_sample=2) == 730


def test_vlm_sample_transform_points_to_the_familys_own():
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.loaders.media.vlm import VLMSampleTransform
    from prealign.schemas import ConfigError

    with pytest.raises(ConfigError, match="LlavaOnevisionSampleTransform"):
        VLMSampleTransform(
            tokenizer=ByteTokenizer(), model_config=transformers.LlavaOnevisionConfig()
        )
