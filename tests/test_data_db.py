"""Databases and conversion tools: LMDB/LevelDB round trips, convert_mnist, convert_cifar,
convert_imageset, compute_image_mean, and their one-line errors."""
import os
import stat

import numpy as np
import pytest

from minicaffe.core import protoio
from minicaffe.data import convert
from minicaffe.data.db import (DBError, array_to_datum, datum_to_array, open_db,
                               parse_datum)
from minicaffe.data.images import decode_image, encode_image
from minicaffe.data.datasets import write_cifar_binary, write_cifar_python, write_idx
from minicaffe.proto import caffe_pb2

pytest.importorskip("lmdb")


def _records(path, backend=None):
    with open_db(path, backend) as db:
        return [(k, parse_datum(v)) for k, v in db]


# -- the database layer ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["lmdb", "leveldb"])
def test_round_trip_raw_and_float(tmp_path, backend):
    if backend == "leveldb":
        pytest.importorskip("plyvel")
    rng = np.random.RandomState(0)
    imgs = rng.randint(0, 256, (5, 3, 4, 6)).astype(np.uint8)
    floats = rng.randn(2, 1, 2, 3).astype(np.float32)
    path = tmp_path / "db"
    with open_db(path, backend, "new") as db:
        txn = db.new_transaction()
        for i, a in enumerate(imgs):
            txn.put(b"%08d" % i, array_to_datum(a, i).SerializeToString())
        for i, a in enumerate(floats):
            txn.put(b"f%d" % i, array_to_datum(a, 10 + i).SerializeToString())
        txn.commit()
    assert os.listdir(tmp_path) == ["db"]  # the temporary directory was renamed
    recs = _records(path)  # backend detected from the files
    assert [k for k, _ in recs] == [b"%08d" % i for i in range(5)] + [b"f0", b"f1"]
    for i, (_, d) in enumerate(recs[:5]):
        assert d.label == i and not d.encoded
        np.testing.assert_array_equal(datum_to_array(d), imgs[i])
    for i, (_, d) in enumerate(recs[5:]):
        assert d.label == 10 + i and len(d.float_data) == 6
        np.testing.assert_array_equal(datum_to_array(d), floats[i])
    with open_db(path) as db:
        cur = db.new_cursor()
        keys = []
        while cur.valid():
            keys.append(cur.key())
            cur.next()
        cur.seek_to_first()
        assert cur.key() == b"00000000" and len(keys) == 7


def test_lmdb_map_grows_when_full(tmp_path, monkeypatch):
    from minicaffe.data import db as dbmod
    monkeypatch.setattr(dbmod, "_LMDB_INITIAL_MAP", 64 * 1024)
    big = np.zeros((1, 100, 100), np.uint8)
    with open_db(tmp_path / "g", "lmdb", "new") as db:
        txn = db.new_transaction()
        for i in range(40):  # 40 x 10 kB > 64 kB
            txn.put(b"%03d" % i, array_to_datum(big, i).SerializeToString())
        txn.commit()
    assert len(_records(tmp_path / "g")) == 40


def test_a_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with open_db(tmp_path / "x", "lmdb", "new") as db:
            db.new_transaction().put(b"k", b"v")
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_a_new_database_gets_the_mode_of_a_plain_mkdir(tmp_path, umask):
    old = os.umask(umask)
    try:
        with open_db(tmp_path / "x", "lmdb", "new") as db:
            t = db.new_transaction()
            t.put(b"k", b"v")
            t.commit()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "x").st_mode) == 0o777 & ~umask


def test_open_errors(tmp_path):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "empty").mkdir()
    with open_db(tmp_path / "l", "lmdb", "new") as db:
        t = db.new_transaction()
        t.put(b"a", b"b")
        t.commit()
    cases = [
        (tmp_path / "missing", None, "missing: no such database"),
        (tmp_path / "afile", None, "not a database directory"),
        (tmp_path / "empty", None, "not an LMDB (no data.mdb) nor a LevelDB"),
        (tmp_path / "l", caffe_pb2.DataParameter.LEVELDB, "is a LMDB database but backend LEVELDB"),
    ]
    for path, backend, msg in cases:
        with pytest.raises(DBError) as e:
            open_db(path, backend)
        assert msg in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(DBError, match="already exists"):
        open_db(tmp_path / "l", "lmdb", "new")


def test_bad_datum_messages():
    with pytest.raises(DBError, match="^src: key 3: not a valid Datum"):
        parse_datum(b"\xff\xff\xff", "src: key 3")
    d = caffe_pb2.Datum(channels=1, height=2, width=2, data=b"abc")
    with pytest.raises(DBError, match="holds 3 bytes but its shape 1x2x2 needs 4"):
        datum_to_array(d, "src: key 4")


# -- convert_mnist ---------------------------------------------------------------------------------
def _idx_pair(tmp_path, n=25):
    rng = np.random.RandomState(1)
    imgs = rng.randint(0, 256, (n, 28, 28)).astype(np.uint8)
    labels = rng.randint(0, 10, n).astype(np.uint8)
    write_idx(str(tmp_path / "img-idx3-ubyte.gz"), imgs)
    write_idx(str(tmp_path / "lab-idx1-ubyte"), labels)
    return imgs, labels


def test_convert_mnist_round_trip(tmp_path):
    from minicaffe.tools import convert_mnist
    imgs, labels = _idx_pair(tmp_path)
    rc = convert_mnist.main([str(tmp_path / "img-idx3-ubyte.gz"), str(tmp_path / "lab-idx1-ubyte"),
                             str(tmp_path / "mnist_lmdb")])
    assert rc == 0
    recs = _records(tmp_path / "mnist_lmdb", "lmdb")
    assert [k for k, _ in recs] == [b"%08d" % i for i in range(len(imgs))]
    for i, (_, d) in enumerate(recs):
        assert (d.channels, d.height, d.width, d.label) == (1, 28, 28, labels[i])
        assert d.data == imgs[i].tobytes()


def test_convert_mnist_real_test_set(tmp_path, mnist_dir):
    from minicaffe.data.datasets import read_idx
    n = convert.convert_mnist(mnist_dir / "t10k-images-idx3-ubyte.gz",
                              mnist_dir / "t10k-labels-idx1-ubyte.gz", tmp_path / "t")
    assert n == 10000
    imgs = read_idx(mnist_dir / "t10k-images-idx3-ubyte.gz")
    with open_db(tmp_path / "t") as db:
        d = parse_datum(db.get(b"00009999"))
    assert d.data == imgs[9999].tobytes()


def test_convert_mnist_errors_are_one_line(tmp_path, capsys):
    from minicaffe.tools import convert_mnist
    imgs, labels = _idx_pair(tmp_path)
    write_idx(str(tmp_path / "short-labels"), labels[:3])
    cases = [
        ([str(tmp_path / "nope"), str(tmp_path / "lab-idx1-ubyte"), str(tmp_path / "o1")],
         "nope: no such file"),
        ([str(tmp_path / "img-idx3-ubyte.gz"), str(tmp_path / "short-labels"), str(tmp_path / "o2")],
         "must match"),
        ([str(tmp_path / "lab-idx1-ubyte"), str(tmp_path / "lab-idx1-ubyte"), str(tmp_path / "o3")],
         "expected uint8 images"),
    ]
    for args, msg in cases:
        assert convert_mnist.main(args) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("convert_mnist: error: ") and msg in err[-1]
        assert "Traceback" not in "\n".join(err)
    assert sorted(os.listdir(tmp_path)) == ["img-idx3-ubyte.gz", "lab-idx1-ubyte", "short-labels"]


# -- convert_cifar ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["bin", "py"])
def test_convert_cifar_small_files_in_the_real_format(tmp_path, fmt):
    from minicaffe.tools import convert_cifar
    rng = np.random.RandomState(2)
    src = tmp_path / ("cifar-10-batches-" + fmt)
    src.mkdir()
    parts = []
    for i in range(1, 7):
        n = 3 if i < 6 else 4
        imgs = rng.randint(0, 256, (n, 3, 32, 32)).astype(np.uint8)
        labels = rng.randint(0, 10, n)
        name = (f"data_batch_{i}" if i < 6 else "test_batch") + (".bin" if fmt == "bin" else "")
        (write_cifar_binary if fmt == "bin" else write_cifar_python)(str(src / name), imgs, labels)
        parts.append((imgs, labels))
    assert convert_cifar.main([str(tmp_path), str(tmp_path / "out")]) == 0
    train = _records(tmp_path / "out" / "cifar10_train_lmdb")
    test = _records(tmp_path / "out" / "cifar10_test_lmdb")
    assert [k for k, _ in train] == [b"%05d" % i for i in range(15)]
    assert [k for k, _ in test] == [b"%05d" % i for i in range(4)]
    tr_imgs = np.concatenate([p[0] for p in parts[:5]])
    tr_labels = np.concatenate([p[1] for p in parts[:5]])
    for i, (_, d) in enumerate(train):
        assert (d.channels, d.height, d.width) == (3, 32, 32)
        assert d.data == tr_imgs[i].tobytes() and d.label == tr_labels[i]
    assert test[3][1].data == parts[5][0][3].tobytes()


def test_convert_cifar_missing_input(tmp_path, capsys):
    from minicaffe.tools import convert_cifar
    assert convert_cifar.main([str(tmp_path / "none"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len([l for l in err if "error" in l]) == 1 and "CIFAR-10 not found" in err[-1]


# -- convert_imageset ---------------------------------------------------------------------------------
@pytest.fixture
def imageset(tmp_path):
    from PIL import Image
    rng = np.random.RandomState(3)
    root = tmp_path / "imgs"
    (root / "sub dir").mkdir(parents=True)
    names, arrays = [], []
    for i in range(6):
        rgb = rng.randint(0, 256, (8 + i % 2, 10, 3)).astype(np.uint8)
        ext = "png" if i % 3 else "jpg"
        name = f"sub dir/im{i}.{ext}"
        Image.fromarray(rgb).save(root / name, quality=95)
        names.append(name)
        arrays.append(decode_image((root / name).read_bytes()))  # BGR as stored
    lst = tmp_path / "list.txt"
    lst.write_text("".join(f"{n} {i}\n" for i, n in enumerate(names)))
    return root, lst, names, arrays


def test_convert_imageset_raw_keys_and_pixels(imageset, tmp_path):
    from minicaffe.tools import convert_imageset
    root, lst, names, arrays = imageset
    assert convert_imageset.main([str(root) + "/", str(lst), str(tmp_path / "db")]) == 0
    recs = _records(tmp_path / "db")
    assert [k for k, _ in recs] == [b"%08d_" % i + n.encode() for i, n in enumerate(names)]
    for i, (_, d) in enumerate(recs):
        assert d.label == i and not d.encoded
        np.testing.assert_array_equal(datum_to_array(d), arrays[i])


def test_convert_imageset_flags(imageset, tmp_path):
    from minicaffe.tools import convert_imageset
    root, lst, names, arrays = imageset
    assert convert_imageset.main(["--gray", "--resize_width=5", "--resize_height=4",
                                  "--check_size", str(root) + "/", str(lst),
                                  str(tmp_path / "g")]) == 0
    for _, d in _records(tmp_path / "g"):
        assert (d.channels, d.height, d.width) == (1, 4, 5)
    assert convert_imageset.main(["--encoded=true", str(root) + "/", str(lst),
                                  str(tmp_path / "e")]) == 0
    recs = _records(tmp_path / "e")
    for i, (_, d) in enumerate(recs):  # the files' own bytes, untouched
        assert d.encoded and d.data == (root / names[i]).read_bytes()
    assert convert_imageset.main(["--encode_type", "png", str(root) + "/", str(lst),
                                  str(tmp_path / "p")]) == 0
    for i, (_, d) in enumerate(_records(tmp_path / "p")):  # re-encoded losslessly
        assert d.encoded and d.data[:4] == b"\x89PNG"
        np.testing.assert_array_equal(decode_image(d.data), arrays[i])
    assert convert_imageset.main(["--shuffle", str(root) + "/", str(lst),
                                  str(tmp_path / "s")]) == 0
    labels = sorted(d.label for _, d in _records(tmp_path / "s"))
    assert labels == list(range(6))


def test_convert_imageset_check_size_and_missing_images(imageset, tmp_path, capsys):
    from minicaffe.tools import convert_imageset
    root, lst, names, arrays = imageset
    rc = convert_imageset.main(["--check_size", str(root) + "/", str(lst), str(tmp_path / "c")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 1 and "list.txt:2 (sub dir/im1.png): incorrect data field size" in err
    assert not (tmp_path / "c").exists()
    lst2 = tmp_path / "l2.txt"
    lst2.write_text(f"{names[0]} 0\nmissing.png 1\n")
    assert convert_imageset.main([str(root) + "/", str(lst2), str(tmp_path / "m")]) == 0
    assert len(_records(tmp_path / "m")) == 1  # skipped, as Caffe
    assert convert_imageset.main([str(root) + "/", str(tmp_path / "nolist"),
                                  str(tmp_path / "n")]) == 1
    assert "nolist: no such list file" in capsys.readouterr().err


# -- compute_image_mean --------------------------------------------------------------------------------
def test_compute_image_mean(tmp_path):
    from minicaffe.tools import compute_image_mean
    rng = np.random.RandomState(4)
    imgs = rng.randint(0, 256, (7, 3, 4, 5)).astype(np.uint8)
    with open_db(tmp_path / "db", "lmdb", "new") as db:
        t = db.new_transaction()
        for i, a in enumerate(imgs):
            d = array_to_datum(a, 0) if i % 2 else caffe_pb2.Datum(
                data=encode_image(a, "png"), encoded=True)
            t.put(b"%02d" % i, d.SerializeToString())
        t.commit()
    assert compute_image_mean.main([str(tmp_path / "db"), str(tmp_path / "mean.binaryproto")]) == 0
    p = protoio.read_binary(str(tmp_path / "mean.binaryproto"), caffe_pb2.BlobProto())
    assert (p.num, p.channels, p.height, p.width) == (1, 3, 4, 5)
    np.testing.assert_allclose(np.asarray(p.data).reshape(3, 4, 5), imgs.mean(0), rtol=1e-6)
    # a record of another size is one line naming the key
    with open_db(tmp_path / "bad", "lmdb", "new") as db:
        t = db.new_transaction()
        t.put(b"a", array_to_datum(imgs[0]).SerializeToString())
        t.put(b"b", array_to_datum(imgs[0][:, :2]).SerializeToString())
        t.commit()
    with pytest.raises(Exception, match="bad: key b: incorrect data field size"):
        convert.compute_image_mean(tmp_path / "bad")


@pytest.mark.parametrize("tool", ["convert_mnist", "convert_cifar", "convert_imageset",
                                  "compute_image_mean"])
def test_tools_have_help(tool, capsys):
    import importlib
    mod = importlib.import_module(f"minicaffe.tools.{tool}")
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    assert "usage: python -m minicaffe.tools." + tool in capsys.readouterr().out


def test_tool_runs_as_a_module(tmp_path):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "minicaffe.tools.compute_image_mean",
                        str(tmp_path / "nodb")], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == \
        f"compute_image_mean: error: {tmp_path / 'nodb'}: no such database (the directory does not exist)"
    assert "Traceback" not in r.stderr
