"""``minicaffe bench``: synthetic inputs in place of the data layers, the timing loop,
peak memory, the printed header and table, the JSON, the flags, and bad input as one
line with exit status 1.  No speed is asserted (speed lives in benchmarks)."""
import json
import os
import shutil
import sys

import numpy as np
import pytest

from minicaffe.core import backend
from minicaffe import bench, synthetic
from minicaffe.network.net import Net, TEST, TRAIN, read_net_param
from minicaffe.proto import caffe_pb2

from bench_nets import SMALL_NETS
from test_cli import _error_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models")
LENET = os.path.join(MODELS, "lenet", "train_val.prototxt")
QUICK = ["--iterations", "2", "--repeats", "2", "--warmup", "1"]


def _torch():
    return pytest.importorskip("torch")


def _json(path):
    with open(path) as f:
        return json.load(f)


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# -- the command --------------------------------------------------------------------------
def test_bench_prints_header_and_table_and_writes_json(cli, tmp_path):
    rc, out, err = cli("bench", "--model", LENET, "--batch", "4", "--json", "r.json", *QUICK)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("minicaffe bench: training step")
    assert any(l.startswith("CPU: ") and "numpy BLAS threads" in l and "load average" in l
               for l in lines)
    assert "GPU: none (CPU mode)" in lines
    assert any(l.startswith("versions: ") and "numpy" in l for l in lines)
    assert any(l.startswith("dtype: float32; TF32: minicaffe off") for l in lines)
    assert "'mnist' (Data) -> Input: data 4x1x28x28 (N(0, 1)); label 4 (integers in " \
           "[0, 10))" in out
    head = next(i for i, l in enumerate(lines) if l.startswith("net "))
    assert lines[head].split()[:4] == ["net", "batch", "minicaffe", "ms"]
    assert "torch" not in lines[head]
    row = lines[head + 1].split()
    assert row[:2] == ["LeNet", "4"] and float(row[2]) > 0
    r = _json(tmp_path / "r.json")
    assert r["command"] == f"minicaffe bench --model {LENET} --batch 4 --json r.json " + \
        " ".join(QUICK)
    assert r["dtype"] == "float32" and r["phase"] == "TRAIN"
    assert r["machine"]["device"] == "cpu" and r["machine"]["blas_threads"] >= 1
    assert r["machine"]["cpu"] and len(r["machine"]["load_average"]) == 3
    assert r["versions"]["numpy"] == np.__version__
    assert r["tf32"] == {"minicaffe": False, "torch": None}
    assert r["timing"] == {"warmup": 1, "repeats": 2, "iterations": 2,
                           "statistic": "median of repeats", "synchronised": False}
    net = r["nets"][0]
    assert net["net"] == "LeNet" and net["batch"] == 4
    assert net["replaced"] == [{"layer": "mnist", "type": "Data",
                                "tops": [["data", [4, 1, 28, 28]], ["label", [4]]]}]
    (mc,) = net["results"]
    assert mc["engine"] == "minicaffe" and len(mc["ms_repeats"]) == 2
    assert mc["ms_per_iter"] == pytest.approx(float(np.median(mc["ms_repeats"])))
    assert mc["images_per_s"] == pytest.approx(4e3 / mc["ms_per_iter"])
    assert mc["peak_bytes"] >= 0 and mc["peak_what"] == "peak RSS growth"
    assert "SGD lr 0.001" in net["solver"] and "bench default" in net["solver"]


def test_compare_torch_on_the_cpu(cli, tmp_path):
    torch = _torch()
    rc, out, err = cli("bench", "--model", LENET, "--batch", "4", "--compare", "torch",
                       "--json", "r.json", *QUICK)
    assert rc == 0, err
    r = _json(tmp_path / "r.json")
    assert r["machine"]["torch_threads"] == r["machine"]["blas_threads"]
    assert r["versions"]["torch"] == torch.__version__
    assert r["tf32"] == {"minicaffe": False, "torch": False}
    net = r["nets"][0]
    assert [e["engine"] for e in net["results"]] == ["minicaffe", "torch eager"]
    mc, eager = net["results"]
    assert net["ratios"] == {"minicaffe/torch_eager":
                             pytest.approx(mc["ms_per_iter"] / eager["ms_per_iter"])}
    header = next(l for l in out.splitlines() if l.startswith("net "))
    assert "torch eager ms" in header and "mc/eager" in header and "graph" not in header
    assert "torch threads" in out and "TF32: minicaffe off, torch off" in out


def test_tf32_switch_turns_it_on_for_torch(cli, tmp_path):
    torch = _torch()
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        rc, out, err = cli("bench", "--model", LENET, "--batch", "2", "--compare", "torch",
                           "--tf32", "--json", "r.json", *QUICK)
        assert rc == 0, err
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert _json(tmp_path / "r.json")["tf32"]["torch"] is True
        assert "torch on" in out
        rc, out, err = cli("bench", "--model", LENET, "--batch", "2", "--compare", "torch",
                           *QUICK)
        assert not torch.backends.cuda.matmul.allow_tf32
        assert not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_compare_without_torch_is_one_line(cli, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now fails
    rc, out, err = cli("bench", "--model", LENET, "--compare", "torch", *QUICK)
    assert rc == 1 and out == ""
    assert "--compare torch needs PyTorch" in _error_line(err)


def test_untranslatable_layer_is_one_line(cli, tmp_path):
    _torch()
    text = SMALL_NETS["alexnet_small"].replace(
        'layer { name: "fc7"', 'layer { name: "odd" type: "AbsVal" bottom: "fc6" top: "a" }\n'
        'layer { name: "fc7"')
    model = _write(tmp_path, "odd.prototxt", text)
    rc, out, err = cli("bench", "--model", model, "--compare", "torch", *QUICK)
    assert rc == 1
    assert "layer 'odd' of type AbsVal: no PyTorch translation" in _error_line(err)


@pytest.mark.parametrize("args,match", [
    ([], "need a model"),
    (["--model", LENET, "--solver", "s.prototxt"], "not both"),
    (["--model", "missing.prototxt"], "missing.prototxt: no such file"),
    (["--model", LENET, "--compare", "caffe"], "only 'torch'"),
    (["--model", LENET, "--iterations", "0"], "--iterations must be at least 1"),
    (["--model", LENET, "--repeats", "0"], "--repeats must be at least 1"),
    (["--model", LENET, "--warmup", "-1"], "--warmup must not be negative"),
    (["--model", LENET, "--phase", "VAL"], "phase must be"),
    (["--model", LENET, "--input_shape", "3,x"], "--input_shape '3,x'"),
    (["--model", LENET, "--json", "no/such/dir/r.json"], "cannot write the JSON"),
    (["--model", LENET, "--num_classes", "11"], "--num_classes 11: label 'label' is "
                                                "compared with 10 classes"),
    (["--model", LENET, "--batch", "x"], "illegal value 'x'"),
    (["--model", LENET, "--gpu", "0"], "asked for a GPU" if backend.gpu_count() == 0
     else "GPU 0"),
])
def test_bad_input_is_one_line(cli, args, match):
    if "--gpu" in args and backend.gpu_count() > 0:
        pytest.skip("a GPU is present")
    rc, out, err = cli("bench", *QUICK, *args)  # the last spelling of a flag wins
    assert rc == 1
    assert match in _error_line(err)


def test_solver_with_test_phase_is_one_line(cli, tmp_path):
    solver = _write(tmp_path, "s.prototxt", f'net: "{LENET}" base_lr: 0.01 lr_policy: "fixed"')
    rc, out, err = cli("bench", "--solver", solver, "--phase", "TEST", *QUICK)
    assert rc == 1 and "give --model" in _error_line(err)


def test_input_shape_when_the_data_cannot_be_read(cli, tmp_path):
    model = str(tmp_path / "lenet.prototxt")
    shutil.copy(LENET, model)  # no deploy.prototxt beside it, no LMDB
    rc, out, err = cli("bench", "--model", model, *QUICK)
    assert rc == 1
    line = _error_line(err)
    assert "layer 'mnist' (Data)" in line and "--input_shape C,H,W" in line
    rc, out, err = cli("bench", "--model", model, "--input_shape", "1,32,32", "--batch", "2",
                       "--json", "r.json", *QUICK)
    assert rc == 0, err
    tops = _json(tmp_path / "r.json")["nets"][0]["replaced"][0]["tops"]
    assert tops == [["data", [2, 1, 32, 32]], ["label", [2]]]


def test_batch_and_num_classes(cli, tmp_path):
    rc, out, err = cli("bench", "--model", LENET, "--batch", "3", "--num_classes", "4",
                       "--json", "r.json", *QUICK)
    assert rc == 0, err
    net = _json(tmp_path / "r.json")["nets"][0]
    assert net["batch"] == 3 and net["results"][0]["images_per_iter"] == 3
    assert net["inputs"] == {"data": "N(0, 1)", "label": "integers in [0, 4)"}


def test_phase_test_times_the_forward(cli, tmp_path):
    _torch()
    rc, out, err = cli("bench", "--model", LENET, "--phase", "TEST", "--batch", "2",
                       "--compare", "torch", "--json", "r.json", *QUICK)
    assert rc == 0, err
    assert out.startswith("minicaffe bench: TEST forward")
    r = _json(tmp_path / "r.json")
    assert r["phase"] == "TEST" and "solver" not in r["nets"][0]
    # the TEST net's data layer (batch_size 100 in the file) is the one replaced
    assert r["nets"][0]["replaced"][0]["tops"][0] == ["data", [2, 1, 28, 28]]
    assert [e["engine"] for e in r["nets"][0]["results"]] == ["minicaffe", "torch eager"]


def test_solver_flag_uses_its_type_and_iter_size(cli, tmp_path):
    _torch()
    solver = _write(tmp_path, "s.prototxt",
                    f'net: "{LENET}" type: "Adam" base_lr: 0.001 momentum: 0.9 '
                    'momentum2: 0.999 lr_policy: "fixed" iter_size: 2 test_iter: 5 '
                    'test_interval: 2 display: 1 snapshot: 1 snapshot_prefix: "nowhere/x"')
    rc, out, err = cli("bench", "--solver", solver, "--batch", "2", "--compare", "torch",
                       "--json", "r.json", *QUICK)
    assert rc == 0, err
    net = _json(tmp_path / "r.json")["nets"][0]
    assert net["solver"].startswith("Adam lr 0.001") and solver in net["solver"]
    assert net["iter_size"] == 2
    assert all(e["images_per_iter"] == 4 for e in net["results"])
    assert not os.path.exists(tmp_path / "nowhere")  # no snapshots, no tests


def test_several_models_one_table(cli, tmp_path):
    quick = os.path.join(MODELS, "cifar10_quick", "train_val.prototxt")
    rc, out, err = cli("bench", "--model", f"{LENET},{quick}", "--batch", "2",
                       "--json", "r.json", *QUICK)
    assert rc == 0, err
    assert [n["net"] for n in _json(tmp_path / "r.json")["nets"]] == ["LeNet",
                                                                     "CIFAR10_quick"]
    lines = out.splitlines()
    head = next(i for i, l in enumerate(lines) if l.startswith("net "))
    assert [l.split()[0] for l in lines[head + 1:]] == ["LeNet", "CIFAR10_quick"]


# -- the pieces --------------------------------------------------------------------------------
def test_time_iterations_warms_up_then_times_repeats():
    calls, syncs = [], []
    ms = bench.time_iterations(calls.append, iterations=3, repeats=4, warmup=2,
                               sync=lambda: syncs.append(len(calls)))
    assert calls == [2, 3, 3, 3, 3] and len(ms) == 4 and min(ms) >= 0
    assert syncs.count(5) >= 1 and len(syncs) == 1 + 2 * 4  # around every repeat
    calls.clear()
    bench.time_iterations(calls.append, iterations=1, repeats=1, warmup=0)
    assert calls == [1]


def test_gpu_zero_is_a_gpu(monkeypatch):
    """bench_minicaffe on device 0 synchronises with the GPU and reports the GPU
    allocator's peak (device ids are not truth values)."""
    syncs = []
    monkeypatch.setattr(backend, "synchronize", lambda: syncs.append(1))
    monkeypatch.setattr(backend, "peak_gpu_bytes", lambda: 12345)
    net = Net(SMALL_NETS["misc"], TRAIN)
    res = bench.bench_minicaffe(lambda k: None, net, iterations=1, repeats=2, warmup=0, gpu=0)
    assert res.peak_bytes == 12345 and res.peak_what.startswith("minicaffe GPU allocator")
    assert len(syncs) == 1 + 2 * 2 and res.images == 4


def test_peak_rss_sees_an_allocation():
    bench.release_free_memory()
    assert bench.reset_peak_rss()
    base = bench.rss_bytes()
    a = np.ones(40 * 2 ** 20 // 8)  # 40 MiB, touched
    del a
    assert bench.peak_rss_bytes() - base >= 35 * 2 ** 20
    assert bench.rss_bytes() - base < 35 * 2 ** 20  # gone again, the peak stays


def test_peak_gpu_bytes_without_a_gpu_is_zero():
    if backend.gpu_count():
        pytest.skip("a GPU is present (see test_bench_gpu.py)")
    backend.reset_peak_gpu_bytes()
    assert backend.peak_gpu_bytes() == 0


def test_blas_threads_is_what_numpy_uses(monkeypatch):
    n = bench.blas_threads()
    assert 1 <= n <= (os.cpu_count() or 1) * 2
    # the test suite runs numpy's OpenBLAS with OPENBLAS_NUM_THREADS=1 (conftest.py)
    if os.environ.get("OPENBLAS_NUM_THREADS") == "1":
        assert n == 1


def test_data_layers_become_inputs_of_the_same_shapes(tmp_path):
    pytest.importorskip("lmdb")
    from test_data_layers import make_db
    db = make_db(tmp_path / "db", [np.zeros((3, 10, 12), np.uint8)] * 2, labels=[0, 1])
    text = f"""name: "n"
layer {{ name: "d" type: "Data" top: "data" top: "label" include {{ phase: TRAIN }}
  transform_param {{ crop_size: 8 }} data_param {{ source: "{db}" batch_size: 5 backend: LMDB }} }}
layer {{ name: "d" type: "Data" top: "data" top: "label" include {{ phase: TEST }}
  data_param {{ source: "{db}" batch_size: 7 backend: LMDB }} }}
layer {{ name: "dummy" type: "DummyData" top: "extra"
  dummy_data_param {{ shape {{ dim: 5 dim: 2 }} }} }}
layer {{ name: "mem" type: "MemoryData" top: "m" top: "ml"
  memory_data_param {{ batch_size: 5 channels: 1 height: 2 width: 3 }} }}
layer {{ name: "h5" type: "HDF5Data" top: "h"
  hdf5_data_param {{ source: "nope.txt" batch_size: 5 }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param {{ num_output: 3 }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
"""
    param = read_net_param(text)
    param.state.phase = TRAIN
    with pytest.raises(Exception, match="layer 'h5' \\(HDF5Data\\)"):
        synthetic.synthetic_net_param(param)
    param.layer.remove(next(l for l in param.layer if l.name == "h5"))
    out, replaced = synthetic.synthetic_net_param(param)
    assert all(l.type != "Data" for l in out.layer)
    assert [(n, t, s) for n, t, s in replaced] == [
        ("d", "Data", [("data", (5, 3, 8, 8)), ("label", (5,))]),
        ("dummy", "DummyData", [("extra", (5, 2))]),
        ("mem", "MemoryData", [("m", (5, 1, 2, 3)), ("ml", (5,))])]
    out2, replaced2 = synthetic.synthetic_net_param(param, input_shape=(1, 4, 4))
    assert [r[2] for r in replaced2] == [[("data", (5, 1, 4, 4)), ("label", (5,))]] + \
        [r[2] for r in replaced[1:]]  # only file-backed layers take --input_shape
    net = Net(out)
    described = synthetic.fill_synthetic_inputs(net)
    assert described["label"] == "integers in [0, 3)" and described["ml"] == "N(0, 1)"
    labels = net.blobs["label"].data
    assert set(np.unique(labels)) <= {0, 1, 2} and len(np.unique(labels)) > 1
    param.state.phase = TEST
    out, replaced = synthetic.synthetic_net_param(param, batch=2)
    assert replaced[0][2] == [("data", (2, 3, 10, 12)), ("label", (2,))]


def test_labels_follow_the_loss_that_reads_them(tmp_path):
    net = Net(SMALL_NETS["misc"], TRAIN)
    assert synthetic.label_classes(net, "label") == 10  # through the Split, two losses
    assert synthetic.label_classes(net, "target") is None  # EuclideanLoss reads values
    described = synthetic.fill_synthetic_inputs(net, num_classes=5)
    assert described == {"data": "N(0, 1)", "label": "integers in [0, 5)",
                         "target": "N(0, 1)"}
    assert net.blobs["label"].data.max() <= 4


@pytest.mark.parametrize("model,shape", [
    ("lenet", (1, 28, 28)), ("cifar10_quick", (3, 32, 32)), ("cifar10_full", (3, 32, 32)),
    ("bvlc_alexnet", (3, 227, 227)), ("bvlc_reference_caffenet", (3, 227, 227)),
    ("vgg16", (3, 224, 224)), ("resnet50", (3, 224, 224)), ("bvlc_googlenet", (3, 224, 224)),
])
@pytest.mark.parametrize("phase", [TRAIN, TEST])
def test_every_model_gets_its_input_shape(model, shape, phase):
    """Construct-only: the synthetic net of each model (its shapes from the deploy net);
    the big ones run in test_big_models_run_one_iteration (slow)."""
    path = os.path.join(MODELS, model, "train_val.prototxt")
    param = read_net_param(path)
    param.state.phase = phase
    out, replaced = synthetic.synthetic_net_param(param, path, batch=1)
    ((name, kind, tops),) = replaced
    assert kind == "Data" and tops == [("data", (1,) + shape), ("label", (1,))]
    assert sum(l.type == "Input" for l in out.layer) == 1


@pytest.mark.slow
@pytest.mark.parametrize("model,extra", [
    ("bvlc_alexnet", []), ("bvlc_googlenet", []), ("resnet50", []),
    ("vgg16", ["--input_shape", "3,64,64"]),   # fc6 then takes 2x2x512: 4 GB less
])
def test_big_models_run_one_iteration(cli, tmp_path, model, extra):
    args = ["--compare", "torch"] if _has_torch() else []
    rc, out, err = cli("bench", "--model", os.path.join(MODELS, model, "train_val.prototxt"),
                       "--batch", "1", "--iterations", "1", "--repeats", "1", "--warmup", "0",
                       "--json", "r.json", *extra, *args)
    assert rc == 0, err
    results = _json(tmp_path / "r.json")["nets"][0]["results"]
    assert all(r["ms_per_iter"] > 0 for r in results) and len(results) == 1 + bool(args)


def _has_torch():
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        return False


def test_a_gpu_row_says_whether_its_step_was_replayed_as_a_cuda_graph():
    """A GPU net's lines say whether its step was replayed as a CUDA graph or ran eagerly
    (a capture that failed falls back to the eager step: a slow figure should say why)."""
    import io
    row = {"net": "N", "replaced": [], "inputs": {}, "notes": []}
    for graph, words in ((True, "N: GPU step replayed as a CUDA graph"),
                         (False, "N: GPU step run eagerly (no CUDA graph)")):
        out = io.StringIO()
        bench._print_net_lines(dict(row, gpu_step={"cuda_graph": graph}), out)
        assert words in out.getvalue().splitlines()
    out = io.StringIO()
    bench._print_net_lines(row, out)            # the CPU: no GPU step, no such line
    assert "GPU step" not in out.getvalue()
