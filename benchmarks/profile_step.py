"""Profile the Python side of LeNet training steps (cProfile), CPU or GPU.

    python benchmarks/profile_step.py [--gpu] [--iters 300] [--top 30]

Uses tests/test_net.py's LeNet on MemoryData with an SGD solver (momentum 0.9), so no
dataset is needed; prints the functions with the most own time."""
import argparse
import cProfile
import os
import pstats
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    import minicaffe as caffe
    from minicaffe.core import backend
    from minicaffe.proto import caffe_pb2
    from minicaffe.core.protoio import parse_text
    from minicaffe.solvers import SGDSolver
    from test_net import LENET_MEM
    if a.gpu:
        caffe.set_mode_gpu()
    sp = caffe_pb2.SolverParameter(base_lr=0.01, momentum=0.9, lr_policy="fixed",
                                   max_iter=10 ** 6, display=0, random_seed=1)
    sp.net_param.CopyFrom(parse_text(LENET_MEM, caffe_pb2.NetParameter()))
    solver = SGDSolver(sp)
    rs = np.random.RandomState(0)
    solver.net.layer_dict["mnist"].set_input_arrays(
        rs.rand(640, 1, 28, 28).astype(np.float32), rs.randint(0, 10, 640).astype(np.float32))
    solver.step(20)
    backend.synchronize()
    t = time.perf_counter()
    prof = cProfile.Profile()
    prof.enable()
    solver.step(a.iters)
    backend.synchronize()
    prof.disable()
    dt = (time.perf_counter() - t) / a.iters
    print(f"{'GPU' if a.gpu else 'CPU'} LeNet b64 training step under cProfile: {dt * 1e3:.2f} ms")
    pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()
