"""One run configuration (config.RunConfig) passed Solver -> Net -> layers, and the
MINICAFFE_* environment variables, read and validated in one place (config.py)."""
import dataclasses

import pytest

from minicaffe.core import config, context
from minicaffe.core.config import RunConfig
from minicaffe.core.errors import MinicaffeError
from minicaffe.network.net import Net
from minicaffe.proto import caffe_pb2
from minicaffe.core.protoio import parse_text
from minicaffe.solvers import get_solver

pytest.importorskip("lmdb")

BAD = {
    "MINICAFFE_TF32": "maybe",
    "MINICAFFE_DETERMINISTIC": "sometimes",
    "MINICAFFE_CUDNN": "perhaps",
    "MINICAFFE_CUDNN_WORKSPACE_LIMIT": "lots",
    "MINICAFFE_CHANNELS_LAST": "sideways",
    "MINICAFFE_CONV_GEMM": "sometimes",
    "MINICAFFE_CONV_DIRECT": "often",
    "MINICAFFE_SHARE_DATA": "mostly",
    "MINICAFFE_CONV_PAD8": "twice",
    "MINICAFFE_ONE_WEIGHT_CAST": "once",
    "MINICAFFE_FUSE_BN_RELU": "halfway",
    "MINICAFFE_CUDNN_LIBRARY": "/no/such/libcudnn.so.9",
    "MINICAFFE_GPU_ALLOCATOR": "magic",
    "MINICAFFE_DECODE_THREADS": "-3",
    "MINICAFFE_MNIST_DIR": "/no/such/folder",
    "MINICAFFE_TRACEBACK": "maybe",
    "MINICAFFE_LAUNCHED": "twice",
}


def test_every_variable_has_a_bad_value_here():
    assert sorted(BAD) == sorted(config.VARIABLES)


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_environment_value_is_one_line_naming_the_variable(cli, monkeypatch, name):
    monkeypatch.setenv(name, BAD[name])
    rc, out, err = cli("device_query")
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1, err
    accepted = config.VARIABLES[name][1]
    assert lines[0] == (f"minicaffe: error: environment variable {name}={BAD[name]!r} is not "
                        f"valid: accepted values are {accepted}")


def test_an_unknown_minicaffe_variable_is_refused(cli, monkeypatch):
    monkeypatch.setenv("MINICAFFE_TF23", "1")
    rc, out, err = cli("device_query")
    assert rc == 1 and err.count("\n") == 1
    assert "MINICAFFE_TF23 is not one of minicaffe's" in err and "MINICAFFE_TF32" in err


def test_good_values_are_parsed(monkeypatch):
    monkeypatch.setenv("MINICAFFE_CUDNN_WORKSPACE_LIMIT", "1e9")
    monkeypatch.setenv("MINICAFFE_TF32", "ON")
    monkeypatch.setenv("MINICAFFE_GPU_ALLOCATOR", " Default ")
    monkeypatch.setenv("MINICAFFE_DECODE_THREADS", "3")
    assert config.env("MINICAFFE_CUDNN_WORKSPACE_LIMIT") == 10 ** 9
    assert config.env("MINICAFFE_TF32") is True
    assert config.env("MINICAFFE_GPU_ALLOCATOR") == "default"
    assert RunConfig.from_environment().data_workers == 3
    monkeypatch.setenv("MINICAFFE_DECODE_THREADS", "0")      # 0: in the prefetch thread
    assert RunConfig.from_environment().data_workers == 0
    monkeypatch.delenv("MINICAFFE_DECODE_THREADS")           # unset: the layer's default
    assert RunConfig.from_environment().data_workers is None
    monkeypatch.setenv("MINICAFFE_TF32", "")                 # empty: unset
    assert config.env("MINICAFFE_TF32") is False
    config.check_environment()
    assert RunConfig.from_environment().workspace_limit == 10 ** 9


def test_the_run_config_is_frozen():
    c = RunConfig(tf32=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.tf32 = False
    assert c.replace(tf32=False).tf32 is False and c.tf32 is True


NET = """
name: "tiny"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 4 dim: 3 } shape { dim: 4 }
                     data_filler { type: "gaussian" } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 2 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def _solver(precision=None):
    p = caffe_pb2.SolverParameter()
    p.net_param.CopyFrom(parse_text(NET, caffe_pb2.NetParameter()))
    p.base_lr, p.max_iter, p.solver_mode = 0.1, 2, caffe_pb2.SolverParameter.CPU
    p.lr_policy = "fixed"
    if precision:
        p.minicaffe_precision = precision
    return get_solver(p)


def test_a_solvers_precision_holds_for_its_own_nets_only():
    from minicaffe.gpu import options
    before = options.tf32
    fast = _solver("TF32")
    strict = _solver("FLOAT")
    plain = _solver()
    assert options.tf32 is before                       # no process-wide switch
    assert all(l.config.tf32 for l in fast.net.layers)
    assert not any(l.config.tf32 for l in strict.net.layers)
    assert plain.config.tf32 is before
    fast.step(1)
    assert options.tf32 is before


def test_world_size_and_rank_come_with_the_config(tmp_path):
    """A Data layer of a net built for rank 1 of 3 reads rank 1's shard, whatever this
    thread's solver_count says; the manager takes a root solver built for its size."""
    from test_parallel import make_db, solver_param
    from minicaffe.multigpu import parallel
    db = make_db(tmp_path / "db", n=12, labels=list(range(12)))
    text = (f'layer {{ name: "d" type: "Data" top: "data" top: "label" include {{ phase: TRAIN }} '
            f'data_param {{ source: "{db}" batch_size: 2 backend: LMDB }} }}')
    assert context.solver_count() == 1
    net = Net(text, caffe_pb2.TRAIN, config=RunConfig(world_size=3, rank=1))
    seen = []
    for _ in range(2):
        net.forward()
        seen += net.blobs["label"].data.astype(int).tolist()
    net.close()
    assert seen == [1, 4, 7, 10]
    s = get_solver(solver_param(tmp_path), config=RunConfig(world_size=2))
    try:
        parallel.P2PManager(s, [None, None])             # no set_solver_count needed
        with pytest.raises(MinicaffeError, match="built for 2 rank"):
            parallel.P2PManager(s, [None, None, None])
    finally:
        s.close()


def test_the_cli_offload_flag_is_the_runs_not_the_process(cli, tmp_path):
    """--offload reaches the command's nets through its RunConfig; nothing is left behind
    for a net built later in the same process."""
    from minicaffe.engine import offload
    (tmp_path / "net.prototxt").write_text(NET)
    rc, out, err = cli("memory", "--model", "net.prototxt", "--offload", "all")
    assert rc == 0, err
    assert "ALL" in out
    later = Net(str(tmp_path / "net.prototxt"), caffe_pb2.TRAIN)
    assert offload.settings(later.net_param, later.config) == ("NONE", 0)
    assert later.config.offload_policy is None
