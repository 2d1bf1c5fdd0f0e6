"""Per-layer CPU time of one training step (forward + backward) of a net.

Usage::

    OPENBLAS_NUM_THREADS=1 python benchmarks/cpu_step.py MODEL.prototxt [--repeat 10]
        [--clock process|wall] [--general-pooling] [--threads N]

Builds the TRAIN net, runs one warm-up forward/backward, then ``--repeat``
steps, timing every layer's forward and backward like ``minicaffe time`` but
reporting the minimum and median over the steps (the machine is shared, so
the minimum is the steadier figure).  ``--clock process`` (default) measures
the process's CPU time, which other jobs on the machine disturb less than wall
time.  ``--general-pooling`` switches the pooling kernels' numpy fast paths
off (``minicaffe.kernels.pooling.FAST_PATH = False``) for a comparison.
``--threads N`` runs the step as ``minicaffe ... --threads N`` does (``set_num_threads``:
with N > 1 the kernel pool); then take ``--clock wall`` (process time adds the threads up).
Make a net with constant data from an example with::

    PYTHONPATH=. python tools/dummy_data_net.py examples/cifar10/cifar10_quick_train_test.prototxt \\
        /tmp/cq.prototxt 100,3,32,32
    sed -i '/data_filler/,/}/ s/"gaussian"/"constant"/' /tmp/cq.prototxt
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--clock", choices=("process", "wall"), default="process")
    ap.add_argument("--general-pooling", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    import minicaffe
    if a.threads is not None:
        minicaffe.set_num_threads(a.threads)
    from minicaffe.network.net import Net, TRAIN
    if a.general_pooling:
        from minicaffe.kernels import pooling
        pooling.FAST_PATH = False
    clock = time.process_time if a.clock == "process" else time.perf_counter
    minicaffe.set_mode_cpu()
    net = Net(a.model, TRAIN)
    net.forward_prefilled()
    net.backward_from_to()
    n = len(net.layers)
    fw = [[] for _ in range(n)]
    bw = [[] for _ in range(n)]
    tot = []
    for _ in range(a.repeat):
        s0 = clock()
        for i in range(n):
            t0 = clock()
            net.layers[i].forward(net.bottom_vecs[i], net.top_vecs[i])
            fw[i].append(clock() - t0)
        for i in range(n - 1, -1, -1):
            t0 = clock()
            if net.layer_need_backward[i]:
                net.layers[i].backward(net.top_vecs[i], net.bottom_need_backward[i],
                                       net.bottom_vecs[i])
            bw[i].append(clock() - t0)
        tot.append(clock() - s0)
    threads = "" if a.threads is None else f", {a.threads} thread(s)"
    print(f"{a.model}: {a.repeat} steps, {a.clock} time{threads}, ms (min / median); "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'layer':>10} {'forward':>16} {'backward':>16}")
    for i in range(n):
        f, b = fw[i], bw[i]
        print(f"{net.layer_names[i]:>10} {min(f) * 1e3:7.2f} / {statistics.median(f) * 1e3:6.2f}"
              f" {min(b) * 1e3:7.2f} / {statistics.median(b) * 1e3:6.2f}")
    print(f"{'step':>10} {min(tot) * 1e3:7.2f} / {statistics.median(tot) * 1e3:6.2f}")


if __name__ == "__main__":
    main()
