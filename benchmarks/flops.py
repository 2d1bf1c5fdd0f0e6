"""Multiply-adds of a training iteration of a models/ net (convolutions and inner
products; forward, backward data, backward filter = 3 x forward), for bounds:

    python benchmarks/flops.py models/vgg16/train_val.prototxt 64
"""
import sys

sys.path.insert(0, ".")
from minicaffe.core import log  # noqa: E402
from minicaffe.synthetic import synthetic_net_param  # noqa: E402
from minicaffe.network.net import Net, read_net_param, TRAIN  # noqa: E402


def forward_macs(net):
    total = 0
    for i, layer in enumerate(net.layers):
        if layer.type in ("Convolution", "Deconvolution"):
            y = net.top_vecs[i][0]
            w = layer.blobs[0]
            total += len(net.top_vecs[i]) * y.count() * (w.count() // w.shape[0])
        elif layer.type == "InnerProduct":
            total += net.top_vecs[i][0].count() * layer.K
    return total


def main():
    log.logger.setLevel(40)
    path, batch = sys.argv[1], int(sys.argv[2])
    p = read_net_param(path)
    p.state.phase = TRAIN
    param, _ = synthetic_net_param(p, path, batch)
    net = Net(param)
    macs = forward_macs(net)
    print(f"{net.name} b{batch}: forward {2 * macs / 1e9:.1f} GFLOP, training iteration "
          f"{6 * macs / 1e9:.1f} GFLOP")


if __name__ == "__main__":
    main()
