"""The offload plan of a GPU run, made again on the CPU: what ``offload.build`` chose from
(each step's time from the run's profile, each cuDNN convolution's Find results and
picks, so each workspace) dumped on a GPU, then replayed through the same pure-Python
planning with the CPU engine's net -- to try a change of the policy on the timeline
model before spending device time on it (docs/offload.md, round 5).

    python benchmarks/offload_replay.py --dump OUT.json [--net vgg16] [--batch 256]
                                        [--limit 12GiB]          # on a GPU: DYNAMIC
    python benchmarks/offload_replay.py --replay benchmarks/offload_replay_vgg16_h100.json
                                        [--no-through] [--no-recompute] [--margin MiB]

``--replay`` prints the plan as the log would, its planned peak against the GPU run's,
and the timeline model's ms (copies waited for where the placement says) with every
wait it has.  The CPU net keeps no pooling state (as cuDNN's pooling), so the bytes
beside the arena match the GPU's.  benchmarks/offload_replay_vgg16_h100.json is the dump
of VGG-16 b256 under ``--gpu_mem_limit 12GiB`` on an H100 (round 4's code, whose plan it
reproduces: 11.607 GiB, the same maps, copies and recomputes).
"""
import argparse
import collections
import json
import os
import sys

sys.path.insert(0, ".")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODELS = {"vgg16": "models/vgg16/train_val.prototxt",
          "resnet50": "models/resnet50/train_val.prototxt"}
REPLAY_VGG16 = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "offload_replay_vgg16_h100.json")


def dump(path, net_name, batch, limit):
    """On a GPU: build the net as benchmarks/offload.py does under DYNAMIC ``limit``,
    run 4 iterations (the profile and the re-plan), and write what the plan came from."""
    from gpu_step import make, synthetic
    from minicaffe.core import backend, context, log
    from minicaffe.core.config import parse_gpu_mem_limit
    from minicaffe.engine import offload
    from minicaffe.gpu import options, pool
    from minicaffe.layers import cudnn_layers
    from minicaffe.proto import caffe_pb2
    log.init_log()
    options.set_tf32(False)
    context.set_mode_gpu()
    pool.ensure()
    budget = offload.resolve_budget(parse_gpu_mem_limit(limit))
    net = synthetic(MODELS[net_name], batch, [3, 224, 224])
    net.offload_param.policy = caffe_pb2.OffloadParameter.Policy.Value("DYNAMIC")
    net.offload_param.gpu_memory_budget = int(budget)
    os.environ.setdefault("MINICAFFE_CUDNN_WORKSPACE_LIMIT", str(cudnn_layers.OFFLOAD_FIND_LIMIT))
    solver = make(net, True)
    cudnn_layers.share_workspace(solver.net.layers, cudnn_layers.OFFLOAD_PRICE_PER_GIB)
    solver.step(4)
    backend.synchronize()
    st = solver.gpu_step
    convs = {}
    for l in solver.net.layers:
        if getattr(l, "candidates", None):
            a = getattr(l, "_nhwc", None) or l
            convs[l.name] = {"candidates": dict(l.candidates),
                             "picked": {"fwd": a.fwd, "bwd_data": a.bwd_data,
                                        "bwd_filter": a.bwd_filter},
                             "need": [l.workspace_need("forward"), l.workspace_need("backward")]}
    out = {"net": net_name, "batch": batch, "limit": limit,
           "device": backend.device_properties(backend.current_device()).get("name", ""),
           "times": st.offload.times, "convs": convs, "side_bytes": st.plan.side_bytes,
           "peak": st.plan.peak,
           "entries": [repr(e) + f" release {e.release}" for e in st.offload.oplan.entries]}
    with open(path, "w") as f:
        json.dump(out, f, default=str)
    print(f"planned peak {st.plan.peak / 2 ** 30:.3f} GiB; written to {path}")


def replay_net(d):
    """The CPU net of dump ``d``, its convolutions answering the cuDNN workspace protocol
    with the GPU's Find results (``use_workspace``, ``workspace_need``)."""
    from gpu_step import synthetic
    from minicaffe import Net
    from minicaffe.gpu import cudnn
    from minicaffe.proto import caffe_pb2
    net = Net(synthetic(MODELS[d["net"]], d["batch"], [3, 224, 224]), phase=caffe_pb2.TRAIN)
    for layer in net.layers:
        if layer.type == "Pooling":     # as cuDNN's: keeps nothing, reads input and output
            layer.__class__ = type("CudnnLikePooling", (layer.__class__,), {
                "retain_inputs": (0,), "retain_outputs": (0,),
                "state_bytes": lambda self, bottom, top: 0})
        c = d["convs"].get(layer.name)
        if c is None:
            continue
        layer._cudnn_key = ("replay", layer.name)
        layer.candidates = {k: [tuple(a) for a in v] for k, v in c["candidates"].items()}
        picks = {"forward": c["need"][0], "backward": c["need"][1]}

        def use_workspace(cap, backward_cap=None, layer=layer, picks=picks):
            b = cap if backward_cap is None else backward_cap
            picks["forward"] = cudnn.pick(layer.candidates["fwd"], cap)[1]
            picks["backward"] = max(cudnn.pick(layer.candidates[k], b)[1]
                                    for k in ("bwd_data", "bwd_filter"))
            layer.workspace_bytes = max(picks.values())
        layer.use_workspace = use_workspace
        layer.workspace_need = lambda direction, picks=picks: picks[direction]
        layer.workspace_bytes = max(picks.values())
    return net


def waits(net, times, entries, first):
    """The timeline model's waits (as ``offload.simulate`` with the placed waits), as text."""
    from minicaffe.engine import offload
    after, release, fetch, need = (collections.defaultdict(list) for _ in range(4))
    redo = collections.defaultdict(float)
    for e in entries:
        if e.recompute is not None:
            redo[e.bwd_first] += sum(times[i] for i in e.recompute)
            continue
        after[e.d2h_after].append(e)
        if e.release is not None:
            release[e.release].append(e)
        if e.bwd_first is not None:
            fetch[e.prefetch].append(e)
            need[e.bwd_first].append(e)
    t = h2d_free = 0.0
    pipe, in_done, lines = offload._OutPipe(offload.D2H_BYTES_PER_S), {}, []
    for s in range(first, len(times)):
        start, why = t, []
        for e in release.get(s, ()):
            if pipe.end_of(id(e)) > start:
                start, why = pipe.end_of(id(e)), why + [f"out {e.name}"]
        for e in fetch.get(s, ()):
            h2d_free = in_done[id(e)] = (max(h2d_free, start, pipe.end_of(id(e))) +
                                         e.copy_bytes / offload.H2D_BYTES_PER_S)
        for e in need.get(s, ()):
            if in_done[id(e)] > start:
                start, why = in_done[id(e)], why + [f"in {e.name}"]
        if start > t + 1e-6:
            i, direction = offload.step_layer(net, s)
            lines.append(f"  {net.layer_names[i]} {direction} waits {(start - t) * 1e3:.1f} ms "
                         f"({', '.join(why)})")
        t = start + redo.get(s, 0.0) + times[s]
        for e in after.get(s, ()):
            pipe.add(id(e), t, e.copy_bytes, e.lane)
    return lines


def replay(path, through=True, recompute=True, margin=None):
    from minicaffe.core.config import parse_gpu_mem_limit
    from minicaffe.engine import offload
    with open(path) as f:
        d = json.load(f)
    offload.THROUGH, offload.RECOMPUTE = through, recompute
    if margin is not None:
        offload.BUDGET_MARGIN = int(margin * (1 << 20))
    net = replay_net(d)
    times = list(d["times"])
    first = offload.n_prologue(net)
    op = offload._build_fitting(net, "DYNAMIC", parse_gpu_mem_limit(d["limit"]), 1, times=times)
    for line in op.describe():
        print(line)
    total = offload.simulate(times, op.entries, first, lazy=True)[0]
    redo = sum(sum(times[i] for i in e.recompute) for e in op.entries if e.recompute)
    print(f"planned peak {op.peak / 2 ** 30:.3f} GiB (the dumped GPU run's {d['peak'] / 2 ** 30:.3f}); "
          f"the timeline model: {total * 1e3:.1f} ms, of which {sum(times[first:]) * 1e3:.1f} "
          f"compute and {redo * 1e3:.1f} recomputes")
    for line in waits(net, times, op.entries, first):
        print(line)
    return op, total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", default="")
    ap.add_argument("--net", default="vgg16")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--limit", default="12GiB")
    ap.add_argument("--replay", default="")
    ap.add_argument("--no-through", action="store_true")
    ap.add_argument("--no-recompute", action="store_true")
    ap.add_argument("--margin", type=float, default=None, help="offload.BUDGET_MARGIN, MiB")
    a = ap.parse_args()
    if a.dump:
        dump(a.dump, a.net, a.batch, a.limit)
    if a.replay:
        replay(a.replay, not a.no_through, not a.no_recompute, a.margin)


if __name__ == "__main__":
    main()
