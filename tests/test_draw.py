"""minicaffe.compat.draw and tools/draw_net.py (pycaffe's draw.py / draw_net.py)."""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import minicaffe as caffe
from minicaffe import draw
from minicaffe.core.errors import MinicaffeError
from minicaffe.network.net import read_net_param

ROOT = pathlib.Path(__file__).resolve().parents[1]

NET = """
name: "TinyNet"
layer { name: "data" type: "Data" top: "data" top: "label"
        include { phase: TRAIN } data_param { source: "x" batch_size: 64 } }
layer { name: "data" type: "Input" top: "data" top: "label"
        include { phase: TEST } input_param { shape { dim: 1 dim: 1 dim: 8 dim: 8 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        param { lr_mult: 1 } param { lr_mult: 2 }
        convolution_param { num_output: 20 kernel_size: 5 stride: 2 pad: 1 } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "relu1" type: "ReLU" bottom: "pool1" top: "pool1" }
layer { name: "ip1" type: "InnerProduct" bottom: "pool1" top: "ip1"
        param { lr_mult: 0 } param { lr_mult: 0 }
        inner_product_param { num_output: 10 } }
layer { name: "acc" type: "Accuracy" bottom: "ip1" bottom: "label" top: "acc"
        include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss"
        exclude { phase: TEST } }
"""


@pytest.fixture
def net_param():
    return read_net_param(NET)


def test_layer_labels_follow_pycaffe(net_param):
    conv, pool = net_param.layer[2], net_param.layer[3]
    assert draw.get_layer_label(conv, "LR") == \
        "conv1\n(Convolution)\nkernel size: 5\nstride: 2\npad: 1"
    assert draw.get_layer_label(conv, "TB") == \
        "conv1 (Convolution) kernel size: 5 stride: 2 pad: 1"
    assert draw.get_layer_label(pool, "TB") == "pool1 (Pooling AVE) kernel size: 2 stride: 2 pad: 0"
    assert draw.get_layer_label(conv, "TB", display_lrm=True).endswith("lr mult: 1.0, 2.0")
    # all-zero multipliers are not shown
    assert "lr mult" not in draw.get_layer_label(net_param.layer[5], "TB", display_lrm=True)
    assert draw.get_layer_lr_mult(net_param.layer[5]) == (0.0, 0.0)
    with pytest.raises(ValueError):
        draw.get_layer_lr_mult(pool)
    assert draw.get_edge_label(net_param.layer[0]) == "Batch 64"
    assert draw.get_edge_label(conv) == "20"
    assert draw.get_edge_label(pool) == ""


def test_dot_text_nodes_edges_and_styles(net_param):
    dot = draw.get_dot(net_param, rankdir="BT")
    assert dot.startswith('digraph "TinyNet" {\n  rankdir="BT";\n')
    assert dot.rstrip().endswith("}")
    # layer nodes coloured by type; in-place layers green; blobs octagons
    assert '"conv1_Convolution" [label="conv1 (Convolution) kernel size: 5 stride: 2 pad: 1", ' \
           'shape="record", fillcolor="#FF5050", style="filled"];' in dot
    assert '"pool1_Pooling" [' in dot and 'fillcolor="#FF9900"' in dot
    assert '"relu1_ReLU" [label="relu1 (ReLU)", shape="record", fillcolor="#90EE90"' in dot
    assert '"ip1_InnerProduct" [' in dot and 'fillcolor="#CC33FF"' in dot
    assert '"conv1_blob" [label="conv1", shape="octagon", fillcolor="#E0E0E0", style="filled"];' in dot
    assert '"data_blob" -> "conv1_Convolution" [label=""];' in dot
    assert '"conv1_Convolution" -> "conv1_blob" [label="20"];' in dot
    assert '"data_Data" -> "data_blob" [label="Batch 64"];' in dot
    # an in-place layer reads and writes the same blob node
    assert '"pool1_blob" -> "relu1_ReLU"' in dot and '"relu1_ReLU" -> "pool1_blob"' in dot
    # LR layout separates label lines with dot's \n escape
    assert r'label="conv1\n(Convolution)\nkernel size: 5\nstride: 2\npad: 1"' in \
        draw.get_dot(net_param)


def test_phase_filter(net_param):
    all_ = draw.get_dot(net_param)
    train = draw.get_dot(net_param, phase=caffe.TRAIN)
    test = draw.get_dot(net_param, phase=caffe.TEST)
    assert '"acc_Accuracy"' in all_ and '"loss_SoftmaxWithLoss"' in all_
    assert '"acc_Accuracy"' not in train and '"loss_SoftmaxWithLoss"' in train
    assert '"data_Data"' in train and '"data_Input"' not in train
    assert '"acc_Accuracy"' in test and '"loss_SoftmaxWithLoss"' not in test
    assert '"data_Input"' in test and '"data_Data"' not in test


def test_unnamed_net_and_quoting():
    p = read_net_param('layer { name: "a\\"b" type: "Input" top: "x" '
                       'input_param { shape { dim: 1 } } }')
    dot = draw.get_dot(p)
    assert dot.startswith('digraph "Net" {')
    assert r'"a\"b_Input"' in dot


def test_draw_net_to_file_dot_text(tmp_path, net_param):
    out = tmp_path / "net.dot"
    draw.draw_net_to_file(net_param, str(out), "TB", caffe.TEST)
    assert out.read_text() == draw.get_dot(net_param, "TB", phase=caffe.TEST)
    raw = tmp_path / "net.raw"
    draw.draw_net_to_file(net_param, str(raw))
    assert raw.read_text() == draw.get_dot(net_param, "LR")
    assert draw.draw_net(net_param, "LR", ext="gv") == draw.get_dot(net_param).encode()


@pytest.mark.skipif(shutil.which("dot") is not None, reason="Graphviz is installed")
def test_image_without_graphviz_is_a_clear_error(tmp_path, net_param, monkeypatch):
    monkeypatch.setitem(sys.modules, "pydot", None)
    with pytest.raises(MinicaffeError, match="needs Graphviz's `dot`"):
        draw.draw_net_to_file(net_param, str(tmp_path / "net.png"))
    assert not (tmp_path / "net.png").exists()
    assert os.listdir(tmp_path) == []  # no half-written file


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_png_and_svg_with_graphviz(tmp_path, net_param):
    png = draw.draw_net(net_param, "LR", ext="png")
    assert png.startswith(b"\x89PNG")
    draw.draw_net_to_file(net_param, str(tmp_path / "n.svg"))
    assert b"<svg" in (tmp_path / "n.svg").read_bytes()


def _run_tool(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "draw_net.py"), *args],
                          capture_output=True, text=True, cwd=str(ROOT))


def test_draw_net_tool(tmp_path):
    proto = tmp_path / "net.prototxt"
    proto.write_text(NET)
    out = tmp_path / "out.dot"
    r = _run_tool(str(proto), str(out), "--rankdir", "TB", "--phase", "TRAIN", "--display_lrm")
    assert r.returncode == 0, r.stderr
    assert f"Drawing net to {out}" in r.stdout
    text = out.read_text()
    assert '"loss_SoftmaxWithLoss"' in text and '"acc_Accuracy"' not in text
    assert "lr mult: 1.0, 2.0" in text and 'rankdir="TB"' in text
    # errors: one line, exit 1, no traceback
    r = _run_tool(str(tmp_path / "missing.prototxt"), str(out))
    assert r.returncode == 1 and "no such file" in r.stderr and "Traceback" not in r.stderr
    r = _run_tool(str(proto), str(out), "--phase", "VAL")
    assert r.returncode == 1 and "Unknown phase: VAL" in r.stderr
    bad = tmp_path / "bad.prototxt"
    bad.write_text("layer { name: 'x' type: }\n")
    r = _run_tool(str(bad), str(out))
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    if shutil.which("dot") is None:
        r = _run_tool(str(proto), str(tmp_path / "o.png"))
        assert r.returncode == 1 and "Graphviz" in r.stderr and "Traceback" not in r.stderr


def test_python_dash_m_entry_point(tmp_path):
    proto = tmp_path / "net.prototxt"
    proto.write_text(NET)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "minicaffe.compat.draw", str(proto),
                        str(tmp_path / "o.gv")], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert (tmp_path / "o.gv").read_text().startswith('digraph "TinyNet"')


def test_draw_v1_prototxt_is_upgraded(fixtures_dir):
    dot = draw.get_dot(str(fixtures_dir / "lenet_v1_train_test.prototxt"), phase=caffe.TEST)
    assert '"conv1_Convolution"' in dot and '"accuracy_Accuracy"' in dot
