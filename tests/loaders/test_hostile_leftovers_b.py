"""The leftovers of the hostile pass (issue 28's review): image / video processor patch sizes that
would resize every picture past its pixel range (unbounded memory), ``spread``'s work per item,
a streaming mixture's component settings, the passes of a mixture's epoch draws."""

from __future__ import annotations

import json
import re

import numpy as np
import PIL.Image
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prealign.loaders import VLMSampleTransform
from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
from prealign.loaders.cli.main import main
from prealign.loaders.media.vlm import image_processor
from prealign.schemas.errors import ConfigError
from tests.loaders.test_hostile_surface import _vlm_shard  # (the earlier pass's one-image shard)
from tests.vlm_families import tiny_config

TOK = ByteTokenizer()


# ---- 1. processor options: (patch_size * merge_size)**2 within max_pixels -----------------------
@pytest.mark.parametrize(
    "options,named,came",
    [
        ({"patch_size": 100_000}, r"\['patch_size'\]", r"\(100000 \* 2\)\*\*2 = 40000000000"),
        ({"merge_size": 100_000}, r"\['merge_size'\]", r"\(14 \* 100000\)\*\*2"),
        (
            {"patch_size": 100, "merge_size": 3, "min_pixels": 100, "max_pixels": 89_999},
            r"\['patch_size'\]\['merge_size'\]\['max_pixels'\]",
            r"\(100 \* 3\)\*\*2 = 90000 > max_pixels 89999",
        ),
        ({"min_pixels": 100, "max_pixels": 783}, r"\['max_pixels'\]", r"= 784 > max_pixels 783"),
    ],
)
def test_patch_sizes_past_max_pixels_are_refused(options, named, came):
    with pytest.raises(ConfigError) as err:
        VLMSampleTransform(tokenizer=TOK, processor_options=options)
    message = str(err.value)
    assert message.startswith("VLMSampleTransform.processor_options"), message
    assert re.search(named + r": expected \(patch_size \* merge_size\)\*\*2 <= max_pixels", message)
    assert re.search(came, message), message


def test_the_bound_itself_is_accepted():
    VLMSampleTransform(tokenizer=TOK, processor_options={"min_pixels": 100, "max_pixels": 784})


def test_a_family_patch_size_past_the_options_max_pixels_names_max_pixels():
    """Qwen3-VL's patch 16 * merge 2 = 32: 1024 pixels at least; the options' max_pixels below."""
    with pytest.raises(ConfigError, match=r"processor_options\['max_pixels'\]: .* = 1024 > max_"):
        VLMSampleTransform(
            tokenizer=TOK,
            model_config=tiny_config("qwen3_vl"),
            processor_options={"min_pixels": 100, "max_pixels": 1000},
        )


def test_a_model_config_patch_size_past_max_pixels_says_where_it_came_from():
    config = tiny_config("qwen2_vl")
    config.vision_config.patch_size = 100_000
    with pytest.raises(ConfigError) as err:
        VLMSampleTransform(tokenizer=TOK, model_config=config)
    assert str(err.value).startswith(
        "VLMSampleTransform.processor_options (not set there: the model config's or the "
        "processor's own sizes): expected (patch_size * merge_size)**2 <= max_pixels"
    ), err.value


def test_a_huge_temporal_patch_size_is_refused():
    """An image is padded to temporal_patch_size frames (copies of it): at most a video's frames."""
    with pytest.raises(
        ConfigError,
        match=r"\['temporal_patch_size'\]: expected temporal_patch_siz"
        r"e <= 2048 \(limits.max_video_frames: .*\), got 100000",
    ):
        VLMSampleTransform(tokenizer=TOK, processor_options={"temporal_patch_size": 100_000})


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen3_vl"])
def test_video_processor_config_patch_sizes_are_refused(model_type):
    with pytest.raises(ConfigError) as err:
        VLMSampleTransform(
            tokenizer=TOK,
            model_config=tiny_config(model_type),
            video_processor_config={"patch_size": 100_000},
        )
    message = str(err.value)
    assert message.startswith("VLMSampleTransform.video_processor_config['patch_size']: expected")
    assert ("temporal_patch_size * (patch_size" in message) == (model_type == "qwen3_vl"), message


def test_a_processor_object_past_its_range_is_refused():
    """A processor given as an object (not options): its own settings, named as the processor."""
    try:  # transformers >= 5 without torchvision: the PIL backend
        from transformers import Qwen2VLImageProcessorPil as cls
    except ImportError:  # older transformers
        from transformers import Qwen2VLImageProcessor as cls

    processor = cls(patch_size=1000)
    with pytest.raises(ConfigError, match=r"^VLMSampleTransform.processor: expected \(patch_"):
        VLMSampleTransform(tokenizer=TOK, processor=processor)


@settings(max_examples=60, deadline=None)
@given(
    patch=st.integers(1, 12),
    merge=st.integers(1, 3),
    most=st.integers(16, 2500),
    height=st.integers(1, 60),
    width=st.integers(1, 60),
)
def test_the_rule_is_the_processors_own_bound(patch, merge, most, height, width):
    """Differential against transformers' Qwen2-VL processor: the check accepts exactly the options
    whose square images all resize within max_pixels; any image under accepted options stays within
    it up to the sqrt(200) a side clamped to one factor adds at the aspect-ratio cap (bounded);
    under refused options every image resizes past it."""
    options = {"patch_size": patch, "merge_size": merge, "min_pixels": 1, "max_pixels": most}
    try:
        VLMSampleTransform(tokenizer=TOK, processor_options=options)
        accepted = True
    except ConfigError:
        accepted = False
    processor = image_processor(**options)
    for h, w in ((height, width), (height, height)):
        grid = processor(images=[PIL.Image.new("RGB", (w, h))], return_tensors="pt")
        _, gh, gw = grid["image_grid_thw"][0].tolist()
        pixels = gh * gw * patch * patch
        if h == w:
            assert accepted == (pixels <= most)
        assert pixels <= 200**0.5 * most if accepted else pixels >= (patch * merge) ** 2 > most


def _glm_transform(**options):
    from prealign.loaders.media import glm4v
    from prealign.loaders.media.chat_tokenizer import HFChatTokenizer
    from tests.families import glm4v_reference as ref

    tok = HFChatTokenizer(ref.hf_tokenizer(), **glm4v.TOKEN_NAMES)
    return VLMSampleTransform(tokenizer=tok, model_config=ref.tiny_config(), **options)


def test_glm_images_are_bound_by_their_volume():
    """GLM-4.1V resizes an image as temporal_patch_size frames within max_pixels: (1500 * 2)**2 =
    9,000,000 fits its 11,760,000 per frame but not twice over."""
    assert _glm_transform().image_processor.size["longest_edge"] == 11_760_000
    with pytest.raises(ConfigError) as err:
        _glm_transform(processor_options={"patch_size": 1500})
    assert str(err.value).startswith(
        "VLMSampleTransform.processor_options['patch_size']: expected temporal_patch_size * "
        "(patch_size * merge_size)**2 <= max_pixels"
    ), err.value
    assert "got 2 * (1500 * 2)**2 = 18000000 > max_pixels 11760000" in str(err.value)
    _glm_transform(processor_options={"patch_size": 1200})  # 2 * 2400**2 = 11,520,000


@settings(max_examples=60, deadline=None)
@given(
    patch=st.integers(1, 12),
    merge=st.integers(1, 3),
    temporal=st.integers(1, 4),
    most=st.integers(16, 5000),
    height=st.integers(1, 200),
    width=st.integers(1, 200),
)
def test_the_volume_rule_is_glms_own_bound(patch, merge, temporal, most, height, width):
    """Differential against transformers' GLM-4.1V ``smart_resize`` (an image is
    ``temporal_patch_size`` frames): the check accepts exactly the settings whose square images
    resize within max_pixels; what it accepts stays within it up to the aspect-ratio cap's
    sqrt(200); what it refuses is past it for every image."""
    import sys

    from prealign.loaders.media.glm4v import glm4v_image_processor

    # the resize rule of the GLM processor class the transform runs (its module's smart_resize)
    smart_resize = sys.modules[type(glm4v_image_processor()).__module__].smart_resize
    from prealign.loaders.media.vlm import check_resize_bound

    processor = image_processor(
        patch_size=patch,
        merge_size=merge,
        temporal_patch_size=temporal,
        min_pixels=1,
        max_pixels=most,
    )
    try:
        check_resize_bound("glm", processor, {}, volume=True, limit=2048)
        accepted = True
    except ConfigError:
        accepted = False
    factor = patch * merge
    for side in ((height, width), (height, height)):
        h, w = smart_resize(temporal, *side, temporal, factor, 1, most)
        if side[0] == side[1]:
            assert accepted == (temporal * h * w <= most)
        if accepted:
            assert temporal * h * w <= 200**0.5 * most
        else:
            assert temporal * h * w >= temporal * factor**2 > most


def test_prealign_index_refuses_a_processor_folder_past_its_range(tmp_path, capsys):
    """``--processor DIR`` whose patch size makes the smallest image 40,000 pixels with 30,000 at
    most (a patch size of 100,000 made it 4e10: memory without bound): one error line."""
    folder = tmp_path / "proc"
    folder.mkdir()
    config = {"patch_size": 100, "min_pixels": 3136, "max_pixels": 30_000}
    (folder / "preprocessor_config.json").write_text(json.dumps(config))
    argv = ["index", "--processor", str(folder), _vlm_shard(tmp_path), "--out", str(tmp_path / "x")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("prealign: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "processor_options['patch_size']['max_pixels']: expected" in lines[0], lines[0]
    assert "(100 * 2)**2 = 40000 > max_pixels 30000" in lines[0], lines[0]


@pytest.mark.parametrize("edge,patch,merge", [(64, 40, 2), (64, 65, 1)])
def test_mistral3_token_step_past_the_longest_edge_is_refused(edge, patch, merge):
    """Pixtral rounds each side up to a patch * merge step after fitting longest_edge: a step past
    the edge resizes every image past it (a config's patch of 100,000: 1e10 pixels)."""
    from prealign.loaders.media.mistral3 import Mistral3SampleTransform
    from tests.families import mistral3_reference as ref

    config = ref.tiny_config(longest_edge=edge, patch=patch, merge=merge)
    with pytest.raises(ConfigError) as err:
        Mistral3SampleTransform(model_config=config, tokenizer=ref.hf_tokenizer())
    assert str(err.value) == (
        f"Mistral3SampleTransform: expected patch_size * spatial_merge_size <= the image "
        f"processor's longest_edge (each side of a resized image is at least one token step), got "
        f"{patch} * {merge} = {patch * merge} > longest_edge {edge}"
    )
    ok = ref.tiny_config(longest_edge=edge, patch=edge // merge, merge=merge)  # the step == edge
    Mistral3SampleTransform(model_config=ok, tokenizer=ref.hf_tokenizer())


# ---- 2. spread: O(items log n_bins), the same bins as before ---------------------------------
def _reference_spread(bins, sizes, n_bins, cap, max_items=None):
    """``spread`` and its fallback as they were (a scan of every bin per item): the reference."""
    items = sorted((i for b in bins for i in b), key=lambda i: (-int(sizes[i]), i))
    loads = [0] * n_bins
    out = [[] for _ in range(n_bins)]
    for i in items:
        s = int(sizes[i])
        b = min(
            (c for c in range(n_bins) if loads[c] + s <= cap and len(out[c]) != max_items),
            key=lambda c: (loads[c], c),
            default=None,
        )
        if b is None:
            out = [sorted(b) for b in bins] + [[] for _ in range(n_bins - len(bins))]
            for target in range(len(bins), n_bins):
                donors = [c for c in range(len(out)) if len(out[c]) > 1]
                if not donors:
                    break
                c = max(donors, key=lambda c: (sum(int(sizes[j]) for j in out[c]), -c))
                i = min(out[c], key=lambda j: (int(sizes[j]), j))
                out[c].remove(i)
                out[target].append(i)
            return out
        out[b].append(i)
        loads[b] += s
    return [sorted(b) for b in out]


@st.composite
def _bins_to_spread(draw):
    """Bins of a permutation of ``n`` items (sizes with ties), ``n_bins >= len(bins)``, a cap some
    bins may not fit under and a max_items (the greedy pass and its fallback both run)."""
    n = draw(st.integers(0, 40))
    sizes = np.array(draw(st.lists(st.integers(0, 12), min_size=n, max_size=n)), dtype=np.int64)
    order = draw(st.permutations(range(n)))
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=8)))
    bins = [list(order[a:b]) for a, b in zip([0, *cuts], [*cuts, n])]
    n_bins = len(bins) + draw(st.integers(0, 12))
    cap = draw(st.integers(0, 60))
    max_items = draw(st.one_of(st.none(), st.integers(0, 6)))
    return bins, sizes, n_bins, cap, max_items


@pytest.mark.slow
@settings(max_examples=1500, deadline=None)
@given(case=_bins_to_spread())
def test_spread_equals_the_reference(case):
    from prealign.loaders.plan.packing import spread

    bins, sizes, n_bins, cap, max_items = case
    want = _reference_spread([list(b) for b in bins], sizes, n_bins, cap, max_items)
    got = spread([list(b) for b in bins], sizes, n_bins, cap, max_items)
    assert got == want and [list(map(type, b)) for b in got] == [list(map(type, b)) for b in want]


def _python_lines(fn, *args) -> int:
    """Python lines ``fn(*args)`` runs (every frame, its callees included), on its second call with
    the collector off: what runs once per process (a lazy import, a warning's first report) or when
    the collector runs (a callback) is not counted."""
    import gc
    import sys

    count = 0

    def line(frame, event, arg):
        nonlocal count
        count += event == "line"
        return line

    fn(*args)
    before, collecting = sys.gettrace(), gc.isenabled()  # (a coverage tracer, restored)
    gc.disable()
    sys.settrace(lambda frame, event, arg: line)
    try:
        fn(*args)
    finally:
        sys.settrace(before)
        if collecting:
            gc.enable()
    return count


@pytest.mark.parametrize("fallback", [False, True])
def test_spread_work_grows_with_items_not_bins(fallback):
    """Python lines at 8 and 512 target bins (the same 1,000 items) and at 1,000 and 10,000 items:
    the old scan of every bin per item ran ~items * n_bins lines (1,038,052 at 512 bins; now
    9,027, as at 8 bins)."""
    from prealign.loaders.plan.packing import spread

    def case(items: int, n_bins: int):
        sizes = np.random.default_rng(0).integers(1, 100, items)
        bins = [list(range(a, min(a + 50, items))) for a in range(0, items, 50)]
        cap = 60 if fallback else 1 << 40  # 60: the greedy pass fails, items move out one by one
        return bins, sizes, max(n_bins, len(bins)), cap

    few, many = _python_lines(spread, *case(1_000, 8)), _python_lines(spread, *case(1_000, 512))
    small, large = _python_lines(spread, *case(1_000, 64)), _python_lines(spread, *case(10_000, 64))
    if fallback:  # one item moved out per new bin: at most a few lines per item, whatever the bins
        assert many <= 10 * 1_000 and few <= 10 * 1_000, (few, many)
    else:  # the bins cost no Python step at all
        assert many <= few + 10, (few, many)
    assert large <= 10.5 * small, (small, large)


# ---- 3. a streamed Mixture: length / repeat it cannot honour are refused, not ignored ----------
@pytest.fixture(scope="module")
def stream_paths(tmp_path_factory):
    from tests.loader_helpers import sample_lengths, write_shards

    root = tmp_path_factory.mktemp("stream_mix")
    return [
        write_shards(str(root / name), sample_lengths(n, seed=n), num_shards=2)
        for name, n in (("a", 30), ("b", 10))
    ]


def _stream(paths, *, length="total", repeat=None):
    from prealign.loaders import Component, Mixture, StreamingPackedLoader, WebDatasetSource
    from prealign.schemas import ParallelLayout, causal_lm_schema

    mix = Mixture(
        {
            "a": Component(WebDatasetSource(paths[0]), weight=0.5),
            "b": Component(WebDatasetSource(paths[1]), repeat=repeat)
            if repeat is not None
            else Component(WebDatasetSource(paths[1]), weight=0.5),
        },
        length=length,
    )
    return StreamingPackedLoader(
        mix, schema=causal_lm_schema(), layout=ParallelLayout(), token_budget=256, dp_size=1
    )


@pytest.mark.parametrize("repeat", [2, 0.5, 1.5])
def test_a_streamed_component_repeat_is_refused(stream_paths, repeat):
    """Energon's blend_epochized repeats a component ``repeat`` times per epoch; a stream reads
    every sample once: refused, naming the component and the setting (PackedLoader plans it)."""
    with pytest.raises(ConfigError) as err:
        _stream(stream_paths, repeat=repeat)
    assert str(err.value).startswith(
        f"StreamingPackedLoader: mixture component 'b': repeat: expected None or 1 (a stream "
        f"reads every sample once), got {repeat!r}"
    ), err.value
    assert "PackedLoader" in str(err.value)


@pytest.mark.parametrize("length", ["first_exhausted", "all_exhausted", 1000])
def test_a_streamed_mixture_length_is_refused(stream_paths, length):
    """HF's interleave_datasets stops at the first exhausted stream or oversamples to the last;
    this stream does neither (every sample once): refused, naming the setting."""
    with pytest.raises(ConfigError) as err:
        _stream(stream_paths, length=length)
    assert str(err.value).startswith(
        f"StreamingPackedLoader: Mixture length: expected 'total' (a stream's epoch is every "
        f"sample once), got {length!r}"
    ), err.value


def test_a_streamed_repeat_of_one_is_one_pass(stream_paths):
    """repeat=1 (one pass) is what the stream does: accepted, every sample served once."""
    ids = [i for b in _stream(stream_paths, repeat=1) for i in b["sample_index"].tolist()]
    assert len(ids) == len(set(ids)) == 40


# ---- 4. the epoch's passes: one computation, checked and drawn alike ---------------------------
@pytest.mark.parametrize("repeat,by", [(2.5, "samples"), (1.2, "tokens"), (3.0, "tokens")])
def test_the_draws_checked_are_the_draws_made(monkeypatch, repeat, by):
    """The bound check passes exactly the draws the passes then make: at the bound accepted (and
    drawn: every component stream asked for passes * samples), one under it refused."""
    from prealign.loaders.plan import mixing

    lengths = [np.arange(1, 8, dtype=np.int64), np.arange(3, 13, dtype=np.int64)]
    mix = mixing.MixSpec(names=("a", "b"), weights=(1.0, None), repeats=(None, repeat), by=by)
    asked = []
    stream = mixing.component_stream

    def spy(n, count, **kw):
        asked.append(count)
        return stream(n, count, **kw)

    monkeypatch.setattr(mixing, "component_stream", spy)
    mixing.mixed_order(mix, lengths, epoch=0, seed=0, shuffle=True)
    drawn = sum(asked)
    assert asked[1] == int(np.ceil(repeat)) * len(lengths[1])  # whole passes of b
    monkeypatch.setattr(mixing, "MAX_EPOCH_DRAWS", drawn)
    mixing.mixed_order(mix, lengths, epoch=0, seed=0, shuffle=True)
    monkeypatch.setattr(mixing, "MAX_EPOCH_DRAWS", drawn - 1)
    with pytest.raises(mixing.PlanError, match=r"expected at most .* draws an epoch"):
        mixing.mixed_order(mix, lengths, epoch=0, seed=0, shuffle=True)
