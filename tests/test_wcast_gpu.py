"""A small net's 2-byte weight copies cast in one launch on the GPU (kernels/wcast.py,
engine/step.py): the kernel bit for bit against the numpy body, and LeNet's training step
with it bit for bit as with each layer casting its own (``MINICAFFE_ONE_WEIGHT_CAST=0``),
in bf16 and fp16, through the replayed graph, also after the host wrote the weights
between steps and for a pycaffe forward after a step (the copies are the step's own:
outside it the layers cast the weights they read then)."""
import logging
import re

import numpy as np
import pytest

from minicaffe.core import context
from minicaffe.core import precision as P
from minicaffe.core.config import RunConfig
from minicaffe.kernels import wcast
from minicaffe.proto import caffe_pb2
from test_precision_gpu import LENET
from test_wcast import STORAGES, _entries

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("storage", STORAGES)
def test_the_kernel_is_the_numpy_cast_bit_for_bit(storage):
    import cupy as cp
    want = _entries(storage)
    wcast.cast_numpy(want, storage)
    got = [(cp.asarray(s), cp.zeros(d.size, d.dtype), dims) for s, d, dims in _entries(storage)]
    wcast.WeightCast(got, storage)()
    for (_, d, dims), (_, g, _) in zip(want, got):
        g = cp.asnumpy(g)
        # fp16: numpy's NaN is another word than cvt.rn's (both NaN); bf16: the same words
        nan = np.isnan(d) if d.dtype == np.float16 else np.zeros(d.shape, bool)
        assert (np.isnan(g) == nan).all() if d.dtype == np.float16 else True, dims
        assert np.array_equal(d.view(np.uint16)[~nan], g.view(np.uint16)[~nan]), dims


SOLVER = """
net_param { %s }
base_lr: 0.01 momentum: 0.9 weight_decay: 0.0005 lr_policy: "fixed"
max_iter: 100 display: 0 random_seed: 1701
"""


def _run(precision):
    """Two steps, the host scales conv2's weights, two more steps, a pycaffe forward:
    (the weights, the last step's loss, the forward's loss)."""
    from minicaffe.core.protoio import parse_text
    from minicaffe.solvers import SGDSolver
    context.set_mode_gpu()
    sp = parse_text(SOLVER % LENET, caffe_pb2.SolverParameter())
    sp.solver_mode = caffe_pb2.SolverParameter.GPU
    s = SGDSolver(sp, config=RunConfig(precision=precision))
    try:
        s.step(2)
        s.net.params["conv2"][0].data[...] *= 0.5
        s.step(2)
        assert s.gpu_step.graphs, "the iteration was not captured as a CUDA graph"
        loss = float(s.net.blobs["loss"].data)
        fwd = float(s.net.forward()["loss"])
        return [p.data.copy() for p in s.net.learnable_params], loss, fwd
    finally:
        s.close()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_lenet_trains_as_with_a_cast_per_layer(precision, monkeypatch, caplog):
    from minicaffe.gpu import options
    was = options.deterministic
    options.set_deterministic(True)
    runs, said = [], []
    try:
        for env in ("0", None):
            if env is None:
                monkeypatch.delenv("MINICAFFE_ONE_WEIGHT_CAST", raising=False)
            else:
                monkeypatch.setenv("MINICAFFE_ONE_WEIGHT_CAST", env)
            caplog.clear()
            with caplog.at_level(logging.INFO):
                runs.append(_run(precision))
            said.append([r.getMessage() for r in caplog.records
                         if "cast in one launch" in r.getMessage()])
    finally:
        options.set_deterministic(was)
    assert not said[0]
    # conv1, conv2, ip1 (and ip2 where it runs in the 2-byte type)
    assert len(said[1]) == 1 and int(re.search(r"(\d+) layers'", said[1][0]).group(1)) >= 3
    (w0, loss0, fwd0), (w1, loss1, fwd1) = runs
    assert loss0 == loss1 and fwd0 == fwd1
    for k, (a, b) in enumerate(zip(w0, w1)):
        np.testing.assert_array_equal(a, b, err_msg=f"param {k}")
