"""The GPU training step of a models/ net under several cuDNN workspace limits: ms per
iteration, the workspace each net chose, and each convolution's algorithms.

    python benchmarks/cudnn_workspace.py vgg16 64 1,8      # limits in GiB

Each limit is applied through MINICAFFE_CUDNN_WORKSPACE_LIMIT (it caps cuDNN's Find and so
the workspace the net chooses: layers/cudnn_layers.py); the Find cache is cleared between
limits.  (The figures in docs/performance.md were taken by this script's earlier form,
which set the old per-call limit instead.)
"""
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ".")
from gpu_step import make, synthetic, timeit  # noqa: E402
from minicaffe.core import backend, context, log  # noqa: E402
from minicaffe.gpu import cudnn, options, pool  # noqa: E402


def main(argv):
    net_name, batch, limits = argv[0], int(argv[1]), argv[2]
    log.init_log()
    options.set_tf32(False)
    context.set_mode_gpu()
    pool.ensure()
    for gib in [float(x) for x in limits.split(",")]:
        os.environ["MINICAFFE_CUDNN_WORKSPACE_LIMIT"] = str(int(gib * (1 << 30)))
        cudnn._algo_cache.clear()
        pool.reset_peak()
        solver = make(synthetic(f"models/{net_name}/train_val.prototxt", batch,
                                [3, 224, 224]), True)
        ms = timeit(solver, 3, 2)
        convs = [l for l in solver.net.layers if getattr(l, "_cudnn_key", None) is not None
                 and getattr(l, "candidates", None)]
        ws = max((l.workspace_bytes for l in convs), default=0)
        print(f"{net_name} b{batch} limit {gib:g} GiB: {ms:.1f} ms/iter, workspace "
              f"{ws / 2 ** 30:.2f} GiB, peak {pool.peak_bytes() / 2 ** 30:.2f} GiB", flush=True)
        for l in convs:
            print(f"   {l.layer_param.name:12s} fwd {l.fwd} bwd_data {l.bwd_data} "
                  f"bwd_filter {l.bwd_filter}  (algo, bytes, ms)", flush=True)
        solver.close()
        del solver
        gc.collect()
        backend.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
