"""minicaffe.compat.io (pycaffe's caffe.io): proto round trips, Transformer against numpy,
resize against PyTorch/Pillow/naive loops, load_image, oversample."""
import numpy as np
import pytest

import minicaffe as caffe
from minicaffe import io as cio
from minicaffe.core.errors import MinicaffeError
from minicaffe.proto import caffe_pb2


# -- proto round trips ---------------------------------------------------------------------
def test_blobproto_round_trip_nd_and_diff():
    rng = np.random.RandomState(0)
    a = rng.randn(2, 3, 4, 5, 6)
    d = rng.randn(2, 3, 4, 5, 6)
    bp = cio.array_to_blobproto(a, d)
    assert list(bp.shape.dim) == [2, 3, 4, 5, 6]
    np.testing.assert_allclose(cio.blobproto_to_array(bp), a.astype(np.float32))
    np.testing.assert_allclose(cio.blobproto_to_array(bp, return_diff=True), d.astype(np.float32))
    # survives serialization and loads into a Blob
    bp2 = caffe_pb2.BlobProto.FromString(bp.SerializeToString())
    b = caffe.Blob()
    b.from_proto(bp2)
    np.testing.assert_allclose(b.data, a.astype(np.float32))


def test_blobproto_legacy_4d_shape():
    bp = caffe_pb2.BlobProto(num=1, channels=2, height=1, width=3, data=range(6))
    out = cio.blobproto_to_array(bp)
    assert out.shape == (1, 2, 1, 3)
    np.testing.assert_array_equal(out.ravel(), np.arange(6))


def test_blobprotovector_string_round_trip():
    arrays = [np.arange(6.0).reshape(2, 3), np.ones((1, 2, 2, 1)), np.array([7.5])]
    s = cio.arraylist_to_blobprotovector_str(arrays)
    assert isinstance(s, bytes)
    vec = caffe_pb2.BlobProtoVector.FromString(s)
    assert len(vec.blobs) == 3
    back = cio.blobprotovector_str_to_arraylist(s)
    for a, b in zip(arrays, back):
        assert a.shape == b.shape
        np.testing.assert_array_equal(a, b)


def test_datum_round_trip_uint8_and_float():
    rng = np.random.RandomState(1)
    img = rng.randint(0, 256, size=(3, 4, 5)).astype(np.uint8)
    d = cio.array_to_datum(img, label=7)
    assert (d.channels, d.height, d.width, d.label) == (3, 4, 5, 7)
    assert d.data == img.tobytes() and len(d.float_data) == 0
    d2 = caffe_pb2.Datum.FromString(d.SerializeToString())
    back = cio.datum_to_array(d2)
    assert back.dtype == np.uint8
    np.testing.assert_array_equal(back, img)
    f = rng.rand(1, 2, 3)
    df = cio.array_to_datum(f)
    assert not df.HasField("label") and len(df.data) == 0
    np.testing.assert_allclose(cio.datum_to_array(df), f.astype(np.float32))
    with pytest.raises(ValueError):
        cio.array_to_datum(np.zeros((2, 2)))


def test_encoded_datum_decodes_to_bgr_chw(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    import io as pyio
    rgb = np.zeros((2, 3, 3), np.uint8)
    rgb[..., 0] = 200  # red
    buf = pyio.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    d = caffe_pb2.Datum(channels=3, height=2, width=3, data=buf.getvalue(), encoded=True)
    out = cio.datum_to_array(d)
    assert out.shape == (3, 2, 3)
    assert (out[2] == 200).all() and (out[0] == 0).all()  # BGR: red is the last channel


# -- Transformer ---------------------------------------------------------------------------
def _reference_preprocess(img, raw_scale, mean, input_scale, swap):
    x = img.astype(np.float32).transpose(2, 0, 1)
    x = x[list(swap)]
    x = x * raw_scale
    x = x - mean
    return x * input_scale


def test_transformer_preprocess_order_against_numpy():
    rng = np.random.RandomState(2)
    img = rng.rand(6, 5, 3).astype(np.float32)
    t = cio.Transformer({"data": (1, 3, 6, 5)})
    t.set_transpose("data", (2, 0, 1))
    t.set_channel_swap("data", (2, 1, 0))
    t.set_raw_scale("data", 255.0)
    mean = np.array([104.0, 117.0, 123.0])
    t.set_mean("data", mean)
    t.set_input_scale("data", 0.017)
    out = t.preprocess("data", img)
    ref = _reference_preprocess(img, 255.0, mean[:, None, None], 0.017, (2, 1, 0))
    assert out.dtype == np.float32 and out.shape == (3, 6, 5)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)
    # the input is not modified
    assert img.dtype == np.float32 and img.shape == (6, 5, 3)
    # deprocess inverts it
    np.testing.assert_allclose(t.deprocess("data", out[None]), img, rtol=1e-5, atol=1e-5)


def test_transformer_elementwise_mean_and_resize():
    rng = np.random.RandomState(3)
    t = cio.Transformer({"data": (2, 3, 4, 4)})
    t.set_transpose("data", (2, 0, 1))
    m = rng.rand(3, 4, 4)
    t.set_mean("data", m)
    img = rng.rand(8, 8, 3).astype(np.float32)
    out = t.preprocess("data", img)
    ref = cio.resize_image(img, (4, 4)).transpose(2, 0, 1) - m
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    # a mean of another size is resized to the input size
    t.set_mean("data", rng.rand(3, 8, 8))
    assert t.mean["data"].shape == (3, 4, 4)
    # a 2-D mean is one channel
    t1 = cio.Transformer({"data": (1, 1, 4, 4)})
    t1.set_mean("data", np.ones((4, 4)))
    assert t1.mean["data"].shape == (4, 4)


def test_transformer_checks():
    t = cio.Transformer({"data": (1, 3, 4, 4)})
    with pytest.raises(Exception, match="not one of the net inputs"):
        t.set_raw_scale("label", 2)
    with pytest.raises(Exception, match="Transpose order"):
        t.set_transpose("data", (1, 0))
    with pytest.raises(Exception, match="Channel swap"):
        t.set_channel_swap("data", (1, 0))
    with pytest.raises(ValueError, match="Mean channels"):
        t.set_mean("data", np.zeros(2))
    with pytest.raises(ValueError, match="Mean shape invalid"):
        t.set_mean("data", np.zeros((1, 1, 3, 4, 4)))


def test_transformer_with_net_inputs(fixtures_dir):
    net = caffe.Net(str(fixtures_dir / "lenet_v2_deploy.prototxt"), caffe.TEST)
    t = cio.Transformer({"data": net.blobs["data"].data.shape})
    t.set_transpose("data", (2, 0, 1))
    img = np.random.RandomState(4).rand(28, 28, 1)
    net.blobs["data"].data[...] = t.preprocess("data", img)
    np.testing.assert_allclose(net.blobs["data"].data[0, 0], img[:, :, 0], rtol=1e-6)


# -- resize --------------------------------------------------------------------------------
def _naive_bilinear(im, h, w):
    H, W = im.shape[:2]
    out = np.zeros((h, w) + im.shape[2:])
    for i in range(h):
        y = min(max((i + 0.5) * H / h - 0.5, 0), H - 1)
        y0 = int(np.floor(y))
        y1 = min(y0 + 1, H - 1)
        for j in range(w):
            x = min(max((j + 0.5) * W / w - 0.5, 0), W - 1)
            x0 = int(np.floor(x))
            x1 = min(x0 + 1, W - 1)
            wy, wx = y - y0, x - x0
            out[i, j] = ((1 - wy) * ((1 - wx) * im[y0, x0] + wx * im[y0, x1]) +
                         wy * ((1 - wx) * im[y1, x0] + wx * im[y1, x1]))
    return out


@pytest.mark.parametrize("shape,new", [((5, 7, 3), (9, 4)), ((8, 8, 1), (3, 5)),
                                       ((4, 6, 2), (7, 7)), ((3, 3, 3), (3, 3))])
def test_resize_bilinear_against_naive_loop(shape, new):
    im = np.random.RandomState(5).rand(*shape) * 10 - 3
    out = cio.resize_image(im, new)
    assert out.dtype == np.float32 and out.shape == new + shape[2:]
    np.testing.assert_allclose(out, _naive_bilinear(im, *new), rtol=1e-5, atol=1e-5)


def test_resize_against_torch_bilinear():
    torch = pytest.importorskip("torch")
    im = np.random.RandomState(6).rand(11, 9, 3)
    for new in [(23, 17), (5, 4)]:
        ref = torch.nn.functional.interpolate(torch.from_numpy(im.transpose(2, 0, 1))[None],
                                              size=new, mode="bilinear", align_corners=False,
                                              antialias=False)[0].numpy().transpose(1, 2, 0)
        np.testing.assert_allclose(cio.resize_image(im, new), ref, rtol=1e-5, atol=1e-5)


def test_resize_upsampling_against_pillow():
    Image = pytest.importorskip("PIL.Image")
    im = np.random.RandomState(7).rand(6, 5).astype(np.float32)
    ref = np.asarray(Image.fromarray(im, mode="F").resize((13, 11), Image.BILINEAR))
    out = cio.resize_image(im[:, :, None], (11, 13))[:, :, 0]
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_resize_constant_nearest_and_errors():
    c = np.full((4, 4, 3), 0.25)
    out = cio.resize_image(c, (2, 7))
    assert out.shape == (2, 7, 3) and np.all(out == np.float32(0.25))
    im = np.arange(16.0).reshape(4, 4, 1)
    near = cio.resize_image(im, (2, 2), interp_order=0)
    np.testing.assert_array_equal(near[:, :, 0], [[5, 7], [13, 15]])
    with pytest.raises(ValueError):
        cio.resize_image(im, (2, 2), interp_order=3)


# -- load_image ----------------------------------------------------------------------------
def test_load_image_color_gray_alpha_16bit(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    rng = np.random.RandomState(8)
    rgb = rng.randint(0, 256, size=(5, 4, 3)).astype(np.uint8)
    Image.fromarray(rgb).save(tmp_path / "rgb.png")
    img = cio.load_image(str(tmp_path / "rgb.png"))
    assert img.dtype == np.float32 and img.shape == (5, 4, 3)
    np.testing.assert_allclose(img, rgb / 255.0, rtol=1e-6)
    gray = cio.load_image(str(tmp_path / "rgb.png"), color=False)
    assert gray.shape == (5, 4, 1)
    ref = (rgb / 255.0) @ np.array([0.2125, 0.7154, 0.0721])
    np.testing.assert_allclose(gray[:, :, 0], ref, rtol=1e-5)

    g = rng.randint(0, 256, size=(3, 6)).astype(np.uint8)
    Image.fromarray(g).save(tmp_path / "g.png")
    gc = cio.load_image(str(tmp_path / "g.png"))
    assert gc.shape == (3, 6, 3)
    np.testing.assert_allclose(gc[:, :, 2], g / 255.0, rtol=1e-6)
    assert cio.load_image(str(tmp_path / "g.png"), color=False).shape == (3, 6, 1)

    rgba = rng.randint(0, 256, size=(2, 2, 4)).astype(np.uint8)
    Image.fromarray(rgba).save(tmp_path / "a.png")
    a = cio.load_image(str(tmp_path / "a.png"))
    np.testing.assert_allclose(a, rgba[:, :, :3] / 255.0, rtol=1e-6)

    g16 = (rng.rand(3, 3) * 65535).astype(np.uint16)
    Image.fromarray(g16).save(tmp_path / "g16.png")
    i16 = cio.load_image(str(tmp_path / "g16.png"), color=False)
    np.testing.assert_allclose(i16[:, :, 0], g16 / 65535.0, rtol=1e-5)

    with pytest.raises(MinicaffeError, match="no such image"):
        cio.load_image(str(tmp_path / "missing.png"))


# -- oversample ----------------------------------------------------------------------------
def test_oversample_corners_center_and_mirrors():
    rng = np.random.RandomState(9)
    ims = [rng.rand(6, 8, 2), rng.rand(6, 8, 2)]
    crops = cio.oversample(ims, (4, 4))
    assert crops.shape == (20, 4, 4, 2) and crops.dtype == np.float32
    for k, im in enumerate(ims):
        ref = [im[0:4, 0:4], im[0:4, 4:8], im[2:6, 0:4], im[2:6, 4:8], im[1:5, 2:6]]
        ref = ref + [r[:, ::-1] for r in ref]
        np.testing.assert_allclose(crops[10 * k:10 * k + 10], np.array(ref, np.float32))
