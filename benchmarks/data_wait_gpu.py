"""How long the GPU waits for data over a LeNet run from LMDB (prints figures, not a test).

    python benchmarks/data_wait_gpu.py [--mnist DIR] [--iters 2000] [--warmup 100] [--gpu 0]

Trains LeNet with Caffe's recipe (examples/mnist/lenet_train_test.prototxt, lenet_solver
hyperparameters, batch 64, no test passes) on an LMDB of the MNIST training set (from
--mnist or ../shared/data/mnist; a random stand-in of the same shape otherwise, which
costs the reader the same).  The Data layer records two events around its
``stream.wait_event(batch.ready)`` on the compute stream; their elapsed time is how long
the compute stream stalled waiting for an upload.  Printed: ms per iteration, that stall
as a percentage of the iteration time (target: under 2%), and the time the main thread
waited for the prefetch thread to fill a batch.
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from minicaffe.core import backend, context, log  # noqa: E402
from minicaffe.proto import caffe_pb2  # noqa: E402
from minicaffe.core.protoio import parse_text, read_text  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mnist", default=None)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--cpu", action="store_true", help="CPU mode (checks the script; host wait only)")
    a = ap.parse_args()
    if not a.cpu and backend.gpu_count() == 0:
        print(f"no GPU: {backend.why_no_gpu()}")
        return 1
    from data_throughput import mnist_db  # same LMDB as the CPU benchmark
    shared = os.path.join(ROOT, "..", "shared", "data", "mnist")
    mnist_dir = a.mnist or (shared if os.path.isdir(shared) else None)
    tmp = tempfile.mkdtemp(prefix="minicaffe-wait-")
    try:
        db, what = mnist_db(tmp, mnist_dir)
        with open(os.path.join(ROOT, "examples", "mnist", "lenet_train_test.prototxt")) as f:
            net_text = f.read().replace("examples/mnist/mnist_train_lmdb", db)
        net = parse_text(net_text, caffe_pb2.NetParameter())
        net.layer.remove(next(l for l in net.layer if l.type == "Data"
                              and l.include and l.include[0].phase == caffe_pb2.TEST))
        sp = read_text(os.path.join(ROOT, "examples", "mnist", "lenet_solver.prototxt"),
                       caffe_pb2.SolverParameter())
        sp.ClearField("net")
        sp.net_param.CopyFrom(net)
        del sp.test_iter[:]
        sp.ClearField("test_interval")
        sp.display = 0
        sp.snapshot = 0
        sp.max_iter = a.warmup + a.iters
        if not a.cpu:
            sp.solver_mode = caffe_pb2.SolverParameter.GPU
            context.set_device(a.gpu)
            context.set_mode_gpu()
        context.set_random_seed(1)
        from minicaffe.solvers import solver_class
        solver = solver_class(sp.type or "SGD")(sp)
        data = solver.net.layer_by_name("mnist")
        data.measure_wait = True
        solver.step(a.warmup)
        backend.synchronize()
        data.reset_data_wait()
        t = time.perf_counter()
        solver.step(a.iters)
        backend.synchronize()
        total_ms = (time.perf_counter() - t) * 1e3
        w = data.data_wait()
        it_ms = total_ms / a.iters
        dev = "CPU" if a.cpu else backend.cp.cuda.runtime.getDeviceProperties(a.gpu)["name"].decode()
        print(f"device: {dev}; data: {what}")
        print(f"LeNet b64 training from LMDB: {a.iters} iterations, {it_ms:.3f} ms/iter")
        print(f"compute stream waiting for uploads: {w['gpu_wait_ms']:.2f} ms in total = "
              f"{100 * w['gpu_wait_ms'] / total_ms:.3f}% of the iteration time")
        print(f"main thread waiting for the prefetch thread: {w['host_wait_s'] * 1e3:.2f} ms = "
              f"{100 * w['host_wait_s'] * 1e3 / total_ms:.3f}%")
        data.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    log.init_log(level=30)
    sys.exit(main())
