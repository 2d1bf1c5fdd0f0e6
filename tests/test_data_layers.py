"""Data layers on small generated files: Data (LMDB/LevelDB) with its prefetch thread,
ImageData, HDF5Data, HDF5Output, MemoryData transforms; order, wrap-around, sharding,
clean shutdown and one-line errors naming the source and the record."""
import gc
import logging
import threading
import time

import numpy as np
import pytest

from minicaffe.core import context, log
from minicaffe.core.blob import Blob
from minicaffe.data.db import array_to_datum, open_db
from minicaffe.data.images import encode_image
from minicaffe.core.errors import LayerError, MinicaffeError
from minicaffe.network.net import Net
from minicaffe.proto import caffe_pb2
from minicaffe.compat.testing import make_layer

pytest.importorskip("lmdb")
TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name.startswith("prefetch")]


@pytest.fixture(autouse=True)
def no_thread_left_behind():
    yield
    gc.collect()
    deadline = time.time() + 60   # liveness: only ends a hang
    while prefetch_threads() and time.time() < deadline:
        time.sleep(0.01)
    assert not prefetch_threads(), "a prefetch thread outlived its test"


@pytest.fixture
def info_log():
    """Lines the minicaffe logger writes at INFO and above during the test."""
    lines = []

    class H(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    h = H()
    old = log.logger.level
    log.logger.setLevel(logging.INFO)
    log.logger.addHandler(h)
    yield lines
    log.logger.removeHandler(h)
    log.logger.setLevel(old)


def make_db(path, images, labels=None, encoded=None, backend="lmdb", values=None):
    """A database of Datums under keys %08d (``values`` overrides single records)."""
    with open_db(path, backend, "new") as db:
        t = db.new_transaction()
        for i, a in enumerate(images):
            if encoded:
                d = caffe_pb2.Datum(data=encode_image(a, encoded), encoded=True)
            else:
                d = array_to_datum(a)
            d.label = int(labels[i]) if labels is not None else i
            v = d.SerializeToString()
            if values and i in values:
                v = values[i]
            t.put(b"%08d" % i, v)
        t.commit()
    return str(path)


def data_layer(source, batch=4, extra="", transform="", phase=TRAIN, backend="LMDB"):
    return make_layer(f'name: "d" type: "Data" top: "data" top: "label" '
                      f'data_param {{ source: "{source}" batch_size: {batch} backend: {backend} {extra} }} '
                      f'transform_param {{ {transform} }}', phase)


def run(layer, n):
    top = [Blob(), Blob()]
    layer.setup([], top)
    out = []
    for _ in range(n):
        layer.forward([], top)
        out.append((top[0].data.copy(), top[1].data.copy()))
    return top, out


@pytest.fixture
def images():
    return np.random.RandomState(0).randint(0, 256, (10, 3, 5, 6)).astype(np.uint8)


# -- Data: order, wrap-around, transform, shutdown ----------------------------------------------
def test_data_layer_order_wraparound_and_log(tmp_path, images, info_log):
    src = make_db(tmp_path / "db", images)
    layer = data_layer(src, batch=4, transform="scale: 0.5")
    top, out = run(layer, 5)
    assert top[0].shape == (4, 3, 5, 6) and top[1].shape == (4,)
    labels = np.concatenate([l for _, l in out]).astype(int)
    np.testing.assert_array_equal(labels, [i % 10 for i in range(20)])
    for data, lab in out:
        np.testing.assert_array_equal(data, images[lab.astype(int)] * np.float32(0.5))
    assert "output data size: 4,3,5,6" in info_log
    assert "Restarting data prefetching from start." in info_log
    layer.close()
    assert not layer.prefetch_thread.is_alive()
    layer.close()  # idempotent


def test_prefetch_count_and_zero_copy_hand_over(tmp_path, images):
    src = make_db(tmp_path / "db", images)
    layer = data_layer(src, batch=2, extra="prefetch: 2")
    top, _ = run(layer, 1)
    assert layer.prefetch_thread.n_batches == 2
    batch = layer.current_batch
    # the top's memory is the batch's buffer: no copy was made
    assert np.shares_memory(top[0].data_mem.cpu_data(), batch.data.data_mem.cpu_data())
    layer.close()


@pytest.mark.parametrize("backend", ["LMDB", "LEVELDB"])
def test_data_layer_mean_file_crop_test_phase(tmp_path, images, backend):
    if backend == "LEVELDB":
        pytest.importorskip("plyvel")
    from minicaffe.core import protoio
    src = make_db(tmp_path / "db", images, backend=backend.lower())
    mean = np.random.RandomState(1).uniform(0, 255, (3, 5, 6)).astype(np.float32)
    p = caffe_pb2.BlobProto(num=1, channels=3, height=5, width=6)
    p.data.extend(mean.ravel().tolist())
    protoio.write_binary(str(tmp_path / "mean.binaryproto"), p)
    layer = data_layer(src, batch=3, phase=TEST, backend=backend,
                       transform=f'crop_size: 3 mean_file: "{tmp_path}/mean.binaryproto" scale: 2')
    top, out = run(layer, 2)
    assert top[0].shape == (3, 3, 3, 3)
    for data, lab in out:
        ref = (images[lab.astype(int)][:, :, 1:4, 1:4] - mean[:, 1:4, 1:4]) * np.float32(2)
        np.testing.assert_allclose(data, ref, rtol=1e-6)
    layer.close()


def test_encoded_db_gives_the_same_batches_as_raw(tmp_path, images):
    raw = make_db(tmp_path / "raw", images)
    enc = make_db(tmp_path / "enc", images, encoded="png")
    _, a = run(data_layer(raw, batch=5), 2)
    _, b = run(data_layer(enc, batch=5), 2)
    for (da, la), (db_, lb) in zip(a, b):
        np.testing.assert_array_equal(da, db_)
        np.testing.assert_array_equal(la, lb)


def test_train_crops_and_mirrors_reproducibly_from_the_seed(tmp_path, images):
    src = make_db(tmp_path / "db", images)
    t = "crop_size: 3 mirror: true"
    context.set_random_seed(5)
    _, a = run(data_layer(src, batch=5, transform=t), 2)
    context.set_random_seed(5)
    _, b = run(data_layer(src, batch=5, transform=t), 2)
    context.set_random_seed(6)
    _, c = run(data_layer(src, batch=5, transform=t), 2)
    np.testing.assert_array_equal(a[0][0], b[0][0])
    np.testing.assert_array_equal(a[1][0], b[1][0])
    assert not all(np.array_equal(x[0], y[0]) for x, y in zip(a, c))
    # every output is some crop (possibly mirrored) of its own image
    for data, lab in a:
        for x, i in zip(data, lab.astype(int)):
            crops = [images[i][:, h:h + 3, w:w + 3] for h in range(3) for w in range(4)]
            assert any(np.array_equal(x, cr) or np.array_equal(x, cr[:, :, ::-1]) for cr in crops)


def test_rand_skip(tmp_path, images, info_log):
    src = make_db(tmp_path / "db", images)
    context.set_random_seed(3)
    _, out = run(data_layer(src, batch=2, extra="rand_skip: 7"), 1)
    skipped = [int(l.split()[2]) for l in info_log if l.startswith("Skipping first")]
    assert len(skipped) == 1 and 0 <= skipped[0] < 7
    np.testing.assert_array_equal(out[0][1], [skipped[0], skipped[0] + 1])


def test_thread_stops_when_the_net_is_deleted(tmp_path, images):
    src = make_db(tmp_path / "db", images)
    text = f'''name: "n"
layer {{ name: "d" type: "Data" top: "data" top: "label"
        data_param {{ source: "{src}" batch_size: 2 backend: LMDB }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param {{ num_output: 3 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}'''
    net = Net(text, TRAIN)
    net.forward_backward()
    assert len(prefetch_threads()) == 1
    del net
    gc.collect()
    deadline = time.time() + 60   # liveness: only ends a hang
    while prefetch_threads() and time.time() < deadline:
        time.sleep(0.01)
    assert not prefetch_threads()


def test_thread_copies_mode_rank_and_draws_its_seed(tmp_path, images):
    src = make_db(tmp_path / "db", images)
    seen = {}

    class Probe:
        def load_batch(self, batch, rng):
            seen["rank"] = context.solver_rank()
            seen["rng_is_own"] = rng is context.rng()
            seen["draw"] = int(rng.randint(1 << 30))
            batch.data.mutable_cpu_data()

    from minicaffe.data.prefetch import Batch, PrefetchThread
    context.set_random_seed(9)
    context.set_solver_rank(0)
    parent_state = np.random.RandomState(9).randint(0, 2 ** 32, dtype=np.uint32)
    th = PrefetchThread(Probe(), [Batch((1,))], name="prefetch:probe")
    th.start()
    th.next_batch()
    th.stop()
    assert th.seed == int(parent_state)  # the parent's generator drew the child's seed
    assert seen["rng_is_own"] and seen["rank"] == 0
    assert seen["draw"] == np.random.RandomState(th.seed).randint(1 << 30)


# -- sharding --------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3])
def test_sharded_readers_see_disjoint_records(tmp_path, n):
    imgs = np.arange(12 * 4, dtype=np.uint8).reshape(12, 1, 2, 2)
    src = make_db(tmp_path / "db", imgs)
    seen = []
    try:
        context.set_solver_count(n)
        for r in range(n):
            context.set_solver_rank(r)
            _, out = run(data_layer(src, batch=2), 12 // n // 2)
            labels = np.concatenate([l for _, l in out]).astype(int)
            assert all(i % n == r for i in labels)  # record i goes to rank i % n
            seen.append(set(labels))
    finally:
        context.set_solver_count(1)
        context.set_solver_rank(0)
    assert set().union(*seen) == set(range(12))
    assert sum(len(s) for s in seen) == 12


def test_test_phase_is_not_sharded(tmp_path):
    imgs = np.zeros((4, 1, 2, 2), np.uint8)
    src = make_db(tmp_path / "db", imgs)
    try:
        context.set_solver_count(2)
        context.set_solver_rank(1)
        _, out = run(data_layer(src, batch=4, phase=TEST), 1)
    finally:
        context.set_solver_count(1)
        context.set_solver_rank(0)
    np.testing.assert_array_equal(out[0][1], [0, 1, 2, 3])


# -- bad input -------------------------------------------------------------------------------------
def one_line(e):
    msg = str(e)
    assert "\n" not in msg, msg
    return msg


def test_missing_and_empty_sources(tmp_path):
    with pytest.raises(LayerError) as e:
        run(data_layer(str(tmp_path / "nodb")), 1)
    assert "layer 'd' (Data): " in one_line(e.value) and "nodb: no such database" in str(e.value)
    with open_db(tmp_path / "empty", "lmdb", "new"):
        pass
    with pytest.raises(LayerError, match="empty: the database is empty"):
        run(data_layer(str(tmp_path / "empty")), 1)


def test_a_layer_whose_set_up_failed_closes_quietly(tmp_path):
    """close() after a failed set-up (no prefetch thread was started) raises nothing, so
    the set-up's own error is the one a caller sees (the bench's shape probe closes every
    data layer it set up: it raised AttributeError over a database it could not open)."""
    layer = data_layer(str(tmp_path / "nodb"))
    with pytest.raises(LayerError, match="no such database"):
        layer.setup([], [Blob(), Blob()])
    layer.close()
    layer.close()


def _expect_forward_error(finishes, layer, n_ok, match):
    top = [Blob(), Blob()]
    layer.setup([], top)
    for _ in range(n_ok):
        layer.forward([], top)
    with finishes():
        with pytest.raises(LayerError) as e:
            layer.forward([], top)
    msg = one_line(e.value)
    assert match in msg, msg
    assert msg.startswith("layer 'd' (Data): ")
    th = layer.prefetch_thread
    th.join(60)
    assert not th.is_alive()  # the prefetch thread stopped
    with pytest.raises(LayerError):  # and the error stays (no hang on a second try)
        layer.forward([], top)


def test_datum_of_another_shape_names_the_key(tmp_path, images, finishes):
    odd = array_to_datum(np.zeros((3, 5, 7), np.uint8), 0).SerializeToString()
    src = make_db(tmp_path / "db", images, values={5: odd})
    _expect_forward_error(finishes, data_layer(src, batch=2), 2,
                          "db: key 00000005: Datum shape 3x5x7 differs from the first datum's 3x5x6")


def test_corrupt_record_names_the_key(tmp_path, images, finishes):
    src = make_db(tmp_path / "db", images, values={3: b"\xff\xfe\x00garbage"})
    _expect_forward_error(finishes, data_layer(src, batch=2), 1,
                          "db: key 00000003: not a valid Datum")


def test_undecodable_image_names_the_key(tmp_path, images, finishes):
    bad = caffe_pb2.Datum(data=b"\x89PNG but not really", encoded=True).SerializeToString()
    src = make_db(tmp_path / "db", images, encoded="png", values={4: bad})
    _expect_forward_error(finishes, data_layer(src, batch=2), 2,
                          "db: key 00000004: cannot decode image")


def test_setup_errors_mean_shape_and_crop(tmp_path, images):
    from minicaffe.core import protoio
    src = make_db(tmp_path / "db", images)
    p = caffe_pb2.BlobProto(num=1, channels=2, height=5, width=6)
    p.data.extend([0.0] * 60)
    protoio.write_binary(str(tmp_path / "m.binaryproto"), p)
    with pytest.raises(LayerError) as e:
        run(data_layer(src, transform=f'mean_file: "{tmp_path}/m.binaryproto"'), 1)
    assert "db: key 00000000: the mean file" in one_line(e.value) and "2x5x6" in str(e.value)
    with pytest.raises(LayerError) as e:
        run(data_layer(src, transform="crop_size: 6"), 1)
    assert "crop_size 6 is larger than the image (5x6)" in one_line(e.value)
    with pytest.raises(LayerError, match="batch_size must be specified"):
        run(data_layer(src, batch=0), 1)


def test_backend_mismatch_and_autodetect(tmp_path, images):
    src = make_db(tmp_path / "db", images)
    with pytest.raises(LayerError, match="is a LMDB database but backend LEVELDB"):
        run(data_layer(src, backend="LEVELDB"), 1)
    layer = make_layer(f'name: "d" type: "Data" top: "data" top: "label" '
                       f'data_param {{ source: "{src}" batch_size: 2 }}')  # backend not given
    _, out = run(layer, 1)
    np.testing.assert_array_equal(out[0][1], [0, 1])


# -- ImageData -------------------------------------------------------------------------------------
@pytest.fixture
def image_list(tmp_path):
    from PIL import Image
    rng = np.random.RandomState(2)
    root = tmp_path / "imgs"
    root.mkdir()
    arrays = []
    lines = []
    for i in range(7):
        rgb = rng.randint(0, 256, (6, 8, 3)).astype(np.uint8)
        Image.fromarray(rgb).save(root / f"a {i}.png")
        arrays.append(rgb[:, :, ::-1].transpose(2, 0, 1))  # BGR CHW
        lines.append(f"a {i}.png {10 + i}\n")
    (tmp_path / "list.txt").write_text("".join(lines))
    return tmp_path, np.stack(arrays)


def image_layer(tmp_path, params, transform="", phase=TRAIN):
    return make_layer(f'name: "d" type: "ImageData" top: "data" top: "label" '
                      f'image_data_param {{ source: "{tmp_path}/list.txt" root_folder: "{tmp_path}/imgs/" '
                      f'{params} }} transform_param {{ {transform} }}', phase)


def test_image_data_order_labels_and_wrap(image_list):
    tmp_path, arrays = image_list
    top, out = run(image_layer(tmp_path, "batch_size: 3"), 3)
    assert top[0].shape == (3, 3, 6, 8)
    labels = np.concatenate([l for _, l in out]).astype(int)
    np.testing.assert_array_equal(labels, [10 + i % 7 for i in range(9)])
    for data, lab in out:
        np.testing.assert_array_equal(data, arrays[lab.astype(int) - 10])


def test_image_data_resize_gray_and_shuffle(image_list):
    tmp_path, arrays = image_list
    top, out = run(image_layer(tmp_path, "batch_size: 7 shuffle: true new_height: 4 "
                                         "new_width: 5 is_color: false"), 2)
    assert top[0].shape == (7, 1, 4, 5)
    for _, lab in out:  # each epoch is a permutation of the list
        assert sorted(lab.astype(int)) == list(range(10, 17))
    assert any(not np.array_equal(lab, np.arange(10, 17)) for _, lab in out)


def test_image_data_errors(image_list):
    tmp_path, _ = image_list
    with pytest.raises(LayerError, match="list.txt: no such list file"):
        run(make_layer(f'name: "d" type: "ImageData" top: "data" top: "label" '
                       f'image_data_param {{ source: "{tmp_path}/none/list.txt" batch_size: 1 }}'), 1)
    (tmp_path / "list.txt").write_text("a 0.png 1\nmissing.png 2\na 1.png 3\n")
    layer = image_layer(tmp_path, "batch_size: 1")
    top = [Blob(), Blob()]
    layer.setup([], top)
    layer.forward([], top)
    with pytest.raises(LayerError) as e:
        layer.forward([], top)
    msg = one_line(e.value)
    assert "list.txt:2 (missing.png): could not open or find file" in msg
    (tmp_path / "list.txt").write_text("a 0.png x\n")
    with pytest.raises(LayerError, match=r"list.txt:1: the label 'x' is not an integer"):
        run(image_layer(tmp_path, "batch_size: 1"), 1)
    (tmp_path / "list.txt").write_text("\n")
    with pytest.raises(LayerError, match="the list file is empty"):
        run(image_layer(tmp_path, "batch_size: 1"), 1)


def test_image_data_sharded(image_list):
    tmp_path, _ = image_list
    seen = []
    try:
        context.set_solver_count(2)
        for r in range(2):
            context.set_solver_rank(r)
            _, out = run(image_layer(tmp_path, "batch_size: 2 shuffle: true"), 3)
            seen.append(set(np.concatenate([l for _, l in out]).astype(int)))
    finally:
        context.set_solver_count(1)
        context.set_solver_rank(0)
    assert seen[0] == {10, 12, 14, 16} and seen[1] == {11, 13, 15}


# -- HDF5Data / HDF5Output ---------------------------------------------------------------------------
@pytest.fixture
def h5_files(tmp_path):
    h5py = pytest.importorskip("h5py")
    rng = np.random.RandomState(3)
    rows = []
    for f, n in (("a.h5", 5), ("b.h5", 3)):
        data = rng.randn(n, 2, 3).astype(np.float64)
        label = np.arange(len(rows), len(rows) + n, dtype=np.int32)
        with h5py.File(tmp_path / f, "w") as h:
            h["data"] = data
            h["label"] = label
        rows.extend(zip(data, label))
    (tmp_path / "list.txt").write_text("a.h5\nb.h5\n")
    return tmp_path, rows


def h5_layer(tmp_path, params="batch_size: 3"):
    return make_layer(f'name: "h" type: "HDF5Data" top: "data" top: "label" '
                      f'hdf5_data_param {{ source: "{tmp_path}/list.txt" {params} }}')


def test_hdf5_data_batches_across_files(h5_files, info_log):
    tmp_path, rows = h5_files
    top, out = run(h5_layer(tmp_path), 4)
    assert top[0].shape == (3, 2, 3) and top[1].shape == (3,)
    labels = np.concatenate([l for _, l in out]).astype(int)
    np.testing.assert_array_equal(labels, [i % 8 for i in range(12)])
    for data, lab in out:
        for x, i in zip(data, lab.astype(int)):
            np.testing.assert_allclose(x, rows[i][0], rtol=1e-6)
    assert "Looping around to first file." in info_log


def test_hdf5_data_shuffle_and_shard(h5_files):
    tmp_path, _ = h5_files
    _, out = run(h5_layer(tmp_path, "batch_size: 8 shuffle: true"), 2)
    for _, lab in out:
        assert sorted(lab.astype(int)) == list(range(8))
    try:
        context.set_solver_count(2)
        context.set_solver_rank(1)
        _, out = run(h5_layer(tmp_path, "batch_size: 3"), 1)
    finally:
        context.set_solver_count(1)
        context.set_solver_rank(0)
    np.testing.assert_array_equal(out[0][1], [1, 3, 6])  # odd rows of each file


def test_hdf5_data_errors(h5_files):
    tmp_path, _ = h5_files
    layer = make_layer(f'name: "h" type: "HDF5Data" top: "data" top: "nosuch" '
                       f'hdf5_data_param {{ source: "{tmp_path}/list.txt" batch_size: 2 }}')
    with pytest.raises(LayerError, match="a.h5: failed to find HDF5 dataset 'nosuch'"):
        layer.setup([], [Blob(), Blob()])
    (tmp_path / "l2.txt").write_text("missing.h5\n")
    layer = make_layer(f'name: "h" type: "HDF5Data" top: "data" '
                       f'hdf5_data_param {{ source: "{tmp_path}/l2.txt" batch_size: 2 }}')
    with pytest.raises(LayerError, match="missing.h5: no such HDF5 file"):
        layer.setup([], [Blob()])


def test_hdf5_output_appends_and_finishes_on_close(tmp_path):
    h5py = pytest.importorskip("h5py")
    out = tmp_path / "out.h5"
    layer = make_layer(f'name: "o" type: "HDF5Output" bottom: "data" bottom: "label" '
                       f'hdf5_output_param {{ file_name: "{out}" }}')
    a = Blob((2, 3))
    b = Blob((2,))
    layer.setup([a, b], [])
    a.data[...] = [[1, 2, 3], [4, 5, 6]]
    b.data[...] = [7, 8]
    layer.forward([a, b], [])
    a.data[...] += 10
    layer.forward([a, b], [])
    assert not out.exists()  # still being written under a temporary name
    layer.close()
    with h5py.File(out, "r") as f:
        np.testing.assert_array_equal(f["data"][:], [[1, 2, 3], [4, 5, 6], [11, 12, 13], [14, 15, 16]])
        np.testing.assert_array_equal(f["label"][:], [7, 8, 7, 8])
    assert [p.name for p in tmp_path.iterdir()] == ["out.h5"]


# -- MemoryData transforms ---------------------------------------------------------------------------
def test_memory_data_add_mat_vector_transforms():
    layer = make_layer('name: "m" type: "MemoryData" top: "data" top: "label" '
                       'memory_data_param { batch_size: 2 channels: 1 height: 2 width: 2 } '
                       'transform_param { crop_size: 2 mean_value: 1 scale: 0.5 }', TEST)
    top = [Blob(), Blob()]
    layer.setup([], top)
    imgs = [np.arange(16, dtype=np.uint8).reshape(1, 4, 4) + i for i in range(4)]
    layer.add_mat_vector(imgs, [0, 1, 2, 3])
    layer.forward([], top)
    layer.forward([], top)
    np.testing.assert_array_equal(top[1].data, [2, 3])
    np.testing.assert_array_equal(top[0].data[1], (imgs[3][:, 1:3, 1:3] - 1.0) * 0.5)
    with pytest.raises(LayerError, match="multiple of the batch size"):
        layer.add_mat_vector(imgs[:3], [0, 1, 2])
    d = [array_to_datum(np.full((1, 4, 4), 9, np.uint8), 5)] * 2
    layer.add_datum_vector(d)
    layer.forward([], top)
    np.testing.assert_array_equal(top[0].data, np.full((2, 1, 2, 2), 4.0))


def test_net_with_data_layers_trains_lenet_shape(tmp_path):
    """The LeNet train/test prototxt from examples/ builds and runs on a tiny LMDB."""
    import os
    imgs = np.random.RandomState(4).randint(0, 256, (8, 1, 28, 28)).astype(np.uint8)
    make_db(tmp_path / "tr", imgs, labels=np.arange(8) % 10)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(here, "examples", "mnist", "lenet_train_test.prototxt")) as f:
        text = f.read()
    text = text.replace("examples/mnist/mnist_train_lmdb", str(tmp_path / "tr")) \
               .replace("examples/mnist/mnist_test_lmdb", str(tmp_path / "tr")) \
               .replace("batch_size: 64", "batch_size: 4").replace("batch_size: 100", "batch_size: 4")
    for phase in (TRAIN, TEST):
        net = Net(text, phase)
        loss = net.forward_backward() if phase == TRAIN else net.forward_prefilled()
        assert np.isfinite(loss)
        assert net.blobs["data"].shape == (4, 1, 28, 28)
        np.testing.assert_allclose(net.blobs["data"].data * 256, imgs[:4], atol=1e-4)
    del net


# -- WindowData --------------------------------------------------------------------------------------
@pytest.fixture
def window_file(tmp_path):
    from PIL import Image
    rng = np.random.RandomState(5)
    imgs = []
    for i in range(2):
        rgb = rng.randint(0, 256, (20, 24, 3)).astype(np.uint8)
        Image.fromarray(rgb).save(tmp_path / f"w{i}.png")
        imgs.append(rgb[:, :, ::-1].transpose(2, 0, 1))
    text = ("# 0\nw0.png\n3 20 24\n3\n"
            "1 0.9 2 3 12 15\n"    # foreground, class 1
            "0 0.1 0 0 23 19\n"    # background (the whole image)
            "2 0.3 5 5 9 9\n"      # neither (with bg_threshold 0.2): dropped
            "# 1\nw1.png\n3 20 24\n1\n"
            "2 0.7 10 4 20 18\n")  # foreground, class 2
    (tmp_path / "windows.txt").write_text(text)
    return tmp_path, imgs


def window_layer(tmp_path, params, transform="crop_size: 8"):
    return make_layer(f'name: "w" type: "WindowData" top: "data" top: "label" '
                      f'window_data_param {{ source: "{tmp_path}/windows.txt" '
                      f'root_folder: "{tmp_path}/" {params} }} transform_param {{ {transform} }}')


def test_window_data_warps_windows_with_caffes_sampling(window_file, info_log):
    from minicaffe.data.images import resize
    tmp_path, imgs = window_file
    top, out = run(window_layer(tmp_path, "batch_size: 4 fg_fraction: 0.5 scale: 0.5 bg_threshold: 0.2",
                                "crop_size: 8 mean_value: 100"), 3)
    assert top[0].shape == (4, 3, 8, 8)
    assert "class 0 has 1 samples" in info_log and "class 2 has 1 samples" in info_log
    fg = {1: (0, (2, 3, 12, 15)), 2: (1, (10, 4, 20, 18))}
    for data, lab in out:
        np.testing.assert_array_equal(lab[:2], [0, 0])  # background first, then foreground
        assert set(lab[2:].astype(int)) <= {1, 2}
        for x, l in zip(data, lab.astype(int)):
            i, (x1, y1, x2, y2) = (0, (0, 0, 23, 19)) if l == 0 else fg[l]
            ref = resize(np.ascontiguousarray(imgs[i][:, y1:y2 + 1, x1:x2 + 1]), 8, 8)
            np.testing.assert_allclose(x, (ref.astype(np.float32) - 100) * 0.5)


def test_window_data_context_pad_mirror_and_errors(window_file):
    tmp_path, _ = window_file
    top, out = run(window_layer(tmp_path, "batch_size: 6 fg_fraction: 0 context_pad: 2 bg_threshold: 0.2",
                                "crop_size: 10 mirror: true"), 2)
    from minicaffe.data.images import resize
    # the whole 24x20 image with 2 of 10 pixels of context: Caffe's arithmetic expands it to
    # x -8..32, y -7..27, warps the clipped part to 6x6 and pads 2 pixels on each side
    inner = resize(np.ascontiguousarray(window_file[1][0]), 6, 6).astype(np.float32)
    mirrored = 0
    for data, lab in out:
        assert (lab == 0).all()
        for x in data:
            assert (x[:, :2] == 0).all() and (x[:, 8:] == 0).all()
            assert (x[:, :, :2] == 0).all() and (x[:, :, 8:] == 0).all()
            if np.array_equal(x[:, 2:8, 2:8], inner[:, :, ::-1]):
                mirrored += 1
            else:
                np.testing.assert_array_equal(x[:, 2:8, 2:8], inner)
    assert 0 < mirrored < 12
    with pytest.raises(LayerError, match="windows.txt: failed to open window file"):
        run(make_layer(f'name: "w" type: "WindowData" top: "data" top: "label" '
                       f'window_data_param {{ source: "{tmp_path}/none/windows.txt" batch_size: 2 }} '
                       f'transform_param {{ crop_size: 4 }}'), 1)
    (tmp_path / "w1.png").unlink()
    layer = window_layer(tmp_path, "batch_size: 8 fg_fraction: 1")
    top = [Blob(), Blob()]
    layer.setup([], top)
    with pytest.raises(LayerError, match=r"windows.txt: image #1 \(.*w1.png\): could not open"):
        for _ in range(5):
            layer.forward([], top)
    layer.close()


def test_net_close_stops_prefetch_threads_now(tmp_path):
    """Net.close() (called by `minicaffe train` when training ends) stops every prefetch
    thread at once, without waiting for garbage collection."""
    import numpy as np
    from minicaffe.data.convert import convert_mnist
    from minicaffe.data.datasets import write_idx
    from minicaffe.network.net import Net, TRAIN
    from minicaffe.core.protoio import parse_text
    from minicaffe.proto import caffe_pb2
    pytest.importorskip("lmdb")
    rs = np.random.RandomState(0)
    write_idx(str(tmp_path / "i.idx"), rs.randint(0, 255, (20, 28, 28)).astype(np.uint8))
    write_idx(str(tmp_path / "l.idx"), rs.randint(0, 10, 20).astype(np.uint8))
    convert_mnist(str(tmp_path / "i.idx"), str(tmp_path / "l.idx"), str(tmp_path / "db"))
    text = ('layer { name: "d" type: "Data" top: "data" top: "label" '
            f'data_param {{ source: "{tmp_path / "db"}" backend: LMDB batch_size: 4 }} }}')
    net = Net(parse_text(text, caffe_pb2.NetParameter()), TRAIN)
    net.forward()
    assert prefetch_threads()
    net.close()
    assert not prefetch_threads()
    del net
