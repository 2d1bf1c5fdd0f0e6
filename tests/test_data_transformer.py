"""DataTransformer against a per-pixel reference written from Caffe's data_transformer.cpp,
and image decoding / resizing against references (Pillow, torch when installed)."""
import io

import numpy as np
import pytest

from minicaffe.core import protoio
from minicaffe.data.db import array_to_datum
from minicaffe.data.images import ImageError, decode_image, encode_image, resize
from minicaffe.data.transformer import DataTransformer, TransformError
from minicaffe.core.errors import MinicaffeError
from minicaffe.proto import caffe_pb2

TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST


def tparam(**kw):
    p = caffe_pb2.TransformationParameter()
    for k, v in kw.items():
        if k == "mean_value":
            p.mean_value.extend(v)
        else:
            setattr(p, k, v)
    return p


def caffe_reference(images, param, phase, mean, seed):
    """Caffe's Transform(Datum), pixel by pixel; Rand(n) = raw 32-bit MT output % n."""
    rng = np.random.RandomState(seed)
    rand = lambda n: int(rng.randint(0, 2 ** 32, dtype=np.uint32)) % n  # noqa: E731
    out = []
    for img in images:
        c_, h_, w_ = img.shape
        crop = param.crop_size
        do_mirror = param.mirror and phase == TRAIN and rand(2)
        height, width, h_off, w_off = h_, w_, 0, 0
        if crop:
            height = width = crop
            if phase == TRAIN:
                h_off = rand(h_ - crop + 1)
                w_off = rand(w_ - crop + 1)
            else:
                h_off, w_off = (h_ - crop) // 2, (w_ - crop) // 2
        mv = list(param.mean_value)
        if len(mv) == 1:
            mv = mv * c_
        top = np.zeros((c_, height, width), dtype=np.float32)
        scale = np.float32(param.scale)
        for h in range(height):
            for w in range(width):  # one pixel, every channel
                ww = width - 1 - w if do_mirror else w
                x = img[:, h_off + h, w_off + w].astype(np.float32)
                if mean is not None:
                    v = (x - mean[:, h_off + h, w_off + w].astype(np.float32)) * scale
                elif mv:
                    v = (x - np.asarray(mv, dtype=np.float32)) * scale
                else:
                    v = x * scale
                top[:, h, ww] = v
        out.append(top)
    return np.stack(out)


def write_mean(path, mean):
    p = caffe_pb2.BlobProto(num=1, channels=mean.shape[0], height=mean.shape[1],
                            width=mean.shape[2])
    p.data.extend(mean.ravel().tolist())
    protoio.write_binary(str(path), p)


CASES = [
    dict(scale=0.00390625),
    dict(mean_value=[10.0]),
    dict(mean_value=[104.0, 117.0, 123.0], scale=0.5),
    dict(crop_size=5),
    dict(crop_size=5, mirror=True),
    dict(mirror=True, mean_value=[3.0, 4.0, 5.0]),
    dict(crop_size=4, mirror=True, scale=2.0, mean_file=True),
    dict(mean_file=True),
]


@pytest.mark.parametrize("phase", [TRAIN, TEST])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_transform_matches_caffe_reference(case, phase, dtype, tmp_path):
    kw = dict(CASES[case])
    rng = np.random.RandomState(case)
    images = [rng.randint(0, 256, size=(3, 7, 8)).astype(dtype) for _ in range(4)]
    mean = None
    if kw.pop("mean_file", False):
        mean = rng.uniform(0, 255, size=(3, 7, 8)).astype(np.float32)
        write_mean(tmp_path / "mean.binaryproto", mean)
        kw["mean_file"] = str(tmp_path / "mean.binaryproto")
    p = tparam(**kw)
    t = DataTransformer(p, phase)
    oshape = t.output_shape((3, 7, 8))
    out = np.empty((4,) + oshape, dtype=np.float32)
    t.transform(images, out, rng=np.random.RandomState(42))
    ref = caffe_reference(images, p, phase, mean, seed=42)
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_vectorised_batch_of_mixed_mirrors_matches_the_reference(dtype, tmp_path):
    """A batch of 32 (mirrored and not, random crops, a mean file): the one-gather-per-batch
    path equals Caffe's pixel loop image by image."""
    rng = np.random.RandomState(9)
    images = rng.randint(0, 256, size=(32, 3, 11, 12)).astype(dtype)
    mean = rng.uniform(0, 255, size=(3, 11, 12)).astype(np.float32)
    write_mean(tmp_path / "mean.binaryproto", mean)
    p = tparam(crop_size=6, mirror=True, scale=0.25, mean_file=str(tmp_path / "mean.binaryproto"))
    t = DataTransformer(p, TRAIN)
    out = t.transform(images, np.empty((32, 3, 6, 6), np.float32), np.random.RandomState(1))
    np.testing.assert_array_equal(out, caffe_reference(images, p, TRAIN, mean, seed=1))


def test_random_draws_cover_offsets_and_mirror():
    t = DataTransformer(tparam(crop_size=2, mirror=True), TRAIN)
    mirror, hoff, woff = t.draw(400, (4, 5), np.random.RandomState(0))
    assert set(hoff) == {0, 1, 2} and set(woff) == {0, 1, 2, 3}
    assert 150 < mirror.sum() < 250
    # TEST: centre crop, never mirrored, no draws needed
    t = DataTransformer(tparam(crop_size=2, mirror=True), TEST)
    assert not t.needs_rand
    mirror, hoff, woff = t.draw(5, (4, 5), None)
    assert not mirror.any() and set(hoff) == {1} and set(woff) == {1}


def test_transform_uses_the_callers_generator_reproducibly():
    t = DataTransformer(tparam(crop_size=3, mirror=True), TRAIN)
    img = [np.arange(50, dtype=np.uint8).reshape(2, 5, 5)] * 8
    a = t.transform(img, np.empty((8, 2, 3, 3), np.float32), np.random.RandomState(7))
    b = t.transform(img, np.empty((8, 2, 3, 3), np.float32), np.random.RandomState(7))
    c = t.transform(img, np.empty((8, 2, 3, 3), np.float32), np.random.RandomState(8))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_transform_one_and_datums():
    t = DataTransformer(tparam(scale=0.5), TEST)
    img = np.arange(12, dtype=np.uint8).reshape(1, 3, 4)
    np.testing.assert_array_equal(t.transform_one(img), img * 0.5)
    d = array_to_datum(img, 3)
    out = np.empty((2, 1, 3, 4), np.float32)
    t.transform_datums([d, d], out)
    np.testing.assert_array_equal(out[1], img * 0.5)


@pytest.mark.parametrize("kw,shape,msg", [
    (dict(crop_size=9), (3, 7, 8), "crop_size 9 is larger than the image (7x8)"),
    (dict(mean_value=[1.0, 2.0]), (3, 7, 8), "either 1 mean_value or as many as channels (3)"),
])
def test_output_shape_errors(kw, shape, msg):
    t = DataTransformer(tparam(**kw), TRAIN)
    with pytest.raises(TransformError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        t.output_shape(shape, "src: key 00000001")


def test_mean_file_of_the_wrong_shape(tmp_path):
    write_mean(tmp_path / "m.binaryproto", np.zeros((3, 6, 6), np.float32))
    t = DataTransformer(tparam(mean_file=str(tmp_path / "m.binaryproto")), TRAIN)
    with pytest.raises(TransformError) as e:
        t.output_shape((1, 28, 28), "db: key 00000000")
    msg = str(e.value)
    assert "m.binaryproto has shape 3x6x6 but the data is 1x28x28" in msg
    assert msg.startswith("db: key 00000000") and "\n" not in msg


def test_contradictory_parameters(tmp_path):
    with pytest.raises(TransformError, match="both force_color and force_gray"):
        DataTransformer(tparam(force_color=True, force_gray=True))
    write_mean(tmp_path / "m.binaryproto", np.zeros((1, 2, 2), np.float32))
    p = tparam(mean_file=str(tmp_path / "m.binaryproto"), mean_value=[1.0])
    with pytest.raises(TransformError, match="mean_file and mean_value"):
        DataTransformer(p)
    with pytest.raises(MinicaffeError, match="no such file"):
        DataTransformer(tparam(mean_file=str(tmp_path / "missing.binaryproto")))


# -- images -----------------------------------------------------------------------------------
def _png(rgb):
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def test_decode_gives_bgr_and_honours_force_color_gray():
    rgb = np.zeros((4, 5, 3), np.uint8)
    rgb[..., 0] = 200  # red
    rgb[..., 2] = 10   # blue
    img = decode_image(_png(rgb))
    assert img.shape == (3, 4, 5)
    assert (img[0] == 10).all() and (img[2] == 200).all()  # BGR as OpenCV
    gray = decode_image(_png(rgb), color=False)
    assert gray.shape == (1, 4, 5)
    g = decode_image(_png(rgb[..., 0].copy()))  # a gray PNG stays 1 channel natively
    assert g.shape == (1, 4, 5)
    assert decode_image(_png(rgb[..., 0].copy()), color=True).shape == (3, 4, 5)


def test_encoded_datum_transform_respects_force_flags():
    rgb = np.random.RandomState(0).randint(0, 256, (6, 6, 3)).astype(np.uint8)
    d = caffe_pb2.Datum(data=_png(rgb), encoded=True, label=1)
    assert DataTransformer(tparam(), TEST).decode(d).shape == (3, 6, 6)
    assert DataTransformer(tparam(force_gray=True), TEST).decode(d).shape == (1, 6, 6)


def test_undecodable_image_names_the_record():
    with pytest.raises(ImageError, match=r"^db: key 7: cannot decode image"):
        decode_image(b"not an image at all", None, "db: key 7")


def test_encode_roundtrip_png_is_lossless():
    img = np.random.RandomState(1).randint(0, 256, (3, 9, 7)).astype(np.uint8)
    np.testing.assert_array_equal(decode_image(encode_image(img, "png")), img)
    g = img[:1]
    np.testing.assert_array_equal(decode_image(encode_image(g, "png")), g)
    j = decode_image(encode_image(img, "jpg"))
    assert j.shape == img.shape


def _resize_reference(img, oh, ow):
    """OpenCV INTER_LINEAR written as a loop."""
    c, h, w = img.shape
    out = np.zeros((c, oh, ow))
    for y in range(oh):
        fy = (y + 0.5) * h / oh - 0.5
        sy = int(np.floor(fy))
        fy -= sy
        if sy < 0:
            sy, fy = 0, 0.0
        if sy >= h - 1:
            sy, fy = h - 1, 0.0
        for x in range(ow):
            fx = (x + 0.5) * w / ow - 0.5
            sx = int(np.floor(fx))
            fx -= sx
            if sx < 0:
                sx, fx = 0, 0.0
            if sx >= w - 1:
                sx, fx = w - 1, 0.0
            sy1, sx1 = min(sy + 1, h - 1), min(sx + 1, w - 1)
            out[:, y, x] = ((1 - fy) * ((1 - fx) * img[:, sy, sx] + fx * img[:, sy, sx1])
                            + fy * ((1 - fx) * img[:, sy1, sx] + fx * img[:, sy1, sx1]))
    return np.clip(np.floor(out + 0.5), 0, 255)


@pytest.mark.parametrize("oh,ow", [(5, 7), (13, 4), (20, 30), (10, 11)])
def test_resize_matches_opencv_bilinear(oh, ow):
    img = np.random.RandomState(2).randint(0, 256, (2, 10, 11)).astype(np.uint8)
    got = resize(img, oh, ow)
    ref = _resize_reference(img.astype(np.float64), oh, ow)
    assert np.abs(got.astype(int) - ref.astype(int)).max() <= 1


def test_resize_matches_torch_bilinear():
    torch = pytest.importorskip("torch")
    img = np.random.RandomState(3).randint(0, 256, (3, 17, 23)).astype(np.uint8)
    got = resize(img, 9, 40).astype(np.float32)
    ref = torch.nn.functional.interpolate(torch.from_numpy(img[None].astype(np.float32)),
                                          size=(9, 40), mode="bilinear", align_corners=False,
                                          antialias=False)[0].numpy()
    assert np.abs(got - ref).max() <= 0.5 + 1e-3


@pytest.mark.parametrize("subsampling", [0, 2])
def test_simplejpeg_decodes_as_pillow_does(subsampling, monkeypatch):
    """With simplejpeg installed (pip install minicaffe[jpeg]) JPEGs decode to the same BGR
    (and gray) pixels as through Pillow: both are libjpeg-turbo with its defaults."""
    pytest.importorskip("simplejpeg")
    from PIL import Image
    import minicaffe.data.images as images
    rs = np.random.RandomState(0)
    x = np.linspace(0, 255, 40)
    base = (np.add.outer(x, x[:37]) / 2)[..., None] * np.array([1, 0.7, 0.3])
    rgb = np.clip(base + rs.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    files = []
    for a in (rgb, rgb[..., 1]):
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, "JPEG", quality=90, subsampling=subsampling)
        files.append(buf.getvalue())
    for data in files:
        for color in (True, None, False):
            monkeypatch.setattr(images, "_simplejpeg", None)
            assert images.decoder_name() == "simplejpeg"
            fast = decode_image(data, color)
            monkeypatch.setattr(images, "_simplejpeg", False)
            assert images.decoder_name() == "Pillow"
            ref = decode_image(data, color)
            assert fast.shape == ref.shape and fast.dtype == np.uint8
            np.testing.assert_array_equal(fast, ref)
    np.testing.assert_array_equal(decode_image(files[0], True)[::-1].transpose(1, 2, 0),
                                  np.asarray(Image.open(io.BytesIO(files[0]))))  # BGR
    monkeypatch.setattr(images, "_simplejpeg", None)
    with pytest.raises(ImageError, match="x.jpg: cannot decode image"):
        decode_image(files[0][:200], True, "x.jpg")
