"""Draw a net definition as a graph (pycaffe's python/caffe/draw.py and draw_net.py).

``get_dot(net_param, rankdir='LR', phase=None, display_lrm=False)`` gives Graphviz dot
text and needs nothing else.  ``draw_net`` / ``draw_net_to_file`` render it to PNG, SVG,
PDF... through Graphviz's ``dot`` program (or pydot, which needs ``dot`` too); the
extensions ``.dot``, ``.gv`` and ``.raw`` write the dot text itself.

Layers are boxes (coloured by type as pycaffe: convolution red, pooling orange, inner
product purple, in-place layers green), blobs octagons; a layer's label gives its name,
type, kernel/stride/pad for spatial layers and, with ``display_lrm``, its lr multipliers;
the two layers of a pair the GPU engine computes as one (layers/fused.py, with cuDNN
unless a layer asks for ``engine: CAFFE``) each carry a line ``fused on the GPU: <type>``.
Command line (pycaffe's flags)::

    python tools/draw_net.py net.prototxt net.png [--rankdir LR] [--phase TRAIN|TEST|ALL]
                             [--display_lrm]
"""
import argparse
import os
import shutil
import subprocess
import sys

from ..core import protoio
from ..core.errors import MinicaffeError
from ..proto import caffe_pb2

LAYER_STYLE_DEFAULT = {"shape": "record", "fillcolor": "#6495ED", "style": "filled"}
NEURON_LAYER_STYLE = {"shape": "record", "fillcolor": "#90EE90", "style": "filled"}
BLOB_STYLE = {"shape": "octagon", "fillcolor": "#E0E0E0", "style": "filled"}
TEXT_FORMATS = ("dot", "gv", "raw")


def get_pooling_types_dict():
    """{PoolMethod number: name}."""
    desc = caffe_pb2.PoolingParameter.PoolMethod.DESCRIPTOR
    return {v.number: k for k, v in desc.values_by_name.items()}


def get_edge_label(layer):
    """Label of the edges out of ``layer``: batch size of Data, num_output of learned layers."""
    if layer.type == "Data":
        return "Batch " + str(layer.data_param.batch_size)
    if layer.type in ("Convolution", "Deconvolution"):
        return str(layer.convolution_param.num_output)
    if layer.type == "InnerProduct":
        return str(layer.inner_product_param.num_output)
    return ""


def get_layer_lr_mult(layer):
    """(weight lr_mult, bias lr_mult) of a Convolution/Deconvolution/InnerProduct layer."""
    if layer.type not in ("Convolution", "Deconvolution", "InnerProduct"):
        raise ValueError(f"{layer.type} layers do not have a learning rate multiplier")
    params = layer.param
    if len(params) == 0:
        return (1.0, 1.0)
    if len(params) == 1:
        return (params[0].lr_mult, 1.0)
    if len(params) == 2:
        return (params[0].lr_mult, params[1].lr_mult)
    raise ValueError("Could not parse the learning rate multiplier")


def get_layer_label(layer, rankdir, display_lrm=False):
    """The node label of a layer: name, (type), spatial parameters, lr multipliers."""
    separator = " " if rankdir in ("TB", "BT") else "\n"
    descriptors = [layer.name]
    if layer.type == "Pooling":
        descriptors.append(f"({layer.type} {get_pooling_types_dict()[layer.pooling_param.pool]})")
    else:
        descriptors.append(f"({layer.type})")
    if layer.type in ("Convolution", "Deconvolution", "Pooling"):
        if layer.type == "Pooling":
            p = layer.pooling_param
            kernel_size, stride, padding = p.kernel_size, p.stride, p.pad
        else:
            p = layer.convolution_param
            kernel_size = p.kernel_size[0] if len(p.kernel_size) else 1
            stride = p.stride[0] if len(p.stride) else 1
            padding = p.pad[0] if len(p.pad) else 0
        descriptors.append(separator.join([f"kernel size: {kernel_size}", f"stride: {stride}",
                                           f"pad: {padding}"]))
    if display_lrm and layer.type in ("Convolution", "Deconvolution", "InnerProduct"):
        lrm0, lrm1 = get_layer_lr_mult(layer)
        if any([lrm0, lrm1]):
            descriptors.append("lr mult: %.1f, %.1f" % (lrm0, lrm1))
    return separator.join(descriptors)


def choose_color_by_layertype(layertype):
    if layertype in ("Convolution", "Deconvolution"):
        return "#FF5050"
    if layertype == "Pooling":
        return "#FF9900"
    if layertype == "InnerProduct":
        return "#CC33FF"
    return "#6495ED"


def layer_included(layer, phase):
    """pycaffe's phase filter: no include rules means included; include rules add their
    phases, exclude rules remove theirs."""
    if phase is None:
        return True
    if len(layer.include) and len(layer.exclude):
        raise MinicaffeError(f"layer '{layer.name}' has both include and exclude specified")
    included = len(layer.include) == 0
    for rule in layer.include:
        included = included or rule.phase == phase
    for rule in layer.exclude:
        included = included and not rule.phase == phase
    return included


def _quote(s):
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _attrs(d):
    return ", ".join(f"{k}={_quote(v)}" for k, v in d.items())


def fused_types(layers, phase=None):
    """{layer name: fused type} for the pairs of ``layers`` (LayerParameters, in order) that
    the GPU engine computes as one, with cuDNN (unless a layer asks for engine CAFFE)."""
    from ..layers.fused import find_fusions
    from ..layers.registry import engine_name

    def engine_of(i):
        return "CAFFE" if engine_name(layers[i]) == "CAFFE" else "CUDNN"

    def use_global_stats(i):
        p = layers[i].batch_norm_param
        return p.use_global_stats if p.HasField("use_global_stats") else phase == caffe_pb2.TEST

    out = {}
    for i, kind in find_fusions(layers, engine_of, use_global_stats):
        for layer in layers[i:i + kind.size]:
            out[layer.name] = kind.type
    return out


def get_graph(caffe_net, rankdir="LR", label_edges=True, phase=None, display_lrm=False):
    """(nodes, edges) of the drawing: nodes {id: attrs} in first-seen order, edges
    [(src id, dst id, label)]."""
    nodes, edges = {}, []
    included = [layer for layer in caffe_net.layer if layer_included(layer, phase)]
    fused = fused_types(included, phase)
    separator = " " if rankdir in ("TB", "BT") else "\n"
    for layer in included:
        node_id = f"{layer.name}_{layer.type}"
        label = get_layer_label(layer, rankdir, display_lrm=display_lrm)
        if layer.name in fused:
            label += f"{separator}fused on the GPU: {fused[layer.name]}"
        if len(layer.bottom) == 1 and len(layer.top) == 1 and layer.bottom[0] == layer.top[0]:
            style = dict(NEURON_LAYER_STYLE)
        else:
            style = dict(LAYER_STYLE_DEFAULT, fillcolor=choose_color_by_layertype(layer.type))
        nodes[node_id] = dict(label=label, **style)
        for bottom in layer.bottom:
            nodes.setdefault(bottom + "_blob", dict(label=bottom, **BLOB_STYLE))
            edges.append((bottom + "_blob", node_id, ""))
        for top in layer.top:
            nodes.setdefault(top + "_blob", dict(label=top, **BLOB_STYLE))
            edges.append((node_id, top + "_blob", get_edge_label(layer) if label_edges else ""))
    return nodes, edges


def get_dot(caffe_net, rankdir="LR", label_edges=True, phase=None, display_lrm=False):
    """Graphviz dot text of a NetParameter (or anything ``read_net_param`` reads)."""
    caffe_net = _as_net_param(caffe_net)
    nodes, edges = get_graph(caffe_net, rankdir, label_edges, phase, display_lrm)
    name = caffe_net.name if caffe_net.name else "Net"
    lines = [f"digraph {_quote(name)} {{", f"  rankdir={_quote(rankdir)};"]
    for node_id, attrs in nodes.items():
        lines.append(f"  {_quote(node_id)} [{_attrs(attrs)}];")
    for src, dst, label in edges:
        lines.append(f"  {_quote(src)} -> {_quote(dst)} [label={_quote(label)}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _as_net_param(net):
    if isinstance(net, caffe_pb2.NetParameter):
        return net
    from ..network.net import read_net_param
    return read_net_param(net)


def render(dot_text, ext):
    """Bytes of ``dot_text`` rendered in format ``ext`` (png, svg, pdf...) by Graphviz."""
    ext = ext.lower()
    if ext in TEXT_FORMATS:
        return dot_text.encode()
    exe = shutil.which("dot")
    if exe is not None:
        proc = subprocess.run([exe, "-T" + ext], input=dot_text.encode(), capture_output=True)
        if proc.returncode != 0:
            raise MinicaffeError(f"Graphviz dot failed to write {ext}: "
                                 f"{proc.stderr.decode(errors='replace').strip()}")
        return proc.stdout
    try:
        import pydot
    except ImportError:
        pydot = None
    if pydot is not None:
        try:
            return pydot.graph_from_dot_data(dot_text)[0].create(format=ext)
        except Exception as e:  # pydot raises when dot is missing
            raise MinicaffeError(f"pydot could not render {ext}: {e}") from None
    raise MinicaffeError(f"drawing a .{ext} image needs Graphviz's `dot` program (apt-get "
                         "install graphviz) or pydot; without them write the dot text "
                         "instead (output file ending in .dot, .gv or .raw)")


def draw_net(caffe_net, rankdir="LR", ext="png", phase=None, display_lrm=False):
    """The net drawn as bytes in format ``ext``."""
    return render(get_dot(caffe_net, rankdir, phase=phase, display_lrm=display_lrm), ext)


def draw_net_to_file(caffe_net, filename, rankdir="LR", phase=None, display_lrm=False):
    """Draw the net into ``filename``; its extension picks the format (``.raw``/``.dot``
    for dot text).  Written to a temporary name, then renamed."""
    ext = filename[filename.rfind(".") + 1:] if "." in os.path.basename(filename) else "raw"
    protoio.atomic_write(filename, draw_net(caffe_net, rankdir, ext, phase, display_lrm))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Draw a graph of the net architecture.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("input_net_proto_file", help="Input network prototxt file")
    parser.add_argument("output_image_file", help="Output image file (.png, .svg, .pdf; "
                                                  ".dot/.gv/.raw for dot text)")
    parser.add_argument("--rankdir", default="LR",
                        help="One of TB (top-bottom, i.e., vertical), RL (right-left, i.e., "
                             "horizontal), or another valid dot option")
    parser.add_argument("--phase", default="ALL",
                        help="Which network phase to draw: TRAIN, TEST, or ALL (all layers "
                             "regardless of phase)")
    parser.add_argument("--display_lrm", action="store_true",
                        help="Show the learning rate multipliers of the learning layers "
                             "(Convolution, Deconvolution, InnerProduct) when non-zero")
    return parser.parse_args(argv)


def main(argv=None):
    """``tools/draw_net.py`` / ``python -m minicaffe.compat.draw``: exit status 0 or 1 (one-line
    error, no traceback)."""
    args = parse_args(argv)
    try:
        phase = {"TRAIN": caffe_pb2.TRAIN, "TEST": caffe_pb2.TEST, "ALL": None}.get(args.phase, -1)
        if phase == -1:
            raise MinicaffeError(f"Unknown phase: {args.phase} (use TRAIN, TEST or ALL)")
        if not os.path.exists(args.input_net_proto_file):
            raise MinicaffeError(f"{args.input_net_proto_file}: no such file")
        net = _as_net_param(args.input_net_proto_file)
        print(f"Drawing net to {args.output_image_file}")
        draw_net_to_file(net, args.output_image_file, args.rankdir, phase, args.display_lrm)
    except MinicaffeError as e:
        print(f"draw_net: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
