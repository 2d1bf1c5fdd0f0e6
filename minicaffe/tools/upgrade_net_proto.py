"""Upgrade an old net definition to the current format: Caffe's
``tools/upgrade_net_proto_text.cpp`` and ``tools/upgrade_net_proto_binary.cpp``.

    minicaffe upgrade_net_proto_text   OLD.prototxt   NEW.prototxt
    minicaffe upgrade_net_proto_binary OLD.caffemodel NEW.caffemodel
    (also: minicaffe-upgrade-net-proto-text / minicaffe-upgrade-net-proto-binary)

V0 layers (``layers { layer { type: "conv" } }``), V1 layers (``layers { type: CONVOLUTION
}``), transformation fields inside data parameters, ``input``/``input_dim`` fields and
BatchNorm's forced ``param`` specs become today's ``layer { type: "Convolution" }`` form,
with minicaffe/upgrade.py (Caffe's upgrade_proto.cpp).  As Caffe's tools, a file already in
the latest format is written out unchanged, with an error-level note saying so (exit status
0).  The output is written under a temporary name and renamed when complete.
"""
import argparse
import os
import sys

from minicaffe.data import toolutil


def _upgrade(argv, binary):
    from minicaffe.core import log, protoio
    from minicaffe.core.errors import MinicaffeError
    from minicaffe.proto import caffe_pb2
    from minicaffe.network.upgrade import upgrade_net_as_needed
    kind = "binary" if binary else "text"
    ap = argparse.ArgumentParser(
        prog=f"minicaffe upgrade_net_proto_{kind}",
        description=f"Upgrade an old (V0/V1) {kind} NetParameter to the current format.")
    ap.add_argument("input", help=f"the old net ({'.caffemodel' if binary else 'prototxt'})")
    ap.add_argument("output", help="where the upgraded net goes")
    args = ap.parse_args(argv)
    if not os.path.isfile(args.input):
        raise MinicaffeError(f"{args.input}: no such file")
    net = caffe_pb2.NetParameter()
    try:
        (protoio.read_binary if binary else protoio.read_text)(args.input, net)
    except MinicaffeError:
        raise
    except Exception as e:  # protobuf's DecodeError, a text parse error
        raise MinicaffeError(f"{args.input}: failed to parse input {kind} file as "
                             f"NetParameter ({e})") from None
    if not upgrade_net_as_needed(net, args.input):
        log.error("File already in latest proto format: %s", args.input)
    (protoio.write_binary if binary else protoio.write_text)(args.output, net)
    log.info("Wrote upgraded NetParameter %s proto to %s", kind, args.output)


def main_text(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    return toolutil.run("upgrade_net_proto_text", lambda a: _upgrade(a, False), argv)


def main_binary(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    return toolutil.run("upgrade_net_proto_binary", lambda a: _upgrade(a, True), argv)


if __name__ == "__main__":
    sys.exit(main_text())
