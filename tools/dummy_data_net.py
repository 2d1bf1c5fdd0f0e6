"""Write a copy of a train/test net whose Data layers are DummyData of a given shape, for
timing a net without its dataset:

    python tools/dummy_data_net.py NET.prototxt OUT.prototxt N,C,H,W

The data top gets N,C,H,W (gaussian values), the label top N (zeros)."""
import sys

from google.protobuf import text_format

from minicaffe.network.net import read_net_param


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    src, dst, shape = argv
    dims = [int(d) for d in shape.split(",")]
    p = read_net_param(src)
    for layer in p.layer:
        if layer.type not in ("Data", "ImageData", "HDF5Data", "MemoryData"):
            continue
        tops = list(layer.top)
        for f in ("data_param", "image_data_param", "hdf5_data_param", "memory_data_param",
                  "transform_param"):
            layer.ClearField(f)
        layer.type = "DummyData"
        d = layer.dummy_data_param
        d.shape.add().dim.extend(dims)
        d.data_filler.add(type="gaussian", std=1.0)
        if len(tops) > 1:
            d.shape.add().dim.append(dims[0])
            d.data_filler.add(type="constant", value=0)
    with open(dst, "w") as f:
        f.write(text_format.MessageToString(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
