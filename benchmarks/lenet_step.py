"""Time LeNet (batch 64) forward+backward, and check the BVLC LeNet weights' accuracy,
in CPU or GPU mode.  Usage: python benchmarks/lenet_step.py [--gpu] [--iters N]
[--fixtures DIR] [--mnist DIR]"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import minicaffe as caffe  # noqa: E402
from minicaffe.core import backend  # noqa: E402
from minicaffe.network.net import Net  # noqa: E402
from minicaffe.proto import caffe_pb2  # noqa: E402
from minicaffe.core.protoio import parse_text  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_net import LENET_MEM  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--fixtures", default=None)
    ap.add_argument("--mnist", default=None)
    a = ap.parse_args()
    if a.gpu:
        caffe.set_mode_gpu()
    caffe.set_random_seed(1)
    net = Net(parse_text(LENET_MEM, caffe_pb2.NetParameter()), caffe.TRAIN)
    rs = np.random.RandomState(0)
    net.layer_dict["mnist"].set_input_arrays(rs.rand(640, 1, 28, 28).astype(np.float32),
                                             rs.randint(0, 10, 640).astype(np.float32))
    for _ in range(5):
        net.forward_backward()
    backend.synchronize()
    t = time.perf_counter()
    for _ in range(a.iters):
        net.forward_backward()
    backend.synchronize()
    dt = (time.perf_counter() - t) / a.iters
    print(f"LeNet b64 forward+backward ({'GPU' if a.gpu else 'CPU'}): {dt * 1e3:.2f} ms/iter")
    if a.fixtures and a.mnist:
        from minicaffe.data.datasets import load_mnist
        m = load_mnist(a.mnist)
        X = m["test_images"].astype(np.float32) * np.float32(0.00390625)
        dep = Net(os.path.join(a.fixtures, "lenet_v2_deploy.prototxt"), caffe.TEST,
                  weights=os.path.join(a.fixtures, "lenet_v2_iter_10000.caffemodel"))
        dep.blobs["data"].reshape((1000, 1, 28, 28))
        dep.reshape()
        ok = 0
        for i in range(0, 10000, 1000):
            ok += int((dep.forward(data=X[i:i + 1000, None])["loss"].argmax(1)
                       == m["test_labels"][i:i + 1000]).sum())
        print(f"BVLC LeNet V2 accuracy ({'GPU' if a.gpu else 'CPU'}): {ok / 10000:.4f}")


if __name__ == "__main__":
    main()
