"""GPU prefetch (run on the GPU machine): pinned host buffers, uploads on the prefetch
thread's own stream, the compute stream waiting on the upload event, and batches identical
to CPU mode's."""
import gc
import threading
import time

import numpy as np
import pytest

from minicaffe.core import backend, context
from minicaffe.core.blob import Blob
from minicaffe.data.db import array_to_datum, open_db
from minicaffe.core.errors import LayerError
from minicaffe.network.net import Net
from minicaffe.proto import caffe_pb2
from minicaffe.core.synced_memory import HEAD_AT_GPU
from minicaffe.compat.testing import make_layer

pytestmark = pytest.mark.gpu
pytest.importorskip("lmdb")
TRAIN = caffe_pb2.TRAIN


def make_db(path, n=37, shape=(3, 9, 10), values=None):
    imgs = np.random.RandomState(0).randint(0, 256, (n,) + shape).astype(np.uint8)
    with open_db(path, "lmdb", "new") as db:
        t = db.new_transaction()
        for i, a in enumerate(imgs):
            v = array_to_datum(a, i).SerializeToString()
            t.put(b"%08d" % i, values.get(i, v) if values else v)
        t.commit()
    return str(path), imgs


def data_layer(src, batch=8, transform="crop_size: 7 mirror: true scale: 0.5", prefetch=4,
               extra=""):
    return make_layer(f'name: "d" type: "Data" top: "data" top: "label" '
                      f'data_param {{ source: "{src}" batch_size: {batch} backend: LMDB '
                      f'prefetch: {prefetch} {extra} }} transform_param {{ {transform} }}', TRAIN)


def batches(src, n, gpu, **kw):
    context.set_random_seed(11)
    if gpu:
        context.set_mode_gpu()
    else:
        context.set_mode_cpu()
    layer = data_layer(src, **kw)
    top = [Blob(), Blob()]
    layer.setup([], top)
    out = []
    for _ in range(n):
        layer.forward([], top)
        if gpu:
            assert top[0].data_mem.head == HEAD_AT_GPU
            out.append((backend.cp.asnumpy(top[0].gpu_data()), backend.cp.asnumpy(top[1].gpu_data())))
        else:
            out.append((top[0].data.copy(), top[1].data.copy()))
    layer.close()
    context.set_mode_cpu()
    return out, layer


def test_gpu_batches_equal_cpu_batches(tmp_path):
    src, _ = make_db(tmp_path / "db")
    cpu, _ = batches(src, 12, False)  # 12 x 8 > 37: wraps around twice
    gpu, _ = batches(src, 12, True)
    for (a, la), (b, lb) in zip(cpu, gpu):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(la, lb)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("transform", ["crop_size: 7 mirror: true mean_value: 104 "
                                       "mean_value: 117 mean_value: 123 scale: 0.017",
                                       "mirror: true mean_file: MEAN scale: 0.5"])
def test_gpu_transform_gives_cpu_batches_with_workers(tmp_path, workers, transform):
    """The uint8 batch uploaded and transformed by one kernel (kernels/transform.py) equals
    CPU mode's numpy transform bit for bit, read by the thread or by worker processes."""
    from minicaffe.core import protoio
    src, _ = make_db(tmp_path / "db")
    mean = caffe_pb2.BlobProto(num=1, channels=3, height=9, width=10)
    mean.data.extend(np.random.RandomState(1).uniform(0, 255, 270).astype(np.float32).tolist())
    protoio.write_binary(str(tmp_path / "m.binaryproto"), mean)
    transform = transform.replace("MEAN", f'"{tmp_path}/m.binaryproto"')
    kw = dict(transform=transform, extra=f"workers: {workers}")
    cpu, _ = batches(src, 10, False, **kw)
    gpu, _ = batches(src, 10, True, **kw)
    for (a, la), (b, lb) in zip(cpu, gpu):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(la, lb)


@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
@pytest.mark.parametrize("crop,mean", [(0, None), (5, "file"), (6, "values"), (5, "value")])
def test_transform_kernel_equals_the_numpy_transform(dtype, crop, mean):
    from minicaffe.data.transformer import DataTransformer
    cp = backend.cp
    rs = np.random.RandomState(3)
    p = caffe_pb2.TransformationParameter(crop_size=crop, mirror=True, scale=0.37)
    t = DataTransformer(p, TRAIN)
    if mean == "file":
        t.mean = rs.uniform(0, 255, (3, 8, 9)).astype(np.float32)
    elif mean == "values":
        t.mean_values = np.asarray([104, 117, 123], np.float32)
    elif mean == "value":
        t.mean_values = np.asarray([100.5], np.float32)
    images = rs.randint(0, 256, (16, 3, 8, 9)).astype(dtype)
    mirror, hoff, woff = t.draw(16, (8, 9), np.random.RandomState(5))
    assert 0 < mirror.sum() < 16
    oshape = t.output_shape((3, 8, 9))
    a = t.apply(images, np.empty((16,) + oshape, np.float32), mirror, hoff, woff)
    b = t.apply(cp.asarray(images), cp.empty((16,) + oshape, cp.float32), mirror, hoff, woff)
    np.testing.assert_array_equal(a, cp.asnumpy(b))


def test_host_buffers_are_pinned_and_uploads_use_events(tmp_path):
    src, _ = make_db(tmp_path / "db")
    context.set_mode_gpu()
    layer = data_layer(src)
    top = [Blob(), Blob()]
    layer.setup([], top)
    layer.measure_wait = True
    for _ in range(6):
        layer.forward([], top)
    batch = layer.current_batch
    assert batch.data.data_mem.pinned and batch.label.data_mem.pinned
    assert batch.ready is not None
    stats = layer.data_wait()
    assert stats["batches"] >= 6 and stats["gpu_wait_ms"] >= 0.0
    layer.close()


def test_no_race_between_upload_and_compute(tmp_path):
    """Many batches, each consumed by kernels on the compute stream while the thread
    refills the others: the sums must equal the CPU sequence's."""
    cp = backend.cp
    src, _ = make_db(tmp_path / "db", n=64, shape=(3, 64, 64))
    cpu, _ = batches(src, 40, False, batch=16, prefetch=2, transform="scale: 1")
    context.set_random_seed(11)
    context.set_mode_gpu()
    layer = data_layer(src, batch=16, prefetch=2, transform="scale: 1")
    top = [Blob(), Blob()]
    layer.setup([], top)
    sums = cp.zeros(40, dtype=cp.float64)
    for i in range(40):  # no host synchronisation inside the loop
        layer.forward([], top)
        x = top[0].gpu_data()
        y = x
        for _ in range(20):  # keep the compute stream busy reading the batch
            y = cp.tanh(y * 0.001) + x
        sums[i] = (y - y + x).sum(dtype=cp.float64)  # read x last, after the busy work
    got = cp.asnumpy(sums)
    layer.close()
    context.set_mode_cpu()
    np.testing.assert_allclose(got, [float(a.astype(np.float64).sum()) for a, _ in cpu], rtol=1e-9)


def test_gpu_net_runs_and_thread_stops(tmp_path):
    src, _ = make_db(tmp_path / "db", shape=(1, 28, 28))
    context.set_mode_gpu()
    text = f'''name: "n"
layer {{ name: "d" type: "Data" top: "data" top: "label"
        data_param {{ source: "{src}" batch_size: 4 backend: LMDB }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param {{ num_output: 40 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}'''
    net = Net(text, TRAIN)
    for _ in range(5):
        assert np.isfinite(net.forward_backward())
    del net
    gc.collect()
    deadline = time.time() + 60   # liveness: only ends a hang
    while any(t.name.startswith("prefetch:") for t in threading.enumerate()) and time.time() < deadline:
        time.sleep(0.01)
    assert not any(t.name.startswith("prefetch:") for t in threading.enumerate())
    context.set_mode_cpu()


def test_gpu_error_reaches_forward(tmp_path):
    src, _ = make_db(tmp_path / "db", values={10: b"\xff garbage"})
    context.set_mode_gpu()
    layer = data_layer(src, batch=4)
    top = [Blob(), Blob()]
    layer.setup([], top)
    layer.forward([], top)
    layer.forward([], top)
    with pytest.raises(LayerError, match="key 00000010: not a valid Datum"):
        layer.forward([], top)
    layer.prefetch_thread.join(60)
    assert not layer.prefetch_thread.is_alive()
    context.set_mode_cpu()


def test_gpu_display_shows_the_compute_streams_wait_for_input(tmp_path):
    """GPU mode: ``Solver.data_wait_share`` is the share of the interval the compute stream
    idled for input (event-timed), in [0, 1], shown in the display line."""
    import re
    from minicaffe.solvers import get_solver
    from test_solver_nets import captured_log, messages
    src, _ = make_db(tmp_path / "db", n=40, shape=(3, 32, 32))
    (tmp_path / "net.prototxt").write_text(f'''name: "g"
layer {{ name: "d" type: "Data" top: "data" top: "label"
  transform_param {{ crop_size: 28 mirror: true scale: 0.01 }}
  data_param {{ source: "{src}" backend: LMDB batch_size: 8 workers: 2 }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param {{ num_output: 40 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
''')
    (tmp_path / "solver.prototxt").write_text(
        f'net: "{tmp_path}/net.prototxt"\nbase_lr: 0.01\nlr_policy: "fixed"\ndisplay: 5\n'
        f'max_iter: 30\nsnapshot_prefix: "{tmp_path}/s"\nsolver_mode: GPU\nrandom_seed: 3\n')
    context.set_mode_gpu()
    s = get_solver(str(tmp_path / "solver.prototxt"))
    try:
        with captured_log() as lines:
            s.step(20)
    finally:
        s.close()
        context.set_mode_cpu()
    shown = [float(x) / 100 for x in re.findall(r"iters, data wait ([\d.]+)%\), loss = ",
                                                "\n".join(messages(lines)))]
    assert len(shown) == 3 and all(0.0 <= x <= 1.0 for x in shown)
    assert s.data_wait_share is not None and abs(s.data_wait_share - shown[-1]) < 1e-3


@pytest.mark.parametrize("graphs", [True, False])
def test_the_gpu_step_reads_each_batch_at_the_data_tops_place(tmp_path, graphs):
    """The Data layer points its tops at each batch's buffers; the GPU step copies them
    into the tops' fixed places (the memory plan's), which a replayed graph reads.  A
    user's forward between steps (the top pointed elsewhere) changes nothing: the
    weights are the CPU's."""
    from minicaffe.solvers import get_solver
    from test_solver_nets import solver_param
    src, _ = make_db(tmp_path / "db", shape=(1, 28, 28))
    text = f'''name: "n"
layer {{ name: "d" type: "Data" top: "data" top: "label"
        data_param {{ source: "{src}" batch_size: 4 backend: LMDB }}
        transform_param {{ scale: 0.00390625 }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param {{ num_output: 40 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}'''

    def run(gpu):
        context.set_mode_gpu() if gpu else context.set_mode_cpu()
        try:
            s = get_solver(solver_param(text, type="SGD", base_lr=0.05, lr_policy="fixed",
                                        momentum=0.9, random_seed=5, cuda_graph=graphs))
            assert s.uses_gpu_step == gpu
            s.step(3)
            s.net.forward()
            s.step(3)
            out = [p.data.copy() for p in s.net.learnable_params]
            s.net.close()
            return out
        finally:
            context.set_mode_cpu()

    for a, b in zip(run(False), run(True)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
