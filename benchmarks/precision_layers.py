"""Where a training iteration's GPU time goes, per layer type, in each precision (issue 20).

    python3 benchmarks/precision_layers.py --model models/resnet50/train_val.prototxt \
        --batch 64 --precision fp32,bf16 [--iterations 5]

Each precision in a fresh solver (synthetic inputs, SGD), run eagerly layer by layer with
a CUDA event before and after every layer's forward and backward (the Net's hooks, the
rounding hooks of a reduced type included in the layer they follow); prints, per
precision, the ms per iteration summed by layer type (forward + backward) and the total
of the timed layers.  Eager: the figures include no graph replay and are for comparing
precisions with each other, not with ``minicaffe bench``.
"""
import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--precision", default="fp32,bf16")
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--top", type=int, default=0,
                    help="also print the N slowest layers (forward + backward, with shapes)")
    a = ap.parse_args(argv)
    from minicaffe.core import backend, context
    from minicaffe.core.config import RunConfig
    from minicaffe.synthetic import synthetic_solver
    context.set_mode_gpu()
    for prec in a.precision.split(","):
        s, _ = synthetic_solver(model=a.model, batch=a.batch,
                                config=RunConfig(precision=prec, cuda_graphs=False))
        net = s.net
        marks = {}

        def hook(kind):
            def fn(i):
                ev = backend.new_event()
                ev.record()
                marks.setdefault((kind, i), []).append(ev)
            return fn
        for kind in net.HOOK_KINDS:
            net.add_hook(kind, hook(kind))
        s.step(2)                       # warm-up: Find, scratch buffers
        marks.clear()
        s.step(a.iterations)
        backend.synchronize()
        by_type = collections.Counter()
        by_layer = collections.Counter()
        for i, layer in enumerate(net.layers):
            for d in ("forward", "backward"):
                for st, en in zip(marks.get(("before_" + d, i), ()),
                                  marks.get(("after_" + d, i), ())):
                    t = backend.elapsed_ms(st, en) / a.iterations
                    by_type[layer.type] += t
                    by_layer[(i, d)] += t
        total = sum(by_type.values())
        print(f"{os.path.basename(os.path.dirname(a.model))} b{a.batch} {prec}: "
              f"{total:.2f} ms per iteration in the layers (eager); by type: " +
              ", ".join(f"{k} {v:.2f}" for k, v in by_type.most_common()))
        for (i, d), t in by_layer.most_common(a.top):
            b = net.bottom_vecs[i][0].shape if net.bottom_vecs[i] else ()
            p = net.net_param.layer[i]
            conv = p.convolution_param
            geo = (f" k{list(conv.kernel_size)} s{list(conv.stride)}"
                   if p.type == "Convolution" else "")
            print(f"  {t:7.3f} ms  {net.layer_names[i]} ({net.layers[i].type}{geo}) {d} "
                  f"bottom {tuple(b)}")
        s.close()
        del s, net
        backend.synchronize()


if __name__ == "__main__":
    main()
