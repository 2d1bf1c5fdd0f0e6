"""Time minicaffe's GPU training step on a models/ net with synthetic inputs, three ways:
the GPU step replayed as CUDA graphs, the same step run eagerly, and the layer-by-layer
path of before (``--legacy``); prints ms per iteration (median of repeats).

    python benchmarks/gpu_step.py models/lenet/train_val.prototxt 64 [--iters 200]

(``minicaffe bench`` is the user-facing tool; this is the quick developer check.)
"""
import argparse
import statistics
import sys
import time


sys.path.insert(0, ".")
from minicaffe.core import backend, context  # noqa: E402
from minicaffe.network.net import read_net_param  # noqa: E402
from minicaffe.proto import caffe_pb2  # noqa: E402
from minicaffe.solvers import get_solver  # noqa: E402
from minicaffe.synthetic import fill_synthetic_inputs, synthetic_net_param  # noqa: E402

def synthetic(path, batch, shape):
    """The TRAIN net of ``path`` with Input layers for its data layers (minicaffe.synthetic)."""
    p = read_net_param(path)
    p.state.phase = caffe_pb2.TRAIN
    return synthetic_net_param(p, path, batch, input_shape=tuple(shape))[0]


def make(net, graphs):
    """An SGD solver (lr 0.001 fixed, momentum 0.9, weight decay 0.0005) on ``net``, inputs
    filled once (labels in the loss's class range)."""
    s = caffe_pb2.SolverParameter()
    s.net_param.CopyFrom(net)
    s.base_lr, s.momentum, s.weight_decay = 0.001, 0.9, 0.0005
    s.lr_policy = "fixed"
    s.display = 0
    s.random_seed = 1
    s.cuda_graph = graphs
    context.set_random_seed(1)
    solver = get_solver(s)
    fill_synthetic_inputs(solver.net)
    return solver


def timeit(solver, iters, repeats):
    solver.step(10)
    backend.synchronize()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        solver.step(iters)
        backend.synchronize()
        times.append((time.perf_counter() - t) / iters * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("batch", type=int)
    ap.add_argument("--shape", default="")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--legacy", action="store_true")
    ap.add_argument("--no-eager", action="store_true")
    ap.add_argument("--allocator", default="async")
    a = ap.parse_args()
    shape = {"lenet": [1, 28, 28], "cifar10": [3, 32, 32], "alexnet": [3, 227, 227],
             "caffenet": [3, 227, 227]}
    sh = [int(v) for v in a.shape.split(",")] if a.shape else \
        next((v for k, v in shape.items() if k in a.model), [3, 224, 224])
    from minicaffe.core import log
    log.init_log()
    context.set_mode_gpu()
    net = synthetic(a.model, a.batch, sh)
    from minicaffe.gpu import cudnn, pool
    print(cudnn.describe(), "|", pool.describe())
    pool.use(a.allocator)
    pool.reset_peak()
    rows = [("graph", make(net, True))]
    if not a.no_eager:    # (its peak then includes the graph solver's memory)
        rows.append(("eager", make(net, False)))
    if a.legacy:
        s = make(net, False)
        s._gpu_step_wanted = lambda: False
        rows.append(("legacy", s))
    for name, s in rows:
        ms = timeit(s, a.iters, a.repeats)
        st = s.gpu_step
        planned = f" planned {st.plan.peak / 2**30:.2f} GiB" if st is not None and st.plan else ""
        private = st.private_bytes() if st is not None else 0
        print(f"{a.model} b{a.batch} {name:7s} {ms:8.3f} ms/iter  {a.batch / ms * 1e3:10.0f} img/s"
              f"  peak {(pool.peak_bytes() + private) / 2**30:.2f} GiB{planned} ({pool.name()}; "
              f"graph pools {private / 2**20:.1f} MiB)", flush=True)
        if st is not None and st.graphs:
            g = next(iter(st.graphs.values()))
            cp = backend.cp
            st.stream.synchronize()
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(st.stream)
            for _ in range(a.iters):
                g.launch(st.stream)
            e1.record(st.stream)
            e1.synchronize()
            print(f"    replay only: {cp.cuda.get_elapsed_time(e0, e1) / a.iters:.3f} ms/iter "
                  f"(GPU time of the captured step)", flush=True)


if __name__ == "__main__":
    main()
