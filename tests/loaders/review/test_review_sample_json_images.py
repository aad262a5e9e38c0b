"""A sample's JSON whose ``images`` names members by something other than a string (a list, an
object: hostile or broken data) is bad data, a :class:`MediaError` naming the sample and the field,
as a name that is no member is (it was a ``TypeError`` from looking an unhashable name up among the
sample's members)."""

from __future__ import annotations

import json

import pytest

from prealign.loaders.media.vlm import MediaError, MediaProblem, VLMSampleTransform
from tests.loaders.media.test_vlm import TOK


@pytest.mark.parametrize("name", [[], ["0.png"], {"a": 1}, 1, None])
def test_an_image_named_by_no_string_is_a_typed_error_naming_the_sample(name):
    meta = {"messages": [{"role": "user", "content": "<image> hi"}], "images": [name]}
    with pytest.raises(MediaError) as err:
        VLMSampleTransform(tokenizer=TOK)({"__key__": "bad9", "json": json.dumps(meta).encode()})
    assert err.value.problem is MediaProblem.MISSING_IMAGE and err.value.sample == "bad9"
