"""Header-only sizes: npy shapes without loading, image sizes without decoding, and the Qwen2-VL
grid arithmetic equal to transformers' own processing."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prealign.loaders.sources.header_lengths import (
    HeaderError,
    Qwen2VLGeometry,
    image_header_size,
    npy_header,
    qwen2vl_grid,
    tokens_of_grid,
)

transformers = pytest.importorskip("transformers")
from PIL import Image  # noqa: E402

from prealign.loaders.media.vlm import image_processor  # noqa: E402


def _npy(arr) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


@pytest.mark.parametrize("dtype", ["int64", "int32", "uint16", "float32", ">i4"])
def test_npy_header_reads_shape_and_dtype_only(dtype):
    arr = np.zeros((7, 3), dtype=dtype)
    data = _npy(arr)
    assert npy_header(data) == ((7, 3), arr.dtype)
    assert npy_header(data[:128]) == ((7, 3), arr.dtype)  # the data itself is never needed


def test_npy_header_refuses_object_arrays_and_garbage():
    obj = io.BytesIO()
    np.save(obj, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(HeaderError, match="unpickling"):
        npy_header(obj.getvalue())
    with pytest.raises(HeaderError, match="npy header"):
        npy_header(b"PK\x03\x04 not an npy")


def test_image_header_size_without_decoding_and_only_allowed_formats():
    buf = io.BytesIO()
    Image.new("RGB", (13000, 13000)).save(buf, format="PNG")  # a bomb: the header alone is read
    assert image_header_size(buf.getvalue()) == (13000, 13000)
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    with pytest.raises(HeaderError, match="JPEG"):
        image_header_size(eps, field="0.jpg", sample="s1")


def _processor_grid(height: int, width: int, **options) -> tuple[int, ...]:
    proc = image_processor(**options)
    out = proc(images=[Image.new("RGB", (width, height), (120, 30, 200))], return_tensors="pt")
    return tuple(out["image_grid_thw"][0].tolist())


@pytest.mark.parametrize(
    "size",
    [(1, 1), (27, 29), (28, 28), (56, 1000), (480, 640), (1080, 1920), (3, 600), (2000, 2000)],
)
def test_grid_equals_the_real_processor(size):
    h, w = size
    assert qwen2vl_grid(h, w) == _processor_grid(h, w)


def test_grid_follows_processor_options():
    opts = {"min_pixels": 128 * 28 * 28, "max_pixels": 256 * 28 * 28}
    geo = Qwen2VLGeometry.of(image_processor(**opts))
    assert (geo.min_pixels, geo.max_pixels) == (opts["min_pixels"], opts["max_pixels"])
    for h, w in [(100, 100), (900, 1600), (333, 777)]:
        assert qwen2vl_grid(h, w, geo) == _processor_grid(h, w, **opts)


@settings(max_examples=300, deadline=None)
@given(h=st.integers(1, 6000), w=st.integers(1, 6000))
def test_grid_property_against_transformers_arithmetic(h, w):
    """Every size: the processor's own resize function (the one its preprocessing calls) agrees."""
    try:  # transformers 5: the PIL backend's module; older releases have one module
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    except ImportError:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    proc = image_processor()
    geo = Qwen2VLGeometry.of(proc)
    if max(h, w) / min(h, w) > 200:
        with pytest.raises(HeaderError, match="aspect ratio"):
            qwen2vl_grid(h, w, geo)
        return
    rh, rw = smart_resize(
        h,
        w,
        factor=geo.patch_size * geo.merge_size,
        min_pixels=geo.min_pixels,
        max_pixels=geo.max_pixels,
    )
    t, gh, gw = qwen2vl_grid(h, w, geo)
    assert (t, gh * geo.patch_size, gw * geo.patch_size) == (1, rh, rw)
    assert gh % geo.merge_size == 0 and gw % geo.merge_size == 0
    assert tokens_of_grid((t, gh, gw), geo) * geo.merge_size**2 == gh * gw


def test_every_demo_image_header_gives_the_transform_grid(tmp_path):
    from prealign.loaders.cli.demo_data import build_demo_dataset
    from prealign.loaders.cli.demo_tokenizer import ByteTokenizer
    from prealign.loaders.media.vlm import VLMSampleTransform

    ds = build_demo_dataset(str(tmp_path), num_samples=60, samples_per_shard=30, topk=2, bad=())
    transform = VLMSampleTransform(tokenizer=ByteTokenizer(), topk=2)
    seen = 0
    for shard in ds.shards:
        samples: dict[str, dict] = {}
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                key, ext = m.name.split(".", 1)
                samples.setdefault(key, {"__key__": key})[ext] = tar.extractfile(m).read()
        for raw in samples.values():
            images = sorted(k for k in raw if k.split(".")[-1] in ("jpg", "png", "webp", "bmp"))
            if not images:
                continue
            out = transform(raw)
            want = [tuple(r) for r in out["image_grid_thw"].tolist()]
            got = [qwen2vl_grid(*image_header_size(raw[k])[::-1]) for k in images]
            assert sorted(got) == sorted(want), raw["__key__"]
            seen += len(images)
    assert seen >= 30, seen


@settings(max_examples=40, deadline=None)
@given(
    w=st.integers(8, 90),
    h=st.integers(8, 90),
    orientation=st.integers(1, 8),
    fmt=st.sampled_from(["JPEG", "PNG", "WEBP", "TIFF"]),
)
def test_exif_orientation_is_applied_as_transformers_load_image_does(w, h, orientation, fmt):
    """A photo stored sideways (EXIF orientation 5-8) is decoded upright, pixel for pixel as
    transformers' ``load_image`` gives it, and the header pass's size is the upright one (the grid
    agrees)."""
    import io

    import numpy as np
    from PIL import Image
    from transformers.image_utils import load_image

    from prealign.loaders.media.vlm import decode_image

    rng = np.random.default_rng(w * 1000 + h)
    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    img.save(buf, format=fmt, exif=exif.tobytes())
    data = buf.getvalue()
    ours = decode_image(data, sample="k", name="jpg")
    reference = load_image(Image.open(io.BytesIO(data)))
    assert ours.size == reference.size == image_header_size(data)
    assert np.array_equal(np.asarray(ours), np.asarray(reference))


def test_a_png_oriented_by_xmp_is_measured_as_decoded():
    """ImageMagick and phones also put the orientation in a PNG's XMP: the header pass agrees with
    decoding."""
    from PIL import PngImagePlugin

    from prealign.loaders.sources.tar_decode import open_image

    xmp = (
        '<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF '
        'xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
        '<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" '
        'tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>'
    )
    info = PngImagePlugin.PngInfo()
    info.add_itxt("XML:com.adobe.xmp", xmp)
    buf = io.BytesIO()
    Image.new("RGB", (40, 30)).save(buf, format="PNG", pnginfo=info)
    assert open_image(buf.getvalue()).size == image_header_size(buf.getvalue()) == (30, 40)
