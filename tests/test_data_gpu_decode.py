"""GPU JPEG decode (``--gpu_decode``, ``RunConfig.gpu_decode``; minicaffe/gpu/jpeg.py with
nvImageCodec): the setting and its errors on the CPU; on the GPU (when nvImageCodec
imports), batches equal to the CPU decode's within JPEG decoder tolerance, then the same
GPU transform, and a short training run."""
import io
import os
import sys
import types

import numpy as np
import pytest

from minicaffe.core import context
from minicaffe.core.config import RunConfig
from minicaffe.core.errors import ConfigError, LayerError, MinicaffeError
from minicaffe.proto import caffe_pb2

pytest.importorskip("lmdb")
pytest.importorskip("PIL")
from test_data_layers import data_layer, info_log, make_db, one_line, run  # noqa: E402,F401
from test_data_workers import NET, SOLVER  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples", "imagenet"))
from make_image_folder import photo  # noqa: E402

TRAIN = caffe_pb2.TRAIN


def jpeg(rgb, **kw):
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


def jpeg_db(path, n=10, size=40, values=None, **kw):
    """An LMDB of ``n`` encoded photo-like JPEG Datums (labels 0..n-1)."""
    from minicaffe.data.db import open_db
    with open_db(path, "lmdb", "new") as db:
        t = db.new_transaction()
        for i in range(n):
            d = caffe_pb2.Datum(data=jpeg(photo(i, size), **kw), encoded=True, label=i)
            t.put(b"%08d" % i, (values or {}).get(i, d.SerializeToString()))
        t.commit()
    return str(path)


def with_config(layer, **fields):
    layer.config = RunConfig(**fields)
    return layer


def nvimgcodec_imports():
    try:
        from nvidia import nvimgcodec  # noqa: F401
        return True
    except Exception:
        return False


# -- the setting (CPU) ----------------------------------------------------------------------
def test_the_setting_and_the_flag():
    from minicaffe.cli import command_help, parse_args
    assert RunConfig().gpu_decode is False
    assert RunConfig(gpu_decode=True).replace(rank=1).gpu_decode is True
    with pytest.raises(ConfigError) as e:
        RunConfig(gpu_decode="yes")
    assert one_line(e.value) == ("gpu_decode='yes': expected True or False (--gpu_decode "
                                 "decodes JPEGs on the GPU in GPU mode)")
    assert parse_args(["train", "--gpu_decode"])[1].gpu_decode is True
    assert parse_args(["train", "--gpu_decode=false"])[1].gpu_decode is False
    with pytest.raises(MinicaffeError, match="illegal value 'maybe' specified for bool flag "
                                             "'gpu_decode'"):
        parse_args(["train", "--gpu_decode=maybe"])
    assert "--gpu_decode" in command_help("train")


@pytest.mark.skipif(nvimgcodec_imports(), reason="nvImageCodec is installed")
def test_asking_without_the_package_is_one_line_naming_the_extra(tmp_path):
    src = jpeg_db(tmp_path / "db", n=3)
    with pytest.raises(LayerError) as e:
        run(with_config(data_layer(src), gpu_decode=True), 1)
    msg = one_line(e.value)
    assert msg.startswith("layer 'd' (Data): --gpu_decode needs nvImageCodec and nvJPEG "
                          "(pip install \".[gpu-jpeg]\")"), msg
    # without the setting the same layer decodes on the CPU
    top, _ = run(with_config(data_layer(src, extra="workers: 0")), 1)
    assert top[0].shape == (4, 3, 40, 40)


@pytest.mark.skipif(nvimgcodec_imports(), reason="nvImageCodec is installed")
def test_the_train_flag_without_the_package(tmp_path, monkeypatch, capsys):
    from minicaffe.cli import main
    src = jpeg_db(tmp_path / "db", n=4)
    (tmp_path / "net.prototxt").write_text(NET.format(src=src))
    (tmp_path / "solver.prototxt").write_text(SOLVER.format(
        net=tmp_path / "net.prototxt", max_iter=1, prefix=tmp_path / "s"))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--solver", "solver.prototxt", "--gpu_decode"]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("minicaffe: error: ") and 'pip install ".[gpu-jpeg]"' in last
    assert "Traceback" not in last
    assert not list(tmp_path.glob("s_iter_*"))  # nothing written


def test_cpu_mode_is_one_line(tmp_path, monkeypatch):
    """With nvImageCodec importable (here a stand-in module), CPU mode cannot decode on a
    GPU: one line naming the layer and how to ask for GPU mode."""
    if not nvimgcodec_imports():
        pkg = types.ModuleType("nvidia")
        pkg.nvimgcodec = types.ModuleType("nvidia.nvimgcodec")
        monkeypatch.setitem(sys.modules, "nvidia", pkg)
        monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", pkg.nvimgcodec)
    context.set_mode_cpu()
    src = jpeg_db(tmp_path / "db", n=3)
    with pytest.raises(LayerError) as e:
        run(with_config(data_layer(src), gpu_decode=True), 1)
    assert one_line(e.value) == ("layer 'd' (Data): --gpu_decode decodes JPEGs on the GPU: it "
                                 "needs GPU mode (minicaffe train --gpu N, or solver_mode: GPU)")


# -- on the GPU -----------------------------------------------------------------------------
@pytest.fixture
def nvimgcodec():
    from minicaffe.core import backend
    if not backend.gpu_available():
        pytest.skip("no GPU")
    return pytest.importorskip("nvidia.nvimgcodec")


def batches(layer, n, gpu, seed=5):
    from minicaffe.core import backend
    from minicaffe.core.blob import Blob
    context.set_random_seed(seed)
    context.set_mode_gpu() if gpu else context.set_mode_cpu()
    try:
        top = [Blob(), Blob()]
        layer.setup([], top)
        out = []
        for _ in range(n):
            layer.forward([], top)
            if gpu:
                out.append((backend.gpu_module().asnumpy(top[0].gpu_data()),
                            backend.gpu_module().asnumpy(top[1].gpu_data())))
            else:
                out.append((top[0].data.copy(), top[1].data.copy()))
        layer.close()
    finally:
        context.set_mode_cpu()
    return out


def assert_within_tolerance(cpu, gpu, what):
    from minicaffe.gpu.jpeg import TOLERANCE
    diffs = []
    for (a, la), (b, lb) in zip(cpu, gpu):
        np.testing.assert_array_equal(la, lb)
        diffs.append(np.abs(a.astype(np.float64) - b))
    d = np.concatenate([x.ravel() for x in diffs])
    print(f"{what}: GPU vs CPU decode: max abs diff {d.max():.3f}, mean {d.mean():.4f} "
          f"levels, {100 * (d > 0).mean():.1f}% of values differ")
    assert d.max() <= TOLERANCE["max"] and d.mean() <= TOLERANCE["mean"], (d.max(), d.mean())


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["420", "444", "gray"])
@pytest.mark.parametrize("transform", ["", "crop_size: 32 mirror: true mean_value: 104 "
                                           "mean_value: 117 mean_value: 123"])
def test_gpu_decoded_batches_match_the_cpu_decode(tmp_path, nvimgcodec, kind, transform,
                                                  info_log):
    """Data from an LMDB of JPEG Datums: the GPU-decoded batches (then the GPU transform,
    with the host's draws) equal the CPU decode's within ``jpeg.TOLERANCE``; labels,
    key order and the wrap-around are the same."""
    kw = {"subsampling": 0} if kind == "444" else {}
    if kind == "gray":
        from minicaffe.data.db import open_db
        src = str(tmp_path / "db")
        with open_db(src, "lmdb", "new") as db:
            t = db.new_transaction()
            for i in range(10):
                g = photo(i, 40)[:, :, 1].copy()
                t.put(b"%08d" % i, caffe_pb2.Datum(data=jpeg(g), encoded=True,
                                                   label=i).SerializeToString())
            t.commit()
        transform = transform.replace(" mean_value: 117 mean_value: 123", "")
    else:
        src = jpeg_db(tmp_path / "db", **kw)
    cpu = batches(data_layer(src, extra="workers: 0", transform=transform), 4, False)
    gpu = batches(with_config(data_layer(src, transform=transform), gpu_decode=True), 4, True)
    assert_within_tolerance(cpu, gpu, f"Data {kind} [{transform}]")
    assert any("JPEG decoder: nvImageCodec (nvJPEG) on GPU" in l for l in info_log)


@pytest.mark.gpu
def test_image_data_decodes_on_the_gpu(tmp_path, nvimgcodec, info_log):
    from minicaffe.compat.testing import make_layer
    root = tmp_path / "imgs"
    root.mkdir()
    lines = []
    for i in range(7):
        (root / f"p{i}.jpg").write_bytes(jpeg(photo(i, 36)))
        lines.append(f"p{i}.jpg {i}\n")
    (tmp_path / "list.txt").write_text("".join(lines))

    def layer(**cfg):
        lay = make_layer(f'name: "d" type: "ImageData" top: "data" top: "label" '
                         f'image_data_param {{ source: "{tmp_path}/list.txt" root_folder: '
                         f'"{root}/" batch_size: 3 shuffle: true }} transform_param {{ '
                         f'crop_size: 30 mirror: true }}', TRAIN)
        return with_config(lay, **cfg)
    cpu = batches(layer(data_workers=0), 5, False)
    gpu = batches(layer(gpu_decode=True), 5, True)
    assert_within_tolerance(cpu, gpu, "ImageData")
    assert any("JPEG decoder: nvImageCodec" in l for l in info_log)


@pytest.mark.gpu
def test_other_records_decode_on_the_cpu_and_a_corrupt_one_is_one_line(tmp_path, nvimgcodec):
    """A PNG record among the JPEGs is decoded on the CPU (exactly the CPU's pixels); a
    corrupt JPEG record (a JPEG marker, then garbage) ends the layer with the CPU decoder's
    line naming its key."""
    from minicaffe.data.images import encode_image
    png = photo(3, 40)[:, :, ::-1].transpose(2, 0, 1)  # BGR CHW
    src = jpeg_db(tmp_path / "db", n=8, values={
        3: caffe_pb2.Datum(data=encode_image(png, "png"), encoded=True,
                           label=3).SerializeToString()})
    gpu = batches(with_config(data_layer(src), gpu_decode=True), 1, True)
    np.testing.assert_array_equal(gpu[0][0][3], png)
    bad = jpeg_db(tmp_path / "bad", n=8, values={
        5: caffe_pb2.Datum(data=b"\xff\xd8" + bytes(range(200)), encoded=True,
                           label=5).SerializeToString()})
    with pytest.raises(LayerError) as e:
        batches(with_config(data_layer(bad), gpu_decode=True), 2, True)
    assert "key 00000005" in one_line(e.value)


@pytest.mark.gpu
def test_train_with_gpu_decode(tmp_path, nvimgcodec, monkeypatch, capsys):
    """`minicaffe train --gpu 0 --gpu_decode` trains from a JPEG LMDB; the log names the
    decoder."""
    from minicaffe.cli import main
    src = jpeg_db(tmp_path / "db", n=12)
    (tmp_path / "net.prototxt").write_text(NET.format(src=src))
    (tmp_path / "solver.prototxt").write_text(SOLVER.format(
        net=tmp_path / "net.prototxt", max_iter=4, prefix=tmp_path / "s"))
    monkeypatch.chdir(tmp_path)
    try:
        assert main(["train", "--solver", "solver.prototxt", "--gpu", "0",
                     "--gpu_decode"]) == 0
    finally:
        context.set_mode_cpu()
    err = capsys.readouterr().err
    assert "layer 'd': JPEG decoder: nvImageCodec (nvJPEG) on GPU 0" in err
    assert "Optimization Done." in err and "loss = nan" not in err
