"""Synthetic inputs for timing a net without its data: every data layer of a net
becomes an Input layer of the same top shapes, filled once with random data (labels:
random integers in the range the loss accepts), so a timed loop does no host work.

- :func:`data_top_shapes` -- a data layer's top shapes without reading its data in a loop;
- :func:`synthetic_net_param` -- a NetParameter whose data layers are Input layers;
- :func:`fill_synthetic_inputs` -- random data and labels into a Net's inputs, once;
- :func:`synthetic_solver` -- a Solver on such a net (a model with SGD, or a solver file);
- :func:`synthetic_test_net` -- the TEST net of a model on such inputs.
"""
import contextlib
import os

import numpy as np

from .core import context, log
from .core.errors import MinicaffeError
from .network.net import Net, TEST, TRAIN, filter_net, read_net_param
from .proto import caffe_pb2

DATA_LAYER_TYPES = ("Data", "ImageData", "HDF5Data", "MemoryData", "DummyData", "Input",
                    "WindowData")
# layers whose shapes the layer parameters give (no file to read)
_DECLARED_SHAPES = ("Input", "DummyData", "MemoryData")
# loss/metric layers reading bottom 1 as class indices, and the axis of the classes
_CLASS_CONSUMERS = {"SoftmaxWithLoss": lambda lp: lp.softmax_param.axis,
                    "Accuracy": lambda lp: lp.accuracy_param.axis,
                    "MultinomialLogisticLoss": lambda lp: 1,
                    "InfogainLoss": lambda lp: lp.infogain_loss_param.axis,
                    "HingeLoss": lambda lp: 1}
# losses that read their second bottom as values (targets), not as class indices
_VALUE_CONSUMERS = ("EuclideanLoss", "SigmoidCrossEntropyLoss", "ContrastiveLoss")
DEFAULT_SOLVER = dict(type="SGD", base_lr=0.001, lr_policy="fixed", momentum=0.9,
                      weight_decay=0.0005)
SEED = 1701


# -- synthetic inputs ---------------------------------------------------------------------
@contextlib.contextmanager
def _cpu_mode():
    gpu = context.is_gpu()
    context.set_mode_cpu()
    try:
        yield
    finally:
        if gpu:
            context.set_mode_gpu()


def _batch_size(lp):
    for field in ("data_param", "image_data_param", "hdf5_data_param", "window_data_param"):
        if lp.HasField(field):
            return int(getattr(lp, field).batch_size)
    return 0


def _source(lp):
    for field in ("data_param", "image_data_param", "hdf5_data_param", "window_data_param"):
        if lp.HasField(field):
            return getattr(lp, field).source
    return ""


def _set_up_shapes(lp, phase):
    """Top shapes of data layer ``lp``, set up on its own in CPU mode (reads its first
    record when it has a source), then closed."""
    from .core.blob import Blob
    from .layers.registry import create_layer
    q = caffe_pb2.LayerParameter()
    q.CopyFrom(lp)
    q.phase = phase
    tops = [Blob() for _ in q.top]
    with _cpu_mode():
        layer = create_layer(q)
        try:
            layer.setup([], tops)
        finally:
            close = getattr(layer, "close", None)
            if callable(close):
                close()
    return [tuple(t.shape) for t in tops]


def _deploy_shapes(lp, model_path):
    """(C, H, W...) of ``lp``'s first top from the Input of the same name in the
    deploy.prototxt beside ``model_path``, or None."""
    if not model_path:
        return None
    path = os.path.join(os.path.dirname(os.path.abspath(model_path)), "deploy.prototxt")
    if not os.path.isfile(path):
        return None
    deploy = read_net_param(path)
    for layer in deploy.layer:
        if layer.type != "Input" or lp.top[0] not in layer.top:
            continue
        shapes = layer.input_param.shape
        k = list(layer.top).index(lp.top[0])
        if len(shapes) == 0:
            return None
        return tuple(shapes[0 if len(shapes) == 1 else k].dim)[1:]
    return None


def data_top_shapes(lp, phase=TRAIN, model_path=None, input_shape=None):
    """The shapes of data layer ``lp``'s tops, without reading its data in the loop.
    Input, DummyData and MemoryData declare theirs.  A file-backed layer: (batch_size,)
    + ``input_shape`` (C, H, W) when given, else what its source's first record gives
    (crop applied), else the Input of the same name in the deploy.prototxt beside the
    model; its later tops (labels) get (batch_size,)."""
    if lp.type in _DECLARED_SHAPES:
        return _set_up_shapes(lp, phase)
    where = f"layer '{lp.name}' ({lp.type})"
    batch = _batch_size(lp)
    if batch <= 0:
        raise MinicaffeError(f"{where}: batch_size is not set")
    if input_shape is None:
        source = _source(lp)
        if source and os.path.exists(source):
            try:
                return _set_up_shapes(lp, phase)
            except MinicaffeError as e:
                log.warning("%s: %s; looking for a deploy.prototxt", where, e)
        input_shape = _deploy_shapes(lp, model_path)
        if input_shape is None:
            raise MinicaffeError(
                f"{where}: cannot tell the shape of top '{lp.top[0]}' (its source "
                f"'{source}' cannot be read and no deploy.prototxt beside the model names "
                f"it); give --input_shape C,H,W")
    return [(batch,) + tuple(input_shape)] + [(batch,)] * (len(lp.top) - 1)


def synthetic_net_param(param, model_path=None, batch=None, input_shape=None):
    """(NetParameter, replaced): ``param`` (its ``state`` says phase, level and stages)
    filtered to its layers, with every data layer replaced by an Input layer of the same
    tops and shapes (batch dimension ``batch`` when given).  ``replaced`` lists
    (layer name, type, [(top, shape)])."""
    phase = param.state.phase
    filtered = filter_net(param)
    out = caffe_pb2.NetParameter()
    out.CopyFrom(filtered)
    del out.layer[:]
    replaced = []
    for lp in filtered.layer:
        if lp.type not in DATA_LAYER_TYPES or len(lp.bottom):
            out.layer.add().CopyFrom(lp)
            continue
        shapes = data_top_shapes(lp, phase, model_path, input_shape)
        if batch:
            shapes = [(int(batch),) + tuple(s[1:]) for s in shapes]
        inp = out.layer.add(name=lp.name, type="Input")
        inp.top.extend(lp.top)
        for s in shapes:
            inp.input_param.shape.add(dim=s)
        replaced.append((lp.name, lp.type, list(zip(lp.top, shapes))))
    if not replaced:
        raise MinicaffeError(f"net '{param.name}' has no data layer to replace "
                             f"(looked for {', '.join(DATA_LAYER_TYPES)})")
    return out, replaced


def _consumers(net, name):
    """(layer index, bottom index) of every layer reading blob ``name``, through Splits."""
    out = []
    for i, ids in enumerate(net.bottom_id_vecs):
        for k, b in enumerate(ids):
            if net.blob_names[b] != name:
                continue
            if net.layers[i].type == "Split":
                for t in net.top_id_vecs[i]:
                    out.extend(_consumers(net, net.blob_names[t]))
            else:
                out.append((i, k))
    return out


def label_classes(net, name):
    """The number of classes a label blob may index: the class axis of the scores that
    the loss layers reading it (as bottom 1) compare it with, the smallest if several; None
    when no such layer reads it."""
    ks = []
    for i, k in _consumers(net, name):
        layer = net.layers[i]
        axis_of = _CLASS_CONSUMERS.get(layer.type)
        if axis_of is not None and k == 1:
            scores = net.bottom_vecs[i][0]
            ks.append(scores.shape[axis_of(layer.layer_param) % scores.num_axes])
    return min(ks) if ks else None


def fill_synthetic_inputs(net, num_classes=None, seed=SEED):
    """Fill every input blob of ``net`` once.  Class labels -- blobs that a loss or
    Accuracy reads as labels -- get random integers in [0, K), K the class count of the
    scores they are compared with (see :func:`label_classes`) or ``num_classes``;
    ``num_classes`` also makes labels of the later tops of a data layer that no
    regression loss reads.  Anything else gets N(0, 1).  Returns {blob name:
    description}."""
    rs = np.random.RandomState(seed)
    later_tops = set()
    for i, layer in enumerate(net.layers):
        if layer.type == "Input":
            later_tops.update(net.blob_names[t] for t in net.top_id_vecs[i][1:])
    described = {}
    for name in net.inputs:
        blob = net.blob_by_name(name)
        k = label_classes(net, name)
        if num_classes and k is not None and num_classes > k:
            raise MinicaffeError(f"--num_classes {num_classes}: label '{name}' is compared "
                                 f"with {k} classes")
        if k is None and num_classes and name in later_tops and not any(
                net.layers[i].type in _VALUE_CONSUMERS for i, _ in _consumers(net, name)):
            k = num_classes
        if k is not None:
            k = int(num_classes or k)
            values = rs.randint(0, k, size=blob.shape)
            described[name] = f"integers in [0, {k})"
        else:
            values = rs.standard_normal(blob.shape)
            described[name] = "N(0, 1)"
        blob.mutable_cpu_data()[...] = values.astype(blob.dtype)
    return described


def _train_net_param(sp, solver_path, level=0, stages=()):
    """(NetParameter in phase TRAIN with the solver's train_state, its path or None)."""
    d = os.path.dirname(os.path.abspath(solver_path)) if solver_path else None

    def read(path):
        if d and not os.path.exists(path) and not os.path.isabs(path):
            alt = os.path.join(d, path)
            path = alt if os.path.exists(alt) else path
        return read_net_param(path), path
    if sp.HasField("train_net_param"):
        param, path = read_net_param(sp.train_net_param), None
    elif sp.HasField("train_net"):
        param, path = read(sp.train_net)
    elif sp.HasField("net_param"):
        param, path = read_net_param(sp.net_param), None
    elif sp.HasField("net"):
        param, path = read(sp.net)
    else:
        raise MinicaffeError(f"{solver_path or 'solver'}: the solver defines no net")
    state = caffe_pb2.NetState(phase=TRAIN)
    state.MergeFrom(param.state)
    state.MergeFrom(sp.train_state)
    state.level = level or state.level
    state.stage.extend(s for s in stages if s not in state.stage)
    param.state.CopyFrom(state)
    return param, path


def default_solver_param():
    """The solver ``--model`` trains with: SGD, lr 0.001 (fixed), momentum 0.9, weight
    decay 0.0005, Caffe's test seed."""
    sp = caffe_pb2.SolverParameter(**DEFAULT_SOLVER)
    sp.random_seed = SEED
    return sp


def synthetic_solver(model=None, solver=None, batch=None, input_shape=None, num_classes=None,
                     level=0, stages=(), config=None):
    """(solver, info): a Solver training ``model`` (with :func:`default_solver_param`)
    or the train net of ``solver`` (its type and settings), on synthetic inputs filled
    once; test nets, display and snapshots are switched off (``config``: the run's
    RunConfig, by default the environment's).  ``info`` holds the
    replaced data layers and the input descriptions."""
    from .solvers import read_solver_param, solver_class
    if solver:
        sp, path = read_solver_param(solver)
        param, model_path = _train_net_param(sp, path, level, stages)
    else:
        sp, path = default_solver_param(), None
        param = read_net_param(model)
        param.state.phase = TRAIN
        param.state.level = level
        del param.state.stage[:]
        param.state.stage.extend(stages)
        model_path = model
    net_param, replaced = synthetic_net_param(param, model_path, batch, input_shape)
    for f in ("net", "net_param", "train_net", "train_net_param"):
        sp.ClearField(f)
    for f in ("test_net", "test_net_param", "test_iter", "test_state"):
        sp.ClearField(f)
    sp.net_param.CopyFrom(net_param)
    sp.test_interval = 0
    sp.test_initialization = False
    sp.display = 0
    sp.snapshot = 0
    sp.snapshot_after_train = False
    sp.debug_info = False
    sp.max_iter = max(sp.max_iter, 1 << 30)
    s = solver_class(sp.type or "SGD", path or "solver")(sp, source=path, config=config)
    inputs = fill_synthetic_inputs(s.net, num_classes)
    return s, {"replaced": replaced, "inputs": inputs, "solver_param": sp}


def synthetic_test_net(model, batch=None, input_shape=None, num_classes=None, level=0,
                       stages=(), config=None):
    """(Net, info): the TEST net of ``model`` on synthetic inputs filled once."""
    param = read_net_param(model)
    param.state.phase = TEST
    param.state.level = level
    del param.state.stage[:]
    param.state.stage.extend(stages)
    net_param, replaced = synthetic_net_param(param, model, batch, input_shape)
    net = Net(net_param, config=config)
    inputs = fill_synthetic_inputs(net, num_classes)
    return net, {"replaced": replaced, "inputs": inputs, "solver_param": None}
