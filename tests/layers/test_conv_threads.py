"""The numpy convolutions' and poolings' batch-parallel path (threads.set_kernel_threads /
--threads N):
the same bits as one thread, forward and backward, for both column layouts."""
import numpy as np
import pytest

from minicaffe.core import threads
from minicaffe.kernels.conv import ConvEngine

pytest.importorskip("threadpoolctl")

GEOMETRIES = [  # C, O, groups, kernel, pad, stride, H
    (3, 32, 1, 5, 2, 1, 16),     # few channels: channel-major columns
    (16, 16, 1, 5, 2, 1, 12),    # channel-last patches, full-convolution data gradient
    (16, 24, 2, 3, 1, 2, 15),    # groups, stride 2: col2im data gradient
]


@pytest.mark.parametrize("C,O,G,k,pad,stride,H", GEOMETRIES)
def test_kernel_pool_is_bit_identical_to_one_thread(C, O, G, k, pad, stride, H):
    OH = (H + 2 * pad - k) // stride + 1
    engine = ConvEngine(C, O, G, (k, k), (pad, pad), (stride, stride), (1, 1), (H, H),
                        (OH, OH))
    rs = np.random.RandomState(1701)
    x = rs.randn(24, C, H, H).astype(np.float32)
    w = rs.randn(O, C // G, k, k).astype(np.float32)
    dy = rs.randn(24, O, OH, OH).astype(np.float32)
    bias = rs.randn(O).astype(np.float32)
    budget = 4 * C * k * k * OH * OH * 3     # three images per chunk: 8 chunks
    results = []
    try:
        for n in (1, 3):
            threads.set_kernel_threads(n)
            assert threads.kernel_threads() == n
            y = np.empty((24, O, OH, OH), np.float32)
            engine.forward(np, x, w, y, budget, bias=bias)
            dw = np.full_like(w, 0.5)             # the gradients accumulate
            db = np.full_like(bias, 0.25)
            dx = np.empty_like(x)
            engine.backward(np, x, w, dy, budget, dw=dw, dx=dx, db=db)
            results.append((y, dw, dx, db))
    finally:
        threads.set_kernel_threads(1)
    for serial, pooled in zip(*results):
        assert np.array_equal(serial, pooled)
    y, db = results[0][0], results[0][3]        # the bias and its gradient are there
    plain = np.empty_like(y)
    engine.forward(np, x, w, plain, budget)
    np.testing.assert_allclose(y - plain, np.broadcast_to(bias[:, None, None], y.shape[1:])
                               [None].repeat(24, 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db, dy.astype(np.float64).sum(axis=(0, 2, 3)) + 0.25,
                               rtol=1e-5, atol=1e-4)


POOLS = [  # kernel, stride, pad, H: Caffe's rounded-up windows, overlapping and not
    (3, 2, 0, 16),
    (2, 2, 0, 12),
    (3, 1, 1, 9),
]


@pytest.mark.parametrize("k,stride,pad,H", POOLS)
def test_pooling_in_the_kernel_pool_is_bit_identical_to_one_thread(k, stride, pad, H,
                                                                   monkeypatch):
    from minicaffe.kernels import pooling
    monkeypatch.setattr(pooling, "PARALLEL_MIN_WORK", 0)   # small inputs split, too
    rs = np.random.RandomState(7)
    x = rs.randn(10, 4, H, H).astype(np.float32)
    x[1, 2] = 0.5                                    # ties: the first maximum wins
    results = []
    try:
        for n in (1, 3):
            threads.set_kernel_threads(n)
            y, mask = pooling.max_pool_forward(x, k, stride, pad)
            dy = np.random.RandomState(8).randn(*y.shape).astype(np.float32)
            dx = pooling.max_pool_backward(dy, mask, x.shape)
            out = np.full_like(y, np.nan)                 # into a given output, too
            ya = pooling.ave_pool_forward(x, k, stride, pad, out=out)
            dxa = pooling.ave_pool_backward(dy, x.shape, k, stride, pad)
            results.append((y, mask, dx, ya, out, dxa))
    finally:
        threads.set_kernel_threads(1)
    for serial, pooled in zip(*results):
        assert serial.dtype == pooled.dtype and np.array_equal(serial, pooled)


@pytest.mark.parametrize("n", [1, 2])
def test_max_pooling_makes_no_mask_sized_temporaries(n):
    """numpy MAX pooling (CIFAR-10 quick's pool1 shape), on one thread and split over
    two: after a first call (which makes the per-thread scratch), a forward allocates
    its result mask and nothing else of that order, a backward into a given ``out``
    nothing of it (tracemalloc's peak).  Fresh temporaries of several MB per call went
    back to the system each step with two threads (docs/performance.md)."""
    import tracemalloc
    from minicaffe.kernels import pooling
    x = np.random.RandomState(5).randn(100, 32, 32, 32).astype(np.float32)
    y = np.empty((100, 32, 16, 16), np.float32)
    dx = np.empty_like(x)
    # which pool thread takes which chunk is not fixed: on a loaded machine one thread
    # can take both chunks of a call, and the other makes its scratch at a later call --
    # so the steady state is the least of the calls after the first (the defect: every
    # call's temporaries, whatever the call)
    fwd, bwd = [], []
    try:
        threads.set_kernel_threads(n)
        for _ in range(5):
            tracemalloc.start()
            _, mask = pooling.max_pool_forward(x, 3, 2, out=y)
            fwd.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()
            tracemalloc.start()
            pooling.max_pool_backward(y, mask, x.shape, out=dx)
            bwd.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()
    finally:
        threads.set_kernel_threads(1)
    assert min(fwd[1:]) < 1.2 * mask.nbytes, (fwd, mask.nbytes)
    assert min(bwd[1:]) < 0.2 * mask.nbytes, (bwd, mask.nbytes)


def test_cifar10_quick_training_steps_with_two_threads_match_one_thread(monkeypatch):
    """The public switch (``set_num_threads``, as ``--threads 2``): the same weights
    after three solver steps of CIFAR-10 quick, convolutions and poolings split."""
    import os
    import minicaffe
    from minicaffe.kernels import pooling
    from minicaffe.synthetic import synthetic_solver
    monkeypatch.setattr(pooling, "PARALLEL_MIN_WORK", 0)
    model = os.path.join(os.path.dirname(__file__), "..", "..", "models", "cifar10_quick",
                         "train_val.prototxt")
    weights = []
    try:
        for n in (1, 2):
            minicaffe.set_num_threads(n)
            assert minicaffe.get_num_threads() == n
            solver, _ = synthetic_solver(model=model, batch=8)
            solver.step(3)
            weights.append([b.data.copy() for l in solver.net.layers for b in l.blobs])
    finally:
        minicaffe.set_num_threads(1)
    assert len(weights[0]) == 10
    for a, b in zip(*weights):
        assert np.array_equal(a, b)


GEMMS = [  # M, K, N, trans_a, trans_b, beta: InnerProduct's three products, and odd sizes
    (64, 800, 500, False, True, 0.0),     # LeNet ip1 forward: x W^T
    (500, 64, 800, True, False, 1.0),     # its weight gradient, accumulated: dy^T x
    (64, 500, 800, False, False, 0.0),    # its data gradient: dy W
    (100, 1024, 64, False, True, 0.0),    # CIFAR-10 quick ip1 forward
    (1000, 333, 77, True, True, 1.0),
    (33, 1000, 1500, False, False, 0.0),
]


@pytest.mark.parametrize("M,K,N,ta,tb,beta", GEMMS)
def test_gemm_split_in_the_kernel_pool_is_bit_identical_to_one_thread(M, K, N, ta, tb, beta,
                                                                     monkeypatch):
    """numpy GEMMs (kernels/blas.gemm: InnerProduct's) split by rows or columns over the
    pool's threads: the one-thread bits, for 2, 3 and 16 threads.  They split where this
    BLAS's kernel is listed (blas.SPLITS) and the product has two blocks along the axis
    cut; elsewhere (another BLAS, too few rows) one thread computes it whole."""
    from concurrent.futures import ThreadPoolExecutor
    from minicaffe.kernels import blas
    monkeypatch.setattr(blas, "PARALLEL_MIN_PART", 1 << 20)   # CIFAR-10's ip1 splits too
    submitted = []
    submit = ThreadPoolExecutor.submit
    monkeypatch.setattr(ThreadPoolExecutor, "submit",
                        lambda self, *a, **k: submitted.append(1) or submit(self, *a, **k))
    rs = np.random.RandomState(M + N)
    a = rs.randn(*((K, M) if ta else (M, K))).astype(np.float32)
    b = rs.randn(*((N, K) if tb else (K, N))).astype(np.float32)
    start = rs.randn(M, N).astype(np.float32)
    rows, columns = blas.SPLITS.get(threads.blas_kernel(), (None, None))
    length, align = (M, rows) if M >= N or columns is None else (N, columns)
    splits = rows is not None and length >= 2 * align
    results = []
    try:
        for n in (1, 2, 3, 16):
            threads.set_kernel_threads(n)
            out = start.copy()
            blas.gemm(np, a, b, out, trans_a=ta, trans_b=tb, beta=beta)
            results.append(out)
            # split: the caller runs a part too, the pool the others
            assert bool(submitted) == (splits and n > 1), (threads.blas_kernel(), n)
            submitted.clear()
    finally:
        threads.set_kernel_threads(1)
    want = (a.T if ta else a) @ (b.T if tb else b) + beta * start
    np.testing.assert_allclose(results[0], want, rtol=1e-4, atol=1e-3)
    for pooled in results[1:]:
        assert np.array_equal(results[0], pooled)


def test_relu_in_the_kernel_pool_is_bit_identical_to_one_thread(monkeypatch):
    """ReLU forward and backward (in place, as CIFAR-10 quick runs it) split into flat
    ranges over the pool's threads: the one-thread values, NaN gradients kept."""
    from concurrent.futures import ThreadPoolExecutor
    from minicaffe.core.blob import Blob
    from minicaffe.layers.neuron import ReLULayer
    from minicaffe.proto import caffe_pb2
    submitted = []
    submit = ThreadPoolExecutor.submit
    monkeypatch.setattr(ThreadPoolExecutor, "submit",
                        lambda self, *a, **k: submitted.append(1) or submit(self, *a, **k))
    monkeypatch.setattr(threads, "ELEMENTWISE_MIN_PART", 1000)
    rs = np.random.RandomState(3)
    x0 = rs.randn(4, 5, 20, 20).astype(np.float32)
    dy0 = rs.randn(*x0.shape).astype(np.float32)
    dy0[0, 0, 0, :3] = np.nan
    results = []
    try:
        for n in (1, 3):
            threads.set_kernel_threads(n)
            blob = Blob(x0.shape)
            blob.data[...] = x0
            layer = ReLULayer(caffe_pb2.LayerParameter(name="relu", type="ReLU"))
            layer.setup([blob], [blob])
            layer.forward([blob], [blob])
            y = blob.data.copy()
            blob.diff[...] = dy0
            layer.backward([blob], [True], [blob])
            results.append((y, blob.diff.copy()))
            assert len(submitted) == (0 if n == 1 else 4)     # 3 parts each way, the caller's one
            submitted.clear()
    finally:
        threads.set_kernel_threads(1)
    (y1, dx1), (y3, dx3) = results
    assert np.array_equal(y1, np.maximum(x0, 0))
    np.testing.assert_array_equal(dx1, dy0 * (x0 > 0))     # NaN where dy is NaN
    assert np.array_equal(y1, y3) and np.array_equal(dx1, dx3, equal_nan=True)


def test_lenet_training_steps_with_three_threads_match_one_thread():
    """LeNet at batch 64 (InnerProduct GEMMs large enough to split, ReLU, convolutions with
    their bias): the same weights after three solver steps on 1 and 3 threads."""
    import os
    import minicaffe
    from minicaffe.synthetic import synthetic_solver
    model = os.path.join(os.path.dirname(__file__), "..", "..", "models", "lenet",
                         "train_val.prototxt")
    weights = []
    try:
        for n in (1, 3):
            minicaffe.set_num_threads(n)
            solver, _ = synthetic_solver(model=model, batch=64)
            solver.step(3)
            weights.append([b.data.copy() for l in solver.net.layers for b in l.blobs])
    finally:
        minicaffe.set_num_threads(1)
    assert len(weights[0]) == 8
    for a, b in zip(*weights):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("within", [False, True])
def test_lrn_in_the_kernel_pool_is_bit_identical_to_one_thread(within, monkeypatch):
    """LRN forward and backward on batch ranges in the pool's threads (odd batch, odd
    image sizes): the one-thread values, bit for bit."""
    from minicaffe.kernels import lrn, pooling
    monkeypatch.setattr(pooling, "PARALLEL_MIN_WORK", 0)   # small inputs split, too
    rs = np.random.RandomState(11)
    x = rs.randn(7, 6, 9, 7).astype(np.float32)
    dy = rs.randn(*x.shape).astype(np.float32)
    fwd, bwd = ((lrn.lrn_within_channel_forward, lrn.lrn_within_channel_backward) if within
                else (lrn.lrn_across_channels_forward, lrn.lrn_across_channels_backward))
    results = []
    try:
        for n in (1, 3):
            threads.set_kernel_threads(n)
            y, scale = fwd(x, 5, 1e-2, 0.75)
            results.append((y, scale, bwd(dy, x, y, scale, 5, 1e-2, 0.75)))
    finally:
        threads.set_kernel_threads(1)
    for serial, pooled in zip(*results):
        assert serial.shape == x.shape and serial.dtype == pooled.dtype
        assert np.array_equal(serial, pooled)


def test_run_parts_shares_the_parts_out_and_returns_them_in_order():
    """Each thread takes the next part not yet taken (a slow part does not hold the
    others back), every part runs once, results come back in part order, and an error in
    one part is raised after the others have ended."""
    import threading
    import time
    ran = []

    def part(slot, i):
        ran.append((threading.get_ident(), slot, i))
        time.sleep(0.1 if i == 0 else 0.002)      # part 0 is slow: the others go on
        return i * i
    try:
        threads.set_kernel_threads(3)
        assert threads.run_parts(12, part) == [i * i for i in range(12)]
        assert sorted(i for _, _, i in ran) == list(range(12))
        slow = [t for t, _, i in ran if i == 0][0]
        assert sum(t == slow for t, _, _ in ran) == 1          # the others took the rest
        assert len({t for t, _, _ in ran}) >= 2 and {s for _, s, _ in ran} <= {0, 1, 2}
        finished = []

        def failing(slot, i):
            if i == 1:
                raise ValueError("part 1")
            time.sleep(0.01)
            finished.append(i)
        with pytest.raises(ValueError, match="part 1"):
            threads.run_parts(6, failing)
        assert sorted(finished) == [0, 2, 3, 4, 5]
    finally:
        threads.set_kernel_threads(1)
