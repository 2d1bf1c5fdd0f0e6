"""--share_data on the GPU (engine/step.py): the training step whose memory plan lets blob
data that no backward reads share memory trains bit for bit as the step that keeps every
blob's data (deterministic cuDNN algorithms, the same seeds), in fp32 and bf16, through
the replayed CUDA graph, with a smaller arena.  The CPU check of the layers' declarations
behind it: tests/test_share_data.py."""
import numpy as np
import pytest

from minicaffe.core import context
from minicaffe.core.config import RunConfig
from minicaffe.proto import caffe_pb2
from test_share_data import INCEPTION, MISC, RESNET

pytestmark = pytest.mark.gpu

DUMMY = """layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 4 dim: 3 dim: 12 dim: 12 } shape { dim: 4 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "uniform" min: 0 max: 4.99 } } }
"""
SOLVER = """
net_param { %s }
base_lr: 0.01 momentum: 0.9 weight_decay: 0.0005 lr_policy: "fixed"
max_iter: 100 display: 0 random_seed: 1701
"""


def _dummy(text):
    head, rest = text.split('layer { name: "data" type: "Input"', 1)
    return head + DUMMY + rest.split("\n", 2)[2]


def _solver(text, precision, share):
    from minicaffe.core.protoio import parse_text
    from minicaffe.solvers import SGDSolver
    context.set_mode_gpu()
    sp = parse_text(SOLVER % _dummy(text), caffe_pb2.SolverParameter())
    sp.solver_mode = caffe_pb2.SolverParameter.GPU
    return SGDSolver(sp, config=RunConfig(precision=precision, share_data=share))


@pytest.mark.parametrize("precision", [None, "bf16"])
@pytest.mark.parametrize("text", [RESNET, INCEPTION, MISC], ids=["resnet", "inception", "misc"])
def test_the_shared_plan_trains_as_the_full_one(text, precision):
    from minicaffe.gpu import options
    was = options.deterministic
    options.set_deterministic(True)
    try:
        runs = []
        for share in (False, True):
            s = _solver(text, precision, share)
            s.step(4)
            runs.append(([b.data.copy() for b in s.net.learnable_params],
                         s.gpu_step.plan.arena_bytes, float(s.net.blobs["loss"].data)))
            s.close()
    finally:
        options.set_deterministic(was)
    (w0, arena0, loss0), (w1, arena1, loss1) = runs
    assert arena1 < arena0
    assert loss0 == loss1
    for k, (a, b) in enumerate(zip(w0, w1)):
        np.testing.assert_array_equal(a, b, err_msg=f"param {k}")


def test_a_shared_blob_read_after_a_step_warns_once(caplog):
    """With share_data a blob whose data the plan lets other buffers use is not the
    layer's output after a step: reading it says so, once, naming the blob; the loss (kept)
    and a run without sharing read silently."""
    import logging
    for share in (True, False):
        s = _solver(RESNET, None, share)
        s.step(2)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            float(s.net.blobs["loss"].data)
            loss_said = [r for r in caplog.records if "share_data" in r.getMessage()]
            for _ in range(2):
                for name in s.net.blobs:
                    s.net.blobs[name].data.sum()
        said = [r.getMessage() for r in caplog.records if "share_data" in r.getMessage()]
        assert not loss_said
        if share:
            named = [m.split("'")[1] for m in said]
            assert named and len(named) == len(set(named)), said     # once per blob
            assert set(named) <= set(s.net.blobs) - {"data", "label", "loss"}
        else:
            assert not said
        s.close()
