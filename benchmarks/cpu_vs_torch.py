"""A full CPU training step (forward, backward, SGD-momentum update), minicaffe against
PyTorch, side by side in one process (prints figures, not a test).

    python benchmarks/cpu_vs_torch.py [--threads 2 | --replicas 2] [--rounds 15] [--steps 10]

LeNet (batch 64) and CIFAR-10 quick (batch 100) from models/, with Input layers in place
of the data layers (random inputs, set once), and the same nets written in PyTorch.  Each
round times ``--steps`` steps of minicaffe, then of PyTorch, so both see the same outside
load; printed: the median and the minimum over the rounds of ms per step, and the ratio
of the medians.  ``--threads`` sets the threads of both: PyTorch's
``torch.set_num_threads``, minicaffe's ``set_num_threads`` (as its ``--threads`` flag: with
more than one, the convolutions' batch chunks on a pool of that many threads and numpy's
BLAS on one; ``--no-pool`` gives the BLAS the threads instead, as minicaffe did before).
``--replicas N`` runs minicaffe's batch across N worker processes of one thread each
(``--replicas`` of the CLI, ``RunConfig(cpu_replicas=N)``: no GIL between them) and
PyTorch on N threads.  On a shared machine two threads swing with the outside load;
``--threads 1`` (or ``taskset -c 0``) gives steadier figures.
"""
import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NETS = {"LeNet": ("models/lenet/train_val.prototxt", 64, (1, 28, 28)),
        "CIFAR-10 quick": ("models/cifar10_quick/train_val.prototxt", 100, (3, 32, 32))}
DATA = ("Data", "ImageData", "HDF5Data", "MemoryData", "DummyData", "WindowData")


def minicaffe_step(path, batch, shape, replicas=1):
    """A function running one solver step of ``path``'s TRAIN net on random inputs (and
    the solver, to close)."""
    import numpy as np
    from minicaffe.core import context
    from minicaffe.core.config import RunConfig
    from minicaffe.network.net import read_net_param
    from minicaffe.proto import caffe_pb2
    from minicaffe.solvers import get_solver
    p = read_net_param(os.path.join(ROOT, path))
    s = caffe_pb2.SolverParameter(base_lr=0.001, momentum=0.9, weight_decay=0.0005,
                                  lr_policy="fixed", display=0, random_seed=1,
                                  snapshot_after_train=False,
                                  solver_mode=caffe_pb2.SolverParameter.CPU)
    for l in p.layer:
        if any(r.phase == caffe_pb2.TEST for r in l.include) or l.type == "Accuracy":
            continue
        n = s.net_param.layer.add()
        if l.type in DATA:
            n.name, n.type = l.name, "Input"
            n.top.extend(l.top)
            n.input_param.shape.add().dim.extend((batch,) + shape)
            n.input_param.shape.add().dim.extend([batch])
        else:
            n.CopyFrom(l)
    context.set_mode_cpu()
    solver = get_solver(s, config=RunConfig.from_environment(cpu_replicas=replicas))
    rs = np.random.RandomState(0)
    solver.net.blobs["data"].data[...] = rs.randn(batch, *shape)
    solver.net.blobs["label"].data[...] = rs.randint(0, 10, batch)
    return (lambda: solver.step(1)), solver


def torch_net(name):
    """The net ``name`` written in PyTorch (as minicaffe's prototxt)."""
    from torch import nn
    if name == "LeNet":
        model = nn.Sequential(nn.Conv2d(1, 20, 5), nn.MaxPool2d(2, 2), nn.Conv2d(20, 50, 5),
                              nn.MaxPool2d(2, 2), nn.Flatten(), nn.Linear(800, 500), nn.ReLU(),
                              nn.Linear(500, 10))
    else:  # Caffe's pooling rounds up: ceil_mode
        model = nn.Sequential(nn.Conv2d(3, 32, 5, padding=2), nn.MaxPool2d(3, 2, ceil_mode=True),
                              nn.ReLU(), nn.Conv2d(32, 32, 5, padding=2), nn.ReLU(),
                              nn.AvgPool2d(3, 2, ceil_mode=True), nn.Conv2d(32, 64, 5, padding=2),
                              nn.ReLU(), nn.AvgPool2d(3, 2, ceil_mode=True), nn.Flatten(),
                              nn.Linear(64 * 4 * 4, 64), nn.Linear(64, 10))
    return model


def torch_step(name, batch, shape):
    import torch
    from torch import nn
    model = torch_net(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9, weight_decay=0.0005)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    x = torch.randn((batch,) + shape, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)

    def step():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return step


def timed(fn, steps):
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-pool", dest="pool", action="store_false",
                    help="minicaffe without its kernel pool: numpy's BLAS on --threads "
                         "threads instead (what minicaffe did before the pool)")
    ap.add_argument("--replicas", type=int, default=0,
                    help="minicaffe: the batch across N worker processes of one thread "
                         "each; PyTorch: N threads (replaces --threads)")
    a = ap.parse_args(argv)
    replicas = a.replicas if a.replicas > 0 else 1
    if a.replicas > 0:
        a.threads = a.replicas       # PyTorch's threads; minicaffe's main process: one
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(a.threads if a.replicas <= 0 else 1)
    sys.path.insert(0, ROOT)
    import numpy  # noqa: F401  (after the thread variables)
    import torch
    torch.set_num_threads(a.threads)
    import minicaffe
    if a.replicas > 0:
        head = (f"minicaffe {a.replicas} replica process(es) of one thread each, PyTorch "
                f"{a.threads} thread(s)")
    else:
        if a.pool:   # as `minicaffe ... --threads N` does: with N > 1 the convolutions'
            minicaffe.set_num_threads(a.threads)   # batch-parallel pool, one BLAS thread
        pool = "" if a.threads == 1 else (" (minicaffe: kernel pool)" if a.pool
                                          else " (minicaffe: BLAS threads, no pool)")
        head = f"{a.threads} thread(s) each{pool}"
    print(f"{head}; "
          f"minicaffe {minicaffe.__version__}, numpy "
          f"{numpy.__version__}, PyTorch {torch.__version__}; {os.cpu_count()} CPUs; "
          f"load average {os.getloadavg()[0]:.2f} at start")
    for name, (path, batch, shape) in NETS.items():
        (ours, solver), theirs = (minicaffe_step(path, batch, shape, replicas),
                                  torch_step(name, batch, shape))
        ours(), theirs()  # warm up
        mc, pt = [], []
        for _ in range(a.rounds):
            mc.append(timed(ours, a.steps))
            pt.append(timed(theirs, a.steps))
        solver.close()
        m, p = statistics.median(mc), statistics.median(pt)
        print(f"{name} b{batch}: minicaffe {m:.1f} ms/step (min {min(mc):.1f}), PyTorch "
              f"{p:.1f} ms/step (min {min(pt):.1f}); minicaffe/PyTorch {m / p:.2f}")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
