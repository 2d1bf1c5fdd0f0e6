"""The cuDNN engine: Caffe's ``cudnn_*_layer`` classes.

Each class here subclasses the Caffe-engine layer of its type and overrides only the
GPU bodies; on the CPU it is that layer.  The registry builds it for ``engine: CUDNN``,
and for ``engine: DEFAULT`` when cuDNN loads (``registry.choose_class``).  A layer whose
parameters cuDNN cannot compute exactly as Caffe does (a leaky ReLU, STOCHASTIC pooling,
an LRN window over 16...: each class's ``cudnn_refuses``) is built by the registry with
Caffe's class, once, with one log line; so is one whose top a later layer rewrites in
place where its cuDNN backward reads that top (the Net's ``top_rewritten``; a 2-byte
pooling, whose own kernels read no top, keeps its class and refuses cuDNN itself:
``CuDNNPoolingLayer``).  What only a
shape tells (a pooling window clipped by Caffe's ceil-mode shape, an input that is not
4-D, a data type cuDNN does not take) is decided once, at the layer's first reshape on a
GPU (``_ChosenOnce``), with one line naming the layer and the reason when it takes
Caffe's engine; later reshapes do not choose again.  The one exception keeps the numbers
Caffe's: a layer that took cuDNN, reshaped later to a shape cuDNN cannot compute as
Caffe does, takes Caffe's engine from then on (one line), never cuDNN again.

Convolution: descriptors per input shape, algorithms chosen by cuDNN's Find (timed on
the real shapes, once per geometry and process: ``gpu/cudnn.find_algorithms``), with one
workspace size for the whole net (``share_workspace``), strict fp32 (CUDNN_FMA_MATH) unless TF32 is
switched on (``gpu/options``).  Under the GPU training step each convolution's forward
and backward workspace is a buffer of the memory plan, at its own place in the arena
(``workspace_need``, engine/plan.py); elsewhere (a test net, pycaffe) the workspace is
one per thread and device, grown at the first (eager) run of each shape and never while
a CUDA graph is being captured.
"""

import numpy as np

from ..core import backend, config, context, log, precision
from ..gpu import cudnn, options
from ..kernels.precision import (buffer_dtype, from_reduced, from_reduced_t, to_reduced,
                                 to_reduced_t)
from ..kernels import conv16, pad16, pool16
from ..kernels._backend import gpu_spin
from ..kernels import reduced as r16
from ..kernels.reduce import channel_sum, partial_size
from ..proto import caffe_pb2
from .registry import engine_name, register_cudnn
from .common import SoftmaxLayer
from .layer import CAST_WEIGHTS
from .neuron import ReLULayer, SigmoidLayer, TanHLayer
from .normalization import BatchNormLayer
from .vision import ConvolutionLayer, LRNLayer, PoolingLayer

# The workspace is one buffer shared by every convolution of a thread, so its size is
# chosen for a whole net (share_workspace): the size that minimises the convolutions'
# summed time (cuDNN's Find, on the real shapes) priced at PRICE_PER_GIB of that time
# per GiB -- more workspace is taken only where each GiB buys at least 1% (VGG-16's
# first layers' Winograd kernels want gigabytes that grow with the batch).  Find tries
# up to find_limit() bytes: MINICAFFE_CUDNN_WORKSPACE_LIMIT (bytes) when set, else half
# the device's free memory (at most OFFLOAD_FIND_LIMIT for a net that offloads).
PRICE_PER_GIB = 0.01
# A net that offloads feature maps (offload_param, --offload) trades time for memory
# already: its workspace must buy 10% of the convolutions' time per GiB.
OFFLOAD_PRICE_PER_GIB = 0.10


# Find allocates the most workspace any algorithm asks for, beside the layer's input and
# output: for a net that offloads (offload_param, --offload) that scratch would raise the
# peak above the plan's (VGG-16 b256 under ALL: 25.35 GiB measured at set-up against 15.89
# planned with half the free memory), so its nets' Find takes at most OFFLOAD_FIND_LIMIT.
OFFLOAD_FIND_LIMIT = 4 << 30

# A 2-byte convolution's NCHW set, beside a channels-last one, runs only a net outside the
# GPU step's plan (a test net, pycaffe: the plan holds the maps channels-last), and it picks
# within the workspace cap chosen from the channels-last candidates (``use_workspace``:
# one cap for both sets; 51.2 MiB for VGG-16 b64 bf16, 62.3 for ResNet-50, H100): its Find
# is offered the workspace the channels-last Find was, at least NCHW_FALLBACK_LIMIT, not
# the gigabytes NCHW kernels ask for (VGG-16 b64 bf16's set-up held 4312.7 MiB at its
# highest, above the 4256.0 its training holds).  Not in a net that offloads: its fp32
# buffers run the NCHW set.
NCHW_FALLBACK_LIMIT = 256 << 20


def find_limit(offloading=False, limit=None):
    """Bytes of workspace Find may try: ``limit`` (a run's ``RunConfig.workspace_limit``;
    None: MINICAFFE_CUDNN_WORKSPACE_LIMIT) when set; ``offloading``: for a layer of a net
    that offloads (``RunConfig.offloads`` of the layer's config, given by its Net)."""
    if limit is None:
        limit = config.env("MINICAFFE_CUDNN_WORKSPACE_LIMIT")
    if limit is not None:
        return max(0, int(limit))
    free = backend.device_memory()[0] // 2
    return min(free, OFFLOAD_FIND_LIMIT) if offloading else free


def share_workspace(layers, price=PRICE_PER_GIB):
    """One workspace size for the cuDNN convolutions among ``layers`` (a net's, which
    share this thread's buffer): see PRICE_PER_GIB.  Returns the bytes chosen."""
    convs = [l for l in layers if getattr(l, "_cudnn_key", None) is not None and
             getattr(l, "candidates", None)]
    cap = cudnn.choose_workspace([c for l in convs for c in l.candidates.values()], price)
    for l in convs:
        l.use_workspace(cap)
    return cap


def workspace(nbytes):
    """This thread's cuDNN workspace on the current device, at least ``nbytes`` long."""
    handles = context.get().handles
    ws = handles.get("cudnn_ws")
    if nbytes == 0:
        return None
    if ws is None or ws.nbytes < nbytes:
        handles.pop("cudnn_ws", None)
        del ws          # the old one goes back first: never both at once
        ws = handles["cudnn_ws"] = backend.alloc_kept(nbytes)
    return ws


def _ptr(a):
    return a.data.ptr


# the "algorithm" of a 1x1 convolution run as a cuBLAS GEMM (channels-last), beside cuDNN's
GEMM = -1
# cuDNN's CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 (``_find_nhwc``)
WGRAD_ATOMIC = 0
# the "algorithm" of a filter gradient over few input channels run by kernels/conv16.py's
# direct kernels (channels-last; the bias gradient summed with it)
DIRECT = -2
# cuDNN's algorithm ``a`` run on the input's channels padded with zeros to PAD_TO (a first
# convolution's 3, channels-last: ``_find_padded``) is the candidate PADDED + a
PADDED, PAD_TO = 1 << 16, 8


def cublas_gemm(a, b, out, trans_a=False, trans_b=False, beta=0.0):
    from ..gpu import cublas
    return cublas.matmul_ex(a, b, out, trans_a=trans_a, trans_b=trans_b, beta=beta)


# Find's leading candidates timed again (``_retimed``), on channels-last 2-byte
# convolutions: those within RETIME_WITHIN of its fastest, at most RETIME_TOP; all of
# them where its fastest took under RETIME_ALL_BELOW ms (the host's launch cost, not the
# kernel, is then what Find saw)
RETIME_TOP, RETIME_WITHIN, RETIME_ALL_BELOW = 4, 3.0, 0.5
_RETIMES = {}        # (device, direction, geometry, algorithm, workspace): ms
_GEMM_TIMES = {}     # (device, direction, shapes, type): ms, so that every net agrees
_PAD_TIMES = {}      # (device, input shape, type): ms of the padding pass, likewise
_DIRECT_TIMES = {}   # (device, geometry, type): ms of conv16's filter gradient


def _timed(fn, reps=5, lead_ms=0.5):
    """Median ms of ``fn``'s device work on the current stream (CUDA events), after one
    warm-up call.  Each timed call is launched while a ``lead_ms`` spin kernel holds the
    stream (kernels.gpu_spin), so the events see the kernels back to back, as a replayed
    graph runs them: timed from an idle device, a small call measured the host's launch
    cost instead (LeNet's convolutions: 0.1-0.2 ms for any algorithm, Find's figures
    alike, where the graph ran one filter gradient in 0.608 ms and another in ~0.02)."""
    fn()
    ts = []
    for _ in range(reps):
        a, b = backend.new_event(), backend.new_event()
        gpu_spin(lead_ms)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(backend.elapsed_ms(a, b))
    return float(np.median(ts))


# the chunk (elements) in which ``_random16`` draws its fp32 values
RANDOM_CHUNK = 1 << 22


def _random16(rs, shape, storage):
    """A buffer of ``shape`` in ``storage``'s 2-byte type holding standard normal values
    (rounded), drawn in fp32 chunks of RANDOM_CHUNK elements: no fp32 temporary of the
    whole size (VGG-16 b64's conv1_2 input: 784 MiB beside its 392 MiB bf16 buffer)."""
    cp = backend.gpu_module()
    out = cp.empty(shape, dtype=buffer_dtype(storage))
    flat = out.reshape(-1)
    for i in range(0, flat.size, RANDOM_CHUNK):
        part = flat[i:i + RANDOM_CHUNK]
        to_reduced(rs.standard_normal(part.size, dtype=np.float32), part, storage)
    return out


def _search_workspace(d, lim):
    """A buffer of the most workspace Find should offer for descriptors ``d`` (x, w,
    conv, y) within ``lim`` bytes (cudnn.search_workspace of the three calls), or None."""
    need = max(cudnn.search_workspace("fwd", (d[0].ptr, d[1].ptr, d[2].ptr, d[3].ptr), lim),
               cudnn.search_workspace("bwd_data", (d[1].ptr, d[3].ptr, d[2].ptr, d[0].ptr), lim),
               cudnn.search_workspace("bwd_filter", (d[0].ptr, d[3].ptr, d[2].ptr, d[1].ptr),
                                      lim))
    return backend.gpu_module().empty(need, dtype=np.uint8) if need else None


def _retimed(kind, key, found, args, dt, ws=None):
    """Find's list ``found`` with its leading candidates (RETIME_TOP...) timed again on
    the same buffers, as the GEMM is
    (``_timed``: the device's time, median of 5 after a warm-up), and sorted by the new
    times.  Find's figures include the host's launch cost: on small 2-byte convolutions
    they were noise (LeNet fp16 conv1's filter gradient: algorithm 0 at 0.105 ms in
    Find, 0.608 ms a step in the replayed graph; algorithm 1, Find's second at 0.111).
    An algorithm Find lists that fails when called is dropped.  Cached per (device,
    kind, geometry, algorithm, workspace) like Find's lists.  ``ws``: Find's own
    workspace buffer, timed in when it is large enough (no second buffer beside it: set-up
    must not hold more device memory than training will)."""
    best = found[0][2]
    head = found if best < RETIME_ALL_BELOW else \
        [a for a in found[:RETIME_TOP] if a[2] <= best * RETIME_WITHIN]
    if len(head) < 2:
        return found
    fn = "cudnnConvolution" + {"fwd": "Forward", "bwd_data": "BackwardData",
                               "bwd_filter": "BackwardFilter"}[kind]
    need = max(a[1] for a in head)
    buf = ws if ws is not None and ws.nbytes >= need else \
        backend.gpu_module().empty(need or 1, dtype=np.uint8)
    h = cudnn.handle()
    out = []
    for algo, mem, t in found:
        ck = (context.device_id(), kind, key, algo, mem)
        if (algo, mem, t) in head and ck not in _RETIMES:
            try:
                _RETIMES[ck] = _timed(lambda: cudnn.call(
                    fn, h, cudnn.one(dt), *args[:5], algo, buf.data.ptr, mem,
                    cudnn.zero(dt), *args[5:]))
            except cudnn.CudnnError:    # listed by Find, refused when called: not usable
                _RETIMES[ck] = None
        if _RETIMES.get(ck, t) is not None:
            out.append((algo, mem, _RETIMES.get(ck, t)))
    return sorted(out, key=lambda a: a[2]) if out else found


class _Layout:
    """A convolution's channels-last descriptors (x, y N, H, W, C; the filter K, R, S, C)
    and, once found, its candidates and picked algorithms."""

    def __init__(self, xshape, yshape, wshape, dt):
        self.x_desc = cudnn.TensorDesc(xshape, dt, nhwc=True)
        self.y_desc = cudnn.TensorDesc(yshape, dt, nhwc=True)
        self.w_desc = cudnn.FilterDesc(wshape, dt, nhwc=True)
        self.candidates = None
        self.pad8 = None      # the _Layout of the input padded to PAD_TO channels, if any


class _ChosenOnce:
    """The engine choice of a cuDNN layer that only its blobs can tell (see the module
    docstring): a data type cuDNN does not take (``cudnn.DATA``) refuses it for every
    layer, and ``shape_refuses(bottom, top)`` gives None or why cuDNN cannot compute
    these blobs as Caffe does; ``_cudnn_for(bottom, top)``, called at each reshape, asks
    it on a GPU until the answer is Caffe's engine, which it keeps: a layer that took
    cuDNN checks each shape (cheap: the descriptors are cached per shape) and takes
    Caffe's engine for good, with one line, at the first cuDNN cannot compute."""
    _engine = None      # this layer's choice: None (not made yet), "CUDNN" or "CAFFE"

    @property
    def uses_cudnn(self):
        """True when the last reshape chose cuDNN (False: Caffe's body runs this shape)."""
        return getattr(self, "_use", False)

    def shape_refuses(self, bottom, top):
        return None

    def _cudnn_for(self, bottom, top):
        if not context.is_gpu() or self._engine == "CAFFE":
            return False
        why = (type(self).cudnn_refuses(self.layer_param)
               or (f"data type {bottom[0].dtype}" if bottom[0].dtype not in cudnn.DATA
                   else self.shape_refuses(bottom, top)))
        if why is None:
            self._engine = "CUDNN"
            return True
        p = self.layer_param
        (log.warning if engine_name(p) == "CUDNN" else log.info)(
            "layer '%s' (%s): cuDNN cannot compute it as Caffe does (%s): using Caffe's "
            "engine%s", p.name, self.type, why,
            " from now on" if self._engine == "CUDNN" else "")
        self._engine = "CAFFE"
        return False


# the name of the scratch buffer a layer's call may take whole (the memory plan's
# ``scratch_bytes``: the largest any layer asks, allocated at that size by engine/step.py)
LAYER_SCRATCH = "layer"


def scratch(name, nbytes):
    """A transient buffer of this thread on the current device, shared by every layer
    (used within one call, never across calls); grown at the first, eager, run."""
    handles = context.get().handles
    key = "scratch:" + name
    buf = handles.get(key)
    if buf is None or buf.nbytes < nbytes:
        handles.pop(key, None)
        del buf
        buf = handles[key] = backend.alloc_kept(nbytes)
    return buf


@register_cudnn("Convolution")
class CuDNNConvolutionLayer(_ChosenOnce, ConvolutionLayer):
    """Convolution through cuDNN: y = W * x + b; dW += dy (x) x; db += sum dy;
    dx = W^T (x) dy.  N-D (2 or 3 spatial axes), groups, dilation; channel axis 1."""

    @property
    def uses_cudnn(self):
        """True when the last reshape chose cuDNN (False: Caffe's engine runs this shape)."""
        return getattr(self, "_cudnn_key", None) is not None

    def shape_refuses(self, bottom, top):
        if self.channel_axis != 1:
            return f"channel axis {self.channel_axis}"
        if self.num_spatial not in (2, 3):
            return f"{self.num_spatial} spatial axes"
        return None

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        self._cudnn_key = None
        if not self._cudnn_for(bottom, top):
            return
        dt = bottom[0].dtype
        self._storage = self._reduced_storage(dt)
        if self._storage is not None:   # the reduced type's cuDNN calls (pseudo-half)
            dt = cudnn.storage_dtype(self._storage)
        key = (bottom[0].shape, tuple(self.kernel), tuple(self.pad), tuple(self.stride),
               tuple(self.dilation), self.group, self.num_output, str(dt), self.config.tf32,
               options.deterministic)
        if getattr(self, "_desc_key", None) != key:
            self._setup_descriptors(bottom[0].shape, top[0].shape, dt, key)
        self._cudnn_key = key

    def _setup_descriptors(self, xshape, yshape, dt, key):
        cp = backend.gpu_module()
        self.x_desc = cudnn.TensorDesc(xshape, dt)
        self.y_desc = cudnn.TensorDesc(yshape, dt)
        self.w_desc = cudnn.FilterDesc(self.blobs[0].shape, dt)
        self.conv_desc = cudnn.ConvDesc(self.pad, self.stride, self.dilation, self.group, dt,
                                        self.config.tf32)
        self.b_desc = cudnn.TensorDesc((1, self.num_output) + (1,) * self.num_spatial, dt)
        if self.conv_desc.output_dims(self.x_desc, self.w_desc) != tuple(yshape) + (1,) * (
                len(self.x_desc.shape) - len(yshape)):
            raise self.error(f"cuDNN computes a different output shape for input {xshape}")
        # time the algorithms on scratch buffers of the real shapes
        rs = cp.random.RandomState(1701)
        if self._storage is None:
            x = rs.standard_normal(xshape, dtype=dt)
            w = rs.standard_normal(self.blobs[0].shape, dtype=dt)
            y = rs.standard_normal(yshape, dtype=dt)
        else:
            x, w, y = (_random16(rs, shape, self._storage)
                       for shape in (xshape, self.blobs[0].shape, yshape))
        lim = find_limit(self.config.offloads, self.config.workspace_limit)
        d = self.x_desc, self.w_desc, self.conv_desc, self.y_desc
        dw = cp.empty_like(w)
        tc = self.config.tf32 or self._storage is not None    # tensor-op math allowed
        self._nhwc = None
        nchw_lim = lim
        if self._storage is not None and self.config.nhwc and self.num_spatial == 2:
            # the channels-last set first: it is what the GPU step's plan runs; the NCHW
            # set below only runs a net outside that plan (NCHW_FALLBACK_LIMIT)
            try:
                self._nhwc = self._find_nhwc(key, xshape, yshape, dt, x, w, y, dw, lim, tc)
            except cudnn.CudnnError as e:     # none for this shape: NCHW buffers
                log.info("layer '%s': no channels-last cuDNN convolution (%s)",
                         self.layer_param.name, e)
            if self._nhwc is not None and self._pads_input():
                try:
                    self._nhwc.pad8 = self._find_padded(key, xshape, yshape, dt, lim, tc)
                except cudnn.CudnnError as e:
                    log.info("layer '%s': no channels-last cuDNN convolution on %d padded "
                             "channels (%s)", self.layer_param.name, PAD_TO, e)
            if self._nhwc is not None and self._direct_shape(xshape):
                self._add_direct(self._nhwc.candidates, xshape)
            if self._nhwc is not None and not self.config.offloads:
                nchw_lim = min(lim, max(self._nhwc.search_bytes, NCHW_FALLBACK_LIMIT))
        ws = _search_workspace(d, nchw_lim)
        self._nchw_candidates = self._find(key, d, x, w, y, dw, ws, nchw_lim, tc)
        self.candidates = self._nchw_candidates
        if self._nhwc is not None:
            self.candidates = self._nhwc.candidates   # what the engine's plan runs
        del x, w, y, dw, ws
        self.use_workspace(cudnn.choose_workspace(list(self.candidates.values()), PRICE_PER_GIB))
        self._desc_key = key

    def _find_nhwc(self, key, xshape, yshape, dt, x, w, y, dw, lim, tc):
        n = _Layout(xshape, yshape, self.blobs[0].shape, dt)
        d = n.x_desc, n.w_desc, self.conv_desc, n.y_desc
        ws = _search_workspace(d, lim)
        n.search_bytes = 0 if ws is None else ws.nbytes
        n.candidates = self._find(key + ("NHWC",), d, x, w, y, dw, ws, lim, tc, retime=True)
        # cuDNN's filter-gradient algorithm 0 (atomics) is no candidate where another one
        # is: its time on 2-byte channels-last maps does not repeat (LeNet b64, H100, timed
        # alone: conv2 0.0736 ms in fp16 and 0.6473 in bf16, conv1 0.0656 in fp16; 0.608
        # ms a step in fp16's replayed graph, where it doubled the step)
        c = n.candidates["bwd_filter"]
        if any(a[0] != WGRAD_ATOMIC for a in c):
            n.candidates["bwd_filter"] = [a for a in c if a[0] != WGRAD_ATOMIC]
        del ws                    # given back before the GEMM's timing
        if self._gemm_shape():
            self._add_gemm(n.candidates, xshape, yshape, x, w, y)
        return n

    def _pads_input(self):
        """True for a 2-D ungrouped convolution of fewer than PAD_TO input channels (a
        first convolution's 3) when MINICAFFE_CONV_PAD8=1: its channels-last forward and
        filter gradient run on the input and the filter padded with zero channels to
        PAD_TO (``_find_padded``).  Off by default: on an H100 it made none of
        models/'s nets faster and held ResNet-50 b64 bf16's peak 49 MiB higher."""
        return self.num_spatial == 2 and self.group == 1 and \
            self.blobs[0].shape[1] < PAD_TO and config.env("MINICAFFE_CONV_PAD8") is True

    def _find_padded(self, key, xshape, yshape, dt, lim, tc):
        """The channels-last set of the input padded with zero channels to PAD_TO (x N, H,
        W, 8, the filter K, R, S, 8: cuDNN's tensor-core kernels want C a multiple of 8;
        the zeros change no sum): Find's forward and filter-gradient candidates, each
        with the time of the padding pass added (timed here once per shape and process,
        logged beside the unpadded time), as PADDED + algorithm: the only candidates of
        those two directions (the data gradient never pads).  Returns the padded
        _Layout."""
        cp = backend.gpu_module()
        n, c, h, w = xshape
        xs = (n, PAD_TO, h, w)
        ws = (self.blobs[0].shape[0], PAD_TO) + tuple(self.blobs[0].shape[2:])
        p = _Layout(xs, yshape, ws, dt)
        bt = buffer_dtype(self._storage)
        rs = cp.random.RandomState(1701)
        x8, w8, y = (to_reduced(rs.standard_normal(s, dtype=np.float32),
                                cp.empty(s, dtype=bt), self._storage) for s in (xs, ws, yshape))
        dw8 = cp.empty_like(w8)
        d = p.x_desc, p.w_desc, self.conv_desc, p.y_desc
        buf = _search_workspace(d, lim)
        found = self._find(key + ("NHWC", PAD_TO), d, x8, w8, y, dw8, buf, lim, tc,
                           kinds=("fwd", "bwd_filter"))
        del buf
        ck = (context.device_id(), tuple(xshape), str(self._storage))
        if ck not in _PAD_TIMES:
            x3 = cp.zeros(n * h * w * c, dtype=bt)
            _PAD_TIMES[ck] = _timed(lambda: pad16.pad_channels(x3, x8, c, PAD_TO))
        t = _PAD_TIMES[ck]
        cands = self._nhwc.candidates
        for kind, algos in found.items():
            mine = [(PADDED + a, m, ms + t) for a, m, ms in algos]
            log.info("layer '%s': channels-last %s on %d channels %.3f ms, padded to %d "
                     "%.3f + %.3f (Find's fastest, the padding pass)", self.layer_param.name,
                     kind, c, cands[kind][0][2], PAD_TO, mine[0][2] - t, t)
            cands[kind] = mine
        return p

    @property
    def pads_channels(self):
        """True when this layer's channels-last forward or filter gradient runs on its
        input padded with zero channels to PAD_TO (``_find_padded``; the algorithms picked
        for the current workspace)."""
        n = getattr(self, "_nhwc", None)
        return n is not None and n.pad8 is not None and hasattr(n, "fwd") and \
            (n.fwd[0] >= PADDED or n.bwd_filter[0] >= PADDED)

    def scratch_bytes(self, bottom, top):
        """The padded input's bytes (the shared scratch LAYER_SCRATCH, within one call)
        where this layer has a padded channels-last set whose algorithms it runs (or not
        picked yet), else 0 (ResNet-50 b64 bf16: 49 MiB of the peak for a padded set Find
        ranked below the unpadded one, H100)."""
        n = getattr(self, "_nhwc", None)
        if n is None or n.pad8 is None or (hasattr(n, "fwd") and not self.pads_channels):
            return 0
        return int(np.prod(n.pad8.x_desc.shape)) * np.dtype(buffer_dtype(self._storage)).itemsize

    def _pad_x(self, x16):
        """``x16`` (N, H, W, C channels-last) padded with zero channels to PAD_TO, in the
        shared scratch LAYER_SCRATCH."""
        n, c, h, w = x16.shape
        bt = x16.dtype
        nb = n * h * w * PAD_TO * bt.itemsize
        buf = scratch(LAYER_SCRATCH, nb)[:nb].view(bt)
        return pad16.pad_channels(x16, buf, c, PAD_TO)

    def _w16_padded(self):
        """The master weights K, R, S, PAD_TO in the reduced type (zeros past C), cast at
        each forward that runs a padded algorithm."""
        w = self.blobs[0].gpu_data()
        k, c, r, t = w.shape
        bt = np.dtype(buffer_dtype(self._storage))
        buf = getattr(self, "_w16_pad_buf", None)
        if buf is None or buf.shape != (k, r, t, PAD_TO) or buf.dtype != bt:
            buf = self._w16_pad_buf = backend.gpu_module().zeros((k, r, t, PAD_TO), dtype=bt)
        to_reduced(w.transpose(0, 2, 3, 1), buf[..., :c], self._storage)
        return buf

    @staticmethod
    def _find(key, d, x, w, y, dw, ws, lim, tc, kinds=("fwd", "bwd_data", "bwd_filter"),
              retime=False):
        """Find's lists per direction; ``retime``: their leads timed again (``_retimed``)."""
        args = {"fwd": (d[0].ptr, _ptr(x), d[1].ptr, _ptr(w), d[2].ptr, d[3].ptr, _ptr(y)),
                "bwd_data": (d[1].ptr, _ptr(w), d[3].ptr, _ptr(y), d[2].ptr, d[0].ptr, _ptr(x)),
                "bwd_filter": (d[0].ptr, _ptr(x), d[3].ptr, _ptr(y), d[2].ptr, d[1].ptr,
                               _ptr(dw))}
        found = {k: cudnn.find_algorithms(k, key, args[k], ws, lim, tc) for k in kinds}
        if retime:
            found = {k: _retimed(k, key, c, args[k], d[0].dtype, ws)
                     for k, c in found.items()}
        return found


    # -- few input channels: kernels/conv16.py's direct kernels (channels-last) ----------
    def _direct_shape(self, xshape):
        return self.num_spatial == 2 and \
            conv16.applies(xshape, self.num_output, self.kernel, self.group)

    def _geom(self, xshape):
        k, c, r, s = self.blobs[0].shape
        return tuple(xshape) + (k, r, s, tuple(self.stride), tuple(self.pad),
                                tuple(self.dilation))

    def _add_direct(self, cands, xshape):
        """Add conv16's filter gradient (algorithm DIRECT, no workspace) to the
        channels-last filter-gradient candidates, with its device time (``_timed``, once
        per shape and process); MINICAFFE_CONV_DIRECT=1 makes it the only candidate, 0
        leaves it out.  (LeNet b64 bf16's conv1 on an H100: cuDNN padded its one input
        channel at every call and took 53 us for the filter gradient.)"""
        force = config.env("MINICAFFE_CONV_DIRECT")
        if force is False:
            return
        cp = backend.gpu_module()
        g = self._geom(xshape)
        if not conv16.fits(g):
            return
        n, c, h, w = xshape
        k = self.num_output
        p, q = conv16.output_hw(g)
        bt = buffer_dtype(self._storage)
        x = cp.zeros(n * h * w * c, dtype=bt)
        y = cp.zeros(n * p * q * k, dtype=bt)
        wf = cp.zeros(self.blobs[0].count(), dtype=np.float32)
        bf = cp.zeros(k, dtype=np.float32)
        part = cp.empty(conv16.partial_size(g), dtype=np.float32)
        ck = (context.device_id(), g, str(self._storage))
        if not force and ck not in _DIRECT_TIMES:
            _DIRECT_TIMES[ck] = _timed(
                lambda: conv16.backward_filter(x, y, wf, bf, self._storage, g, part))
        t = 0.0 if force else _DIRECT_TIMES[ck]
        c = cands["bwd_filter"]
        if not force:
            log.info("layer '%s': channels-last filter gradient: cuDNN's fastest %.4f ms "
                     "(algorithm %d), the direct kernels %.4f ms", self.layer_param.name,
                     c[0][2], c[0][0], t)
        cands["bwd_filter"] = [(DIRECT, 0, t)] if force else \
            sorted(c + [(DIRECT, 0, t)], key=lambda a: a[2])

    def _direct_partial(self, geom):
        """The filter gradient's per-chunk sums (conv16.partial_size), kept per layer."""
        n = conv16.partial_size(geom)
        buf = getattr(self, "_direct_buf", None)
        if buf is None or buf.size < n:
            buf = self._direct_buf = backend.gpu_module().empty(n, dtype=np.float32)
        return buf

    # -- 1x1 convolutions as GEMMs (channels-last): Y[NHW, K] = X[NHW, C] W^T --------------
    def _gemm_shape(self):
        """A stride-1, unpadded, undilated, ungrouped 1x1 convolution over 2-D maps: in
        channels-last it is exactly one GEMM per direction."""
        return self.num_spatial == 2 and self.group == 1 and \
            all(int(v) == 1 for v in tuple(self.kernel) + tuple(self.stride) +
                tuple(self.dilation)) and all(int(v) == 0 for v in self.pad)

    def _add_gemm(self, cands, xshape, yshape, x, w, y):
        """Add cuBLAS's GEMM (algorithm GEMM, no workspace) to the NHWC candidates of each
        direction with its time on these buffers, as Find times cuDNN's (median of 5 after
        a warm-up); MINICAFFE_CONV_GEMM=1 makes it the only candidate, 0 leaves it out."""
        force = config.env("MINICAFFE_CONV_GEMM")
        if force is False:
            return
        from ..gpu import cublas
        n, c = xshape[0], xshape[1]
        k = yshape[1]
        m = n * xshape[2] * xshape[3]
        x2, y2, w2 = x.reshape(m, c), y.reshape(m, k), w.reshape(k, c)
        dw = backend.gpu_module().zeros((k, c), dtype=np.float32)
        calls = {"fwd": lambda: cublas.matmul_ex(x2, w2, y2, trans_b=True),
                 "bwd_data": lambda: cublas.matmul_ex(y2, w2, x2),
                 "bwd_filter": lambda: cublas.matmul_ex(y2, x2, dw, trans_a=True, beta=1.0)}
        for kind, fn in calls.items():
            ck = (context.device_id(), kind, xshape, yshape, str(self._storage))
            if not force and ck not in _GEMM_TIMES:     # timed once per shape and process,
                _GEMM_TIMES[ck] = _timed(fn)           # as Find's choices are cached
            t = 0.0 if force else _GEMM_TIMES[ck]
            cands[kind] = ([(GEMM, 0, t)] if force else
                           sorted(cands[kind] + [(GEMM, 0, t)], key=lambda a: a[2]))

    def use_workspace(self, cap, backward_cap=None):
        """Take, for each of the three calls, the fastest algorithm within ``cap`` bytes of
        workspace (``share_workspace`` sets one cap for a whole net); ``backward_cap``:
        another cap for the two backward calls (offload.fit_workspace, per step).  The
        channels-last set, when there is one, picks within the same caps."""
        bcap = cap if backward_cap is None else backward_cap
        sets = [(self, self._nchw_candidates, (self.x_desc, self.w_desc, self.y_desc))]
        n = getattr(self, "_nhwc", None)
        if n is not None:
            sets.append((n, n.candidates, (n.x_desc, n.w_desc, n.y_desc)))
        self.workspace_bytes = 0
        for a, c, (x, w, y) in sets:
            descs = {"fwd": (x, w, self.conv_desc, y), "bwd_data": (w, y, self.conv_desc, x),
                     "bwd_filter": (x, y, self.conv_desc, w)}
            p = a.pad8 if a is not self else None
            if p is not None:
                padded = {"fwd": (p.x_desc, p.w_desc, self.conv_desc, y),
                          "bwd_filter": (p.x_desc, y, self.conv_desc, p.w_desc)}
            for kind, attr, k_cap in (("fwd", "fwd", cap), ("bwd_data", "bwd_data", bcap),
                                      ("bwd_filter", "bwd_filter", bcap)):
                algo, mem, t = cudnn.pick(c[kind], k_cap)
                if algo not in (GEMM, DIRECT):   # what the call will check (Find's
                    # figure can be less)
                    d = padded[kind] if algo >= PADDED else descs[kind]
                    mem = max(mem, cudnn.workspace_size(kind, [e.ptr for e in d],
                                                        algo % PADDED))
                setattr(a, attr, (algo, mem, t))
                self.workspace_bytes = max(self.workspace_bytes, mem)

    def workspace_need(self, direction, algos=None):
        """Bytes of workspace this layer's ``direction`` ("forward"/"backward") takes with
        the algorithms chosen (0 where this shape runs Caffe's engine): the memory plan
        gives each its own place, live only at that step (engine/plan.py)."""
        if getattr(self, "_cudnn_key", None) is None or not hasattr(self, "fwd"):
            return 0
        a = algos or getattr(self, "_nhwc", None) or self    # the engine's layout's
        if direction == "forward":
            return int(a.fwd[1])
        return int(max(a.bwd_data[1], a.bwd_filter[1]))

    def _workspace(self, direction, algos=None):
        """(pointer, bytes) of the workspace for ``direction``: the place the memory plan
        gave it (``planned_workspace``, set by MemoryPlan.apply) when it is there and
        large enough, else this thread's shared workspace (a net run outside the GPU step:
        a test net, pycaffe)."""
        need = self.workspace_need(direction, algos)
        if need == 0:
            return None, 0
        view = (getattr(self, "planned_workspace", None) or {}).get(direction)
        if view is not None and view.nbytes >= need:
            return view.data.ptr, int(view.nbytes)
        ws = workspace(max(self.workspace_bytes, need))
        return (ws.data.ptr, ws.nbytes) if ws is not None else (None, 0)

    # -- reduced precision (issue 20): cuDNN in float16/bfloat16, the blobs fp32 ----------
    def _reduced_storage(self, dt):
        """FLOAT16 or BFLOAT16 when this layer's types (core/precision.py, set by its Net)
        store its data and diffs in that type: its cuDNN calls then run in it, on casts of
        the fp32 blobs (whose values are the reduced type's) into scratch buffers."""
        t = self.types
        if t is None or np.dtype(dt) != np.float32 or t.forward_type != t.backward_type or \
                t.forward_type not in (precision.FLOAT16, precision.BFLOAT16):
            return None
        return t.forward_type

    def _reduced(self, name, shape):
        """A scratch buffer of ``shape`` in this layer's reduced type."""
        bt = np.dtype(buffer_dtype(self._storage))
        n = int(np.prod(shape))
        return scratch(name, n * bt.itemsize)[:n * bt.itemsize].view(bt).reshape(shape)

    def _cast_in(self, name, a):
        return to_reduced(a, self._reduced(name, a.shape), self._storage)

    def _in16(self, name, blob, diff=False):
        """``blob``'s data (diff) in this layer's reduced type: the blob's own 2-byte
        buffer (real 16-bit storage), else a cast of its fp32 one into scratch."""
        a = blob.gpu_diff() if diff else blob.gpu_data()
        return a if r16.storage(blob, diff) == self._storage else self._cast_in(name, a)

    @property
    def reduced_body(self):
        """True when this layer runs cuDNN in its reduced type: it reads and writes 2-byte
        buffers of that type (engine/precision.py), and fp32 ones through casts."""
        return getattr(self, "_cudnn_key", None) is not None and \
            getattr(self, "_storage", None) is not None

    @property
    def nhwc_body(self):
        """True when this layer's reduced body takes channels-last buffers (cuDNN found
        channels-last algorithms for its shape: engine/precision.py)."""
        return getattr(self, "_nhwc", None) is not None

    def _algos(self, bottom, top):
        """The descriptors and algorithms for the layout the buffers are held in now:
        channels-last (``_nhwc``) when the engine holds them so, else NCHW (self)."""
        n = getattr(self, "_nhwc", None)
        if n is not None and (r16.layout(bottom[0]) is not None or
                              r16.layout(top[0]) is not None):
            return n
        return self

    def _w16(self, a):
        """The fp32 master weights in this layer's reduced type, K, R, S, C for a
        channels-last set (``a`` is ``_nhwc``), else K, C, R, S: cast at the forward and
        kept for the backward of the same step (the weights change only at the update)."""
        w = self.blobs[0].gpu_data()
        if a is self:
            return self._cast_in("w16", w)
        buf = self._kept_w16(w.size)
        if self._step_cast == self._storage and \
                CAST_WEIGHTS in (getattr(self, "planned_workspace", None) or {}):
            pass                        # cast by the step's one launch (engine/step.py)
        elif w.ndim == 4 and w.shape[2] * w.shape[3] > 1:     # 1 x 1: KCRS is KRSC
            k, c, r, t = w.shape
            to_reduced_t(w.reshape(k, c, r * t), buf.reshape(k, r * t, c), self._storage)
        else:
            to_reduced(w, buf.reshape(w.shape), self._storage)
        self._w16_at = (buf.data.ptr, buf.size)     # where the backward finds this cast
        return buf

    def reduced_weights(self, storage, nhwc):
        """(bytes, kept) of the weights this layer's 2-byte body casts to ``storage``'s
        type where its maps are held so (``nhwc``: channels-last): the channels-last set's
        K, R, S, C copy, cast at the forward and kept for the backward of the same step
        (the memory plan places it in its arena: engine/plan.py); (0, False) otherwise
        (the NCHW set casts into a shared scratch at each call)."""
        if not nhwc or not self.reduced_body or not self.nhwc_body or \
                storage != self._storage:
            return 0, False
        return self.blobs[0].count() * np.dtype(buffer_dtype(storage)).itemsize, True

    def _planned_copy(self):
        """The memory plan's place of the channels-last weight copy: kept from the
        forward to the backward, or cast by the step's one launch (engine/plan.py)."""
        places = getattr(self, "planned_workspace", None) or {}
        return places.get(CAST_WEIGHTS, places.get("weights"))

    def weight_copy_dims(self):
        """(k, c, rs): the copy ``reduced_weights`` counts is K, R*S, C of the K, C, R, S
        weights (kernels/wcast.py casts it so)."""
        k, c = self.blobs[0].shape[:2]
        return k, c, self.blobs[0].count() // (k * c)

    def _kept_w16(self, n):
        """The buffer of the channels-last weight copy (``n`` elements): the memory
        plan's place for it (``planned_workspace["weights"]``, live from this layer's
        forward to its backward) when there is one, else a buffer of the layer's own."""
        bt = np.dtype(buffer_dtype(self._storage))
        view = self._planned_copy()
        if view is not None and view.nbytes >= n * bt.itemsize:
            return view[:n * bt.itemsize].view(bt)
        buf = getattr(self, "_w16_buf", None)
        if buf is None or buf.size != n or buf.dtype != bt:
            buf = self._w16_buf = backend.gpu_module().empty(n, dtype=bt)
        return buf

    def _forward_reduced(self, bottom, top, relu):
        h = cudnn.handle()
        dt = np.float32
        a = self._algos(bottom, top)
        wsp, wsn = self._workspace("forward", a)
        w16 = self._w16(a)
        bias = self.blobs[1].gpu_data() if self.bias_term else None
        nhwc = a is not self
        for b, t in zip(bottom, top):
            x16 = self._in16("x16", b)
            y = t.mutable_gpu_data()
            direct = r16.storage(t) == self._storage
            y16 = y if direct else self._reduced("y16", y.shape)
            if a.fwd[0] == GEMM:
                k, c = self.blobs[0].shape[:2]
                cublas_gemm(x16.reshape(-1, c), w16.reshape(k, c), y16.reshape(-1, k),
                            trans_b=True)
            else:
                xa, xd, wa, wd, algo = x16, a.x_desc, w16, a.w_desc, a.fwd[0]
                if algo >= PADDED:      # on the input padded to PAD_TO channels
                    xa, xd, wa, wd = self._pad_x(x16), a.pad8.x_desc, self._w16_padded(), \
                        a.pad8.w_desc
                    algo -= PADDED
                cudnn.call("cudnnConvolutionForward", h, cudnn.one(dt), xd.ptr, _ptr(xa),
                           wd.ptr, _ptr(wa), self.conv_desc.ptr, algo, wsp, wsn,
                           cudnn.zero(dt), a.y_desc.ptr, _ptr(y16))
            if direct:
                r16.bias_act(y, self._storage, bias=bias, relu=relu, nhwc=nhwc)
            else:
                from_reduced(y16, y, self._storage, bias=bias, relu=relu, rounded=True)
        return True

    @property
    def rounds_outputs(self):
        """True when this layer's reduced-type body already rounds its top data and its
        bottom diffs to the storage type (the Net's rounding hooks skip them)."""
        return getattr(self, "_cudnn_key", None) is not None and \
            getattr(self, "_storage", None) is not None

    def _backward_reduced(self, top, propagate_down, bottom):
        h = cudnn.handle()
        dt = np.float32
        a = self._algos(bottom, top)
        wsp, wsn = self._workspace("backward", a)
        nhwc = a is not self
        w16 = self._kept_w16(self.blobs[0].count()) if nhwc else None
        if w16 is None or getattr(self, "_w16_at", None) != (w16.data.ptr, w16.size):
            w16 = self._w16(a)          # (else: cast there by this step's forward)
        k, c = self.blobs[0].shape[:2]
        # the direct filter gradient sums the bias gradient too
        fused_bias = a.bwd_filter[0] == DIRECT and self.get_param_propagate_down(0)
        for i, (b, t) in enumerate(zip(bottom, top)):
            dy = t.gpu_diff()
            native_dy = r16.storage(t, diff=True) == self._storage
            dy16 = dy if native_dy else self._cast_in("y16", dy)
            if self.bias_term and self.get_param_propagate_down(1) and not fused_bias:
                if nhwc:      # the column sums of dY[NHW, K]: a GEMM with a ones row
                    cublas_gemm(self._ones16(dy.size // k), dy.reshape(-1, k),
                                self.blobs[1].mutable_gpu_diff().reshape(1, k), beta=1.0)
                elif native_dy:
                    r16.channel_sum(dy, self.blobs[1].mutable_gpu_diff(), self._partial(dy),
                                    self._storage)
                else:
                    channel_sum(dy, self.blobs[1].mutable_gpu_diff(), self._partial(dy))
            if self.get_param_propagate_down(0):
                x16 = self._in16("x16", b)
                dwm = self.blobs[0].mutable_gpu_diff()
                if a.bwd_filter[0] == DIRECT:   # dW += ..., db += ... in fp32
                    g = self._geom(b.shape)
                    db = self.blobs[1].mutable_gpu_diff() if self.bias_term and \
                        self.get_param_propagate_down(1) else None
                    conv16.backward_filter(x16, dy16, dwm, db, self._storage, g,
                                           self._direct_partial(g))
                elif a.bwd_filter[0] == GEMM:   # dW += dY^T X, into the fp32 diff
                    cublas_gemm(dy16.reshape(-1, k), x16.reshape(-1, c), dwm.reshape(k, c),
                                trans_a=True, beta=1.0)
                else:
                    algo, xa, xd, wd, shape = a.bwd_filter[0], x16, a.x_desc, a.w_desc, dwm.shape
                    if algo >= PADDED:          # on the input padded to PAD_TO channels
                        algo -= PADDED
                        xa, xd, wd = self._pad_x(x16), a.pad8.x_desc, a.pad8.w_desc
                        shape = (dwm.shape[0], PAD_TO) + dwm.shape[2:]
                    dw16 = self._reduced("dw16", shape)
                    cudnn.call("cudnnConvolutionBackwardFilter", h, cudnn.one(dt),
                               xd.ptr, _ptr(xa), a.y_desc.ptr, _ptr(dy16),
                               self.conv_desc.ptr, algo, wsp, wsn, cudnn.zero(dt),
                               wd.ptr, _ptr(dw16))
                    kk, cc = dwm.shape[:2]
                    rs = dwm.size // max(kk * cc, 1)
                    if shape[1] != cc:   # padded: K, R, S, PAD_TO -> K, C, R, S (a view)
                        r, q = dwm.shape[2:]
                        from_reduced(dw16.reshape(kk, r, q, shape[1])[..., :cc]
                                     .transpose(0, 3, 1, 2), dwm, self._storage,
                                     accumulate=True)
                    elif nhwc and dwm.ndim == 4 and rs > 1:  # K, R, S, C -> K, C, R, S
                        from_reduced_t(dw16.reshape(kk, rs, cc), dwm.reshape(kk, cc, rs),
                                       self._storage, accumulate=True)
                    else:
                        from_reduced(dw16, dwm, self._storage, accumulate=True)
            if propagate_down[i]:
                dx = b.mutable_gpu_diff()
                direct = r16.storage(b, diff=True) == self._storage
                dx16 = dx if direct else self._reduced("x16", dx.shape)
                if a.bwd_data[0] == GEMM:       # dX = dY W
                    cublas_gemm(dy16.reshape(-1, k), w16.reshape(k, c), dx16.reshape(-1, c))
                else:
                    cudnn.call("cudnnConvolutionBackwardData", h, cudnn.one(dt), a.w_desc.ptr,
                               _ptr(w16), a.y_desc.ptr, _ptr(dy16), self.conv_desc.ptr,
                               a.bwd_data[0], wsp, wsn, cudnn.zero(dt), a.x_desc.ptr,
                               _ptr(dx16))
                if not direct:
                    from_reduced(dx16, dx, self._storage)

    def _ones16(self, m):
        """A row of ``m`` ones in this layer's reduced type (1, m): the bias gradient's
        GEMM."""
        key = ("ones16", self._storage, m)
        handles = context.get().handles
        o = handles.get(key)
        if o is None:
            cp = backend.gpu_module()
            o = handles[key] = to_reduced(cp.ones(m, dtype=np.float32),
                                          cp.empty(m, dtype=buffer_dtype(self._storage)),
                                          self._storage).reshape(1, m)
        return o

    def forward_gpu_relu(self, bottom, top):
        """The fused type Convolution+ReLU (layers/fused.py): y = max(W * x + b, 0) by one
        cudnnConvolutionBiasActivationForward.  False, with nothing done, where this shape
        does not run through cuDNN (or there is no bias, or several bottoms)."""
        if self._cudnn_key is None or not self.bias_term or len(bottom) != 1:
            return False
        if self._storage is not None:
            return self._forward_reduced(bottom, top, relu=True)
        h = cudnn.handle()
        dt = bottom[0].dtype
        wsp, wsn = self._workspace("forward")
        w = self.blobs[0].gpu_data()
        if getattr(self, "_act", None) is None:
            self._act = cudnn.ActDesc(cudnn.ACT_RELU)
        y = top[0].mutable_gpu_data()
        cudnn.call("cudnnConvolutionBiasActivationForward", h, cudnn.one(dt),
                   self.x_desc.ptr, _ptr(bottom[0].gpu_data()), self.w_desc.ptr, _ptr(w),
                   self.conv_desc.ptr, self.fwd[0], wsp, wsn, cudnn.zero(dt),
                   self.y_desc.ptr, _ptr(y), self.b_desc.ptr,
                   _ptr(self.blobs[1].gpu_data()), self._act.ptr, self.y_desc.ptr, _ptr(y))
        return True

    def forward_gpu(self, bottom, top):
        if self._cudnn_key is None:
            return super().forward_gpu(bottom, top)
        if self._storage is not None:
            self._forward_reduced(bottom, top, relu=False)
            return
        h = cudnn.handle()
        dt = bottom[0].dtype
        wsp, wsn = self._workspace("forward")
        w = self.blobs[0].gpu_data()
        for b, t in zip(bottom, top):
            y = t.mutable_gpu_data()
            cudnn.call("cudnnConvolutionForward", h, cudnn.one(dt), self.x_desc.ptr,
                       _ptr(b.gpu_data()), self.w_desc.ptr, _ptr(w), self.conv_desc.ptr,
                       self.fwd[0], wsp, wsn, cudnn.zero(dt), self.y_desc.ptr, _ptr(y))
            if self.bias_term:
                cudnn.call("cudnnAddTensor", h, cudnn.one(dt), self.b_desc.ptr,
                           _ptr(self.blobs[1].gpu_data()), cudnn.one(dt), self.y_desc.ptr, _ptr(y))

    def _partial(self, dy):
        n = partial_size(dy.shape[0], dy.shape[1])
        p = getattr(self, "_partial_buf", None)
        if p is None or p.size < n:
            p = self._partial_buf = backend.gpu_module().empty(n, dtype=np.float64)
        return p

    def backward_gpu(self, top, propagate_down, bottom):
        if self._cudnn_key is None:
            return super().backward_gpu(top, propagate_down, bottom)
        if self._storage is not None:
            return self._backward_reduced(top, propagate_down, bottom)
        h = cudnn.handle()
        dt = top[0].dtype
        wsp, wsn = self._workspace("backward")
        w = self.blobs[0].gpu_data()
        for i, (b, t) in enumerate(zip(bottom, top)):
            dy = t.gpu_diff()
            if self.bias_term and self.get_param_propagate_down(1):
                # our own deterministic reduction: cuDNN's BackwardBias was several times
                # slower on small maps (kernels/reduce.py)
                channel_sum(dy, self.blobs[1].mutable_gpu_diff(), self._partial(dy))
            if self.get_param_propagate_down(0):
                cudnn.call("cudnnConvolutionBackwardFilter", h, cudnn.one(dt), self.x_desc.ptr,
                           _ptr(b.gpu_data()), self.y_desc.ptr, _ptr(dy), self.conv_desc.ptr,
                           self.bwd_filter[0], wsp, wsn, cudnn.one(dt), self.w_desc.ptr,
                           _ptr(self.blobs[0].mutable_gpu_diff()))
            if propagate_down[i]:
                cudnn.call("cudnnConvolutionBackwardData", h, cudnn.one(dt), self.w_desc.ptr,
                           _ptr(w), self.y_desc.ptr, _ptr(dy), self.conv_desc.ptr,
                           self.bwd_data[0], wsp, wsn, cudnn.zero(dt), self.x_desc.ptr,
                           _ptr(b.mutable_gpu_diff()))


_Pool = caffe_pb2.PoolingParameter


def _storage16(param):
    """FLOAT16 or BFLOAT16 when the types in LayerParameter ``param`` (written there by a
    Net that resolved reduced precision) store its data and diffs in that one 2-byte
    type, else None."""
    if not param.HasField("forward_type"):
        return None
    name = caffe_pb2.Type.Name
    ft = name(param.forward_type)
    bt = name(param.backward_type) if param.HasField("backward_type") else ft
    return ft if ft == bt and ft in (precision.FLOAT16, precision.BFLOAT16) else None


# what ``last_body`` says for each of our 2-byte bodies (kernels/pool16.py)
_BODY16 = {"max": "mc_nhwc16", "argmax": "mc_nhwc16_argmax", "ave": "mc_nhwc16_ave"}


@register_cudnn("Pooling")
class CuDNNPoolingLayer(_ChosenOnce, PoolingLayer):
    """MAX and AVE pooling through cuDNN where cuDNN's output shape and windows are
    Caffe's (no ceil-mode window past the padded input, one top); Caffe's kernels
    otherwise.  MAX's backward reads the top data, so a MAX pooling whose top a later
    layer rewrites in place takes Caffe's mask-based body (``cudnn_reads_top``;
    ``top_rewritten``).

    A layer whose types store its maps in one 2-byte type (bf16, fp16), in a run that
    holds such maps channels-last in the GPU step's plan (``RunConfig.nhwc``, not
    offloaded), runs our own kernels instead, whatever cuDNN would say of its shape or
    wiring (kernels/pool16.py; ``last_body`` says which ran): MAX over disjoint windows
    (stride >= kernel: VGG's 2x2/2) a gather backward that recomputes each window's argmax
    from x (cuDNN's took 6.5 ms of VGG-16 b64's bf16 step: docs/precision.md; the same
    bits, ties included), MAX over overlapping windows (ResNet's and CIFAR's 3x3/2, kh*kw
    <= 255) one argmax byte per output element and channel (the layer's state in the
    memory plan: ``state_bytes``) and a gather of dy that reads no top, AVE Caffe's
    formula; no fp32 copy, no cast op around them.  Maps the op holds NCHW in 2 bytes are
    pooled by the same kernels (N*C images of one channel); fp32 buffers (a net run
    outside the GPU step's plan, an op the plan casts to fp32) by Caffe's kernels, which
    read what these declare (``retain_inputs``/``retain_outputs``)."""

    @classmethod
    def cudnn_refuses(cls, param):
        if param.pooling_param.pool not in (_Pool.MAX, _Pool.AVE):
            return "STOCHASTIC pooling"
        if len(param.top) > 1:
            return "a second top (the mask)"
        return None

    @classmethod
    def cudnn_reads_top(cls, param):
        # a 2-byte MAX pooling may run our kernels, which read no top: it is built with
        # this class whatever its wiring, and refuses cuDNN at its reshape when its top
        # is rewritten (``top_rewritten``) and our kernels do not pool it
        return param.pooling_param.pool == _Pool.MAX and _storage16(param) is None

    _body16 = None      # our 2-byte body for the last reshape's blobs (``_own_body``)

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        self._body16 = self._own_body(bottom, top)
        self._use = False if self._body16 else self._cudnn_for(bottom, top)

    def _own_body(self, bottom, top):
        """"max" (disjoint windows), "argmax" (overlapping) or "ave" when our kernels pool
        this layer (see the class docstring), else None."""
        if not context.is_gpu() or len(top) != 1 or bottom[0].dtype != np.float32 or \
                _storage16(self.layer_param) is None or not self.config.nhwc or \
                self.config.offloads:
            return None
        if self.method == _Pool.AVE:
            return "ave"
        if self.method != _Pool.MAX:
            return None
        if pool16.disjoint(self.kernel, self.stride):
            return "max"
        return "argmax" if self.kernel[0] * self.kernel[1] <= pool16.MAX_ARGMAX_WINDOW \
            else None

    def shape_refuses(self, bottom, top):
        if len(top) != 1:
            return "a second top (the mask)"
        if self.top_rewritten and self.method == _Pool.MAX:
            return "a later layer rewrites its top in place, and cuDNN's backward reads it"
        key = (bottom[0].shape, tuple(self.kernel), tuple(self.pad), tuple(self.stride),
               self.method, options.deterministic)
        if getattr(self, "_desc_key", None) != key:
            dt = bottom[0].dtype
            mode = (cudnn.POOL_AVE_INCLUDE_PAD if self.method == _Pool.AVE else
                    cudnn.POOL_MAX_DETERMINISTIC if options.deterministic else cudnn.POOL_MAX)
            self.pool_desc = cudnn.PoolDesc(mode, self.kernel, self.pad, self.stride)
            self.x_desc = cudnn.TensorDesc(bottom[0].shape, dt)
            self.y_desc = cudnn.TensorDesc(top[0].shape, dt)
            try:    # cuDNN refuses a window larger than the padded input (BAD_PARAM)
                dims = self.pool_desc.output_dims(self.x_desc)
            except cudnn.CudnnError:
                dims = None
            self._ok = dims == tuple(top[0].shape)
            self._why = None if self._ok else (
                f"input {tuple(bottom[0].shape)}: Caffe's output {tuple(top[0].shape)}, "
                + ("a window cuDNN refuses" if dims is None else f"cuDNN's {tuple(dims)}"))
            self._desc_key = key
        return self._why

    # cuDNN's backward reads x and y; our disjoint MAX x; our argmax MAX and AVE, and
    # Caffe's MAX and AVE, neither (a mask of their own)
    @property
    def retain_inputs(self):
        b = getattr(self, "_body16", None)
        if b is not None:
            return (0,) if b == "max" else ()
        return (0,) if getattr(self, "_use", False) else super().retain_inputs

    @property
    def retain_outputs(self):
        if getattr(self, "_body16", None) is not None:
            return ()
        return (0,) if getattr(self, "_use", False) else super().retain_outputs

    def state_bytes(self, bottom, top):
        b = getattr(self, "_body16", None)
        if b is not None:      # the argmax bytes (our other bodies keep nothing)
            return pool16.argmax_bytes(bottom[0].shape, top[0].shape[2:]) if b == "argmax" \
                else 0
        return 0 if getattr(self, "_use", False) else super().state_bytes(bottom, top)

    @property
    def reduced_body(self):
        """cuDNN and our kernels (kernels/pool16.py) pool 2-byte buffers (bfloat16,
        float16) too (engine/precision.py)."""
        return getattr(self, "_body16", None) is not None or bool(getattr(self, "_use", False))

    def _descs(self, blob, top):
        """(x, y) descriptors for the type ``blob``'s buffers are held in now, and their
        layout (channels-last where the engine holds the maps so)."""
        s = r16.storage(blob)
        if s is None:
            return self.x_desc, self.y_desc, blob.dtype
        nhwc = r16.layout(blob) is not None or r16.layout(top) is not None
        key = (s, nhwc, self._desc_key)
        if getattr(self, "_descs16", (None,))[0] != key:
            dt = cudnn.storage_dtype(s)
            self._descs16 = (key, cudnn.TensorDesc(self.x_desc.shape, dt, nhwc=nhwc),
                             cudnn.TensorDesc(self.y_desc.shape, dt, nhwc=nhwc), dt)
        return self._descs16[1:]

    def _held16(self, bufs):
        """(storage, nchw) of ``bufs`` [(blob, diff)] when they are held in this layer's
        2-byte type (``nchw``: the maps of more than one pixel NCHW, else channels-last);
        None when they are all fp32 (Caffe's body pools them)."""
        kinds = {r16.storage(b, d) for b, d in bufs}
        if kinds == {None}:
            return None
        s = _storage16(self.layer_param)
        lay = {r16.layout(b, d) is None for b, d in bufs if b.count(2) > 1}
        if kinds != {s} or len(lay) > 1:
            raise self.error(f"buffers held in {sorted(map(str, kinds))}, "
                             f"{'mixed layouts' if len(lay) > 1 else 'one layout'}: "
                             f"the {s} pooling takes one 2-byte type in one layout")
        return s, lay == {True}

    def _geo16(self, bottom, top):
        return (tuple(bottom[0].shape), self.kernel, self.stride, self.pad, top[0].shape[2:])

    def _argmax(self, shape, out_hw):
        """The argmax bytes (the layer's state): one buffer for the layer's life at a
        fixed address, made at the first (eager) forward of a shape."""
        n = pool16.argmax_bytes(shape, out_hw)
        m = getattr(self, "_argmax_buf", None)
        if m is None or m.size != n:
            m = self._argmax_buf = backend.gpu_module().empty(n, dtype=np.uint8)
        return m

    @property
    def last_body(self):
        """Which body pooled this layer's last forward or backward on a GPU: ours
        (kernels/pool16.py) "mc_nhwc16" (MAX, disjoint windows), "mc_nhwc16_argmax" (MAX,
        overlapping) or "mc_nhwc16_ave"; "cudnn" or "caffe" (None before any)."""
        return getattr(self, "_last_body", None)

    def forward_gpu(self, bottom, top):
        b = self._body16
        held = self._held16([(bottom[0], False), (top[0], False)]) if b else None
        if held is not None:
            s, nchw = held
            shape, k, st, pad, hw = self._geo16(bottom, top)
            x, y = bottom[0].gpu_data(), top[0].mutable_gpu_data()
            if b == "max":
                pool16.max_pool_forward(x, y, shape, k, st, pad, s, out_hw=hw, nchw=nchw)
            elif b == "argmax":
                pool16.max_pool_forward_argmax(x, y, self._argmax(shape, hw), shape, k, st,
                                               pad, s, out_hw=hw, nchw=nchw)
            else:
                pool16.ave_pool_forward(x, y, shape, k, st, pad, s, out_hw=hw, nchw=nchw)
            self._last_body = _BODY16[b]
            return
        if not self._use:
            self._last_body = "caffe"
            return super().forward_gpu(bottom, top)
        self._last_body = "cudnn"
        xd, yd, dt = self._descs(bottom[0], top[0])
        cudnn.call("cudnnPoolingForward", cudnn.handle(), self.pool_desc.ptr, cudnn.one(dt),
                   xd.ptr, _ptr(bottom[0].gpu_data()), cudnn.zero(dt), yd.ptr,
                   _ptr(top[0].mutable_gpu_data()))

    def backward_gpu(self, top, propagate_down, bottom):
        b = self._body16
        if b and not propagate_down[0]:
            return
        bufs = [(bottom[0], True), (top[0], True)] + ([(bottom[0], False)] if b == "max"
                                                       else [])
        held = self._held16(bufs) if b else None
        if held is not None:
            s, nchw = held
            shape, k, st, pad, hw = self._geo16(bottom, top)
            dy, dx = top[0].gpu_diff(), bottom[0].mutable_gpu_diff()
            if b == "max":
                pool16.max_pool_backward(bottom[0].gpu_data(), dy, dx, shape, k, st, pad, s,
                                         out_hw=hw, nchw=nchw)
            elif b == "argmax":
                m = getattr(self, "_argmax_buf", None)
                if m is None or m.size != pool16.argmax_bytes(shape, hw):
                    raise self.error("MAX pooling backward needs its forward first")
                pool16.max_pool_backward_argmax(dy, m, dx, shape, k, st, pad, s, out_hw=hw,
                                                nchw=nchw)
            else:
                pool16.ave_pool_backward(dy, dx, shape, k, st, pad, s, out_hw=hw, nchw=nchw)
            self._last_body = _BODY16[b]
            return
        if not self._use:
            self._last_body = "caffe"
            return super().backward_gpu(top, propagate_down, bottom)
        if not propagate_down[0]:
            return
        self._last_body = "cudnn"
        xd, yd, dt = self._descs(bottom[0], top[0])
        cudnn.call("cudnnPoolingBackward", cudnn.handle(), self.pool_desc.ptr, cudnn.one(dt),
                   yd.ptr, _ptr(top[0].gpu_data()), yd.ptr,
                   _ptr(top[0].gpu_diff()), xd.ptr, _ptr(bottom[0].gpu_data()),
                   cudnn.zero(dt), xd.ptr, _ptr(bottom[0].mutable_gpu_diff()))


_LRN = caffe_pb2.LRNParameter


@register_cudnn("LRN")
class CuDNNLRNLayer(_ChosenOnce, LRNLayer):
    """ACROSS_CHANNELS LRN through cuDNN (window 1-16, k >= 1e-5, beta >= 0.01: Caffe's
    formula, alpha divided by the window); Caffe's kernels otherwise.  Backward reads x
    and y: a top rewritten in place later keeps Caffe's body."""

    @classmethod
    def cudnn_refuses(cls, param):
        p = param.lrn_param
        if p.norm_region != _LRN.ACROSS_CHANNELS:
            return "WITHIN_CHANNEL"
        if not 1 <= p.local_size <= 16:
            return f"local_size {p.local_size} outside 1-16"
        if p.k < 1e-5 or p.beta < 0.01:
            return f"k {p.k:g} < 1e-5 or beta {p.beta:g} < 0.01"
        if param.bottom and param.top and param.bottom[0] == param.top[0]:
            return "in place"
        return None

    @classmethod
    def cudnn_reads_top(cls, param):
        return True

    def shape_refuses(self, bottom, top):
        if bottom[0] is top[0]:
            return "in place"
        if bottom[0].num_axes != 4:
            return f"an input of {bottom[0].num_axes} axes"
        return None

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        p = self.layer_param.lrn_param
        self._use = self._cudnn_for(bottom, top)
        if self._use and getattr(self, "_desc_key", None) != bottom[0].shape:
            self.lrn_desc = cudnn.LRNDesc(p.local_size, p.alpha, p.beta, p.k)
            self.x_desc = cudnn.TensorDesc(bottom[0].shape, bottom[0].dtype)
            self._desc_key = bottom[0].shape

    def state_bytes(self, bottom, top):
        return 0 if getattr(self, "_use", False) else super().state_bytes(bottom, top)

    def forward_gpu(self, bottom, top):
        if not self._use:
            return super().forward_gpu(bottom, top)
        dt = bottom[0].dtype
        cudnn.call("cudnnLRNCrossChannelForward", cudnn.handle(), self.lrn_desc.ptr,
                   cudnn.LRN_CROSS_CHANNEL, cudnn.one(dt), self.x_desc.ptr,
                   _ptr(bottom[0].gpu_data()), cudnn.zero(dt), self.x_desc.ptr,
                   _ptr(top[0].mutable_gpu_data()))

    def backward_gpu(self, top, propagate_down, bottom):
        if not self._use:
            return super().backward_gpu(top, propagate_down, bottom)
        if not propagate_down[0]:
            return
        dt = top[0].dtype
        d = self.x_desc.ptr
        cudnn.call("cudnnLRNCrossChannelBackward", cudnn.handle(), self.lrn_desc.ptr,
                   cudnn.LRN_CROSS_CHANNEL, cudnn.one(dt), d, _ptr(top[0].gpu_data()), d,
                   _ptr(top[0].gpu_diff()), d, _ptr(bottom[0].gpu_data()), cudnn.zero(dt), d,
                   _ptr(bottom[0].mutable_gpu_diff()))


class _CuDNNActivation(_ChosenOnce):
    """Shared body of the cuDNN ReLU, Sigmoid and TanH: y = f(x), dx = f'(.) dy, in place
    allowed (cuDNN reads y, dy and x; in place x is y, which these three allow).  Its
    backward reads the top: one whose top a later layer rewrites in place is built with
    Caffe's class (``cudnn_reads_top``)."""
    act_mode = None

    @classmethod
    def cudnn_reads_top(cls, param):
        return True

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        self._use = self._cudnn_for(bottom, top)
        shape = (bottom[0].count(),)
        if self._use and getattr(self, "_desc_key", None) != shape:
            self.act_desc = cudnn.ActDesc(self.act_mode)
            self.t_desc = cudnn.TensorDesc(shape, bottom[0].dtype)
            self._desc_key = shape

    retain_inputs, retain_outputs = (0,), (0,)      # cuDNN reads x and y

    def forward_gpu(self, bottom, top):
        if not self._use or r16.storage(bottom[0]) is not None:
            return super().forward_gpu(bottom, top)   # (2-byte buffers: ReLU's kernel)
        dt = bottom[0].dtype
        cudnn.call("cudnnActivationForward", cudnn.handle(), self.act_desc.ptr, cudnn.one(dt),
                   self.t_desc.ptr, _ptr(bottom[0].gpu_data()), cudnn.zero(dt), self.t_desc.ptr,
                   _ptr(top[0].mutable_gpu_data()))

    def backward_gpu(self, top, propagate_down, bottom):
        if not self._use or r16.storage(bottom[0]) is not None:
            return super().backward_gpu(top, propagate_down, bottom)
        if not propagate_down[0]:
            return
        dt = top[0].dtype
        d = self.t_desc.ptr
        cudnn.call("cudnnActivationBackward", cudnn.handle(), self.act_desc.ptr, cudnn.one(dt),
                   d, _ptr(top[0].gpu_data()), d, _ptr(top[0].gpu_diff()), d,
                   _ptr(bottom[0].gpu_data()), cudnn.zero(dt), d,
                   _ptr(bottom[0].mutable_gpu_diff()))


@register_cudnn("ReLU")
class CuDNNReLULayer(_CuDNNActivation, ReLULayer):
    """ReLU through cuDNN; a leaky ReLU (negative_slope != 0) keeps Caffe's body."""
    act_mode = cudnn.ACT_RELU

    @classmethod
    def cudnn_refuses(cls, param):
        slope = param.relu_param.negative_slope
        return f"negative_slope {slope:g}" if slope != 0 else None


@register_cudnn("Sigmoid")
class CuDNNSigmoidLayer(_CuDNNActivation, SigmoidLayer):
    act_mode = cudnn.ACT_SIGMOID


@register_cudnn("TanH")
class CuDNNTanHLayer(_CuDNNActivation, TanHLayer):
    act_mode = cudnn.ACT_TANH


@register_cudnn("Softmax")
class CuDNNSoftmaxLayer(_ChosenOnce, SoftmaxLayer):
    """Softmax over ``axis`` through cuDNN (ACCURATE, per channel of an
    (outer, C, inner, 1) view); dx = y * (dy - sum(dy * y))."""

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        self._use = self._cudnn_for(bottom, top)
        b = bottom[0]
        shape = (b.count(0, self.axis), b.shape[self.axis], b.count(self.axis + 1), 1)
        if self._use and getattr(self, "_desc_key", None) != shape:
            self.t_desc = cudnn.TensorDesc(shape, b.dtype)
            self._desc_key = shape

    def forward_gpu(self, bottom, top):
        if not self._use:
            return super().forward_gpu(bottom, top)
        dt = bottom[0].dtype
        cudnn.call("cudnnSoftmaxForward", cudnn.handle(), cudnn.SOFTMAX_ACCURATE,
                   cudnn.SOFTMAX_MODE_CHANNEL, cudnn.one(dt), self.t_desc.ptr,
                   _ptr(bottom[0].gpu_data()), cudnn.zero(dt), self.t_desc.ptr,
                   _ptr(top[0].mutable_gpu_data()))

    def backward_gpu(self, top, propagate_down, bottom):
        if not self._use:
            return super().backward_gpu(top, propagate_down, bottom)
        if not propagate_down[0]:
            return
        dt = top[0].dtype
        d = self.t_desc.ptr
        cudnn.call("cudnnSoftmaxBackward", cudnn.handle(), cudnn.SOFTMAX_ACCURATE,
                   cudnn.SOFTMAX_MODE_CHANNEL, cudnn.one(dt), d, _ptr(top[0].gpu_data()), d,
                   _ptr(top[0].gpu_diff()), cudnn.zero(dt), d, _ptr(bottom[0].mutable_gpu_diff()))


_BN_FOLD = r"""
// Caffe's running statistics from cuDNN's batch mean and unbiased variance
extern "C" __global__ void mc_bn_fold(T* mean_sum, T* var_sum, T* weight, const T* mean,
                                      const T* var, T maf, int C) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c < C) {
    mean_sum[c] = mean[c] + maf * mean_sum[c];
    var_sum[c] = var[c] + maf * var_sum[c];
  }
  if (c == 0) weight[0] = weight[0] * maf + (T)1;
}
// the global statistics: mean_sum / weight, var_sum / weight (0 when the weight is 0)
extern "C" __global__ void mc_bn_global(const T* mean_sum, const T* var_sum, const T* weight,
                                        T* mean, T* var, int C) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c < C) {
    T s = weight[0];
    T f = s == (T)0 ? (T)0 : (T)1 / s;
    mean[c] = f * mean_sum[c];
    var[c] = f * var_sum[c];
  }
}
"""


@register_cudnn("BatchNorm")
class CuDNNBatchNormLayer(_ChosenOnce, BatchNormLayer):
    """Caffe's BatchNorm (no scale or shift: Scale follows it) through cuDNN's spatial
    batch normalisation, N-D inputs of 4 or 5 axes.  Training: cuDNN gives the batch mean
    and the unbiased variance (its running average with factor 1), which a small kernel
    folds into Caffe's three statistics blobs exactly as Caffe does; global statistics
    run cuDNN's inference mode on mean_sum/s and var_sum/s.  Backward needs the input x:
    in place, forward keeps a copy of it."""

    @classmethod
    def cudnn_refuses(cls, param):
        eps = param.batch_norm_param.eps
        return f"eps {eps:g} <= 0" if eps <= 0 else None

    def shape_refuses(self, bottom, top):
        b = bottom[0]
        if b.num_axes not in (4, 5):
            return f"an input of {b.num_axes} axes"
        return None

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        b = bottom[0]
        self._use = self._cudnn_for(bottom, top)
        if not self._use:
            return
        if getattr(self, "_desc_key", None) != b.shape:
            cp = backend.gpu_module()
            self.x_desc = cudnn.TensorDesc(b.shape, b.dtype)
            self.p_desc = cudnn.BNParamDesc(self.x_desc, cudnn.BN_SPATIAL)
            C = self.channels
            self._ones = cp.ones(C, dtype=b.dtype)
            self._zeros = cp.zeros(C, dtype=b.dtype)
            self._mean = cp.zeros(C, dtype=b.dtype)      # batch mean / global mean
            self._var = cp.zeros(C, dtype=b.dtype)       # unbiased batch var / global var
            self._save_mean = cp.zeros(C, dtype=b.dtype)
            self._save_inv = cp.zeros(C, dtype=b.dtype)
            self._dscale = cp.zeros(C, dtype=b.dtype)
            self._dbias = cp.zeros(C, dtype=b.dtype)
            self._desc_key = b.shape
        self._x_copy_needed = bottom[0] is top[0] and not self.use_global_stats

    # the Scale whose parameters the last training forward applied (the fused type
    # BatchNorm+Scale, layers/fused.py): its backward gives their gradients too
    _fused = None

    # cuDNN's backward reads x (in place, or with global statistics, forward keeps its
    # own copy of x and nothing is read); Caffe's keeps x_norm and std
    @property
    def retain_inputs(self):
        if getattr(self, "_use", False) and not (self.use_global_stats or self.in_place):
            return (0,)
        return ()

    def state_bytes(self, bottom, top):
        if not getattr(self, "_use", False):
            return super().state_bytes(bottom, top)
        if bottom[0] is top[0] and not self.use_global_stats:
            return bottom[0].count() * bottom[0].dtype.itemsize
        return 0

    def scratch_bytes(self, bottom, top):
        if getattr(self, "_use", False) and bottom[0] is top[0]:
            return bottom[0].count() * bottom[0].dtype.itemsize   # LAYER_SCRATCH
        return 0

    def _kernel(self, name, dt):
        from ..kernels._backend import cuda_type, raw_kernel
        return raw_kernel(_BN_FOLD, name, cuda_type(dt))

    # on 2-byte buffers (real 16-bit storage, engine/precision.py): cuDNN's training
    # batch norm with bfloat16/float16 x, y, dy, dx and fp32 scale, bias and statistics
    @property
    def reduced_body(self):
        return bool(getattr(self, "_use", False)) and not self.use_global_stats

    def _descs(self, blob):
        """(x descriptor, parameter descriptor) for the type ``blob``'s buffers hold now
        (channels-last where the engine holds the maps so)."""
        s = r16.storage(blob)
        if s is None:
            return self.x_desc, self.p_desc
        nhwc = r16.layout(blob) is not None
        key = (s, nhwc, self._desc_key)
        if getattr(self, "_descs16", (None,))[0] != key:
            dt = cudnn.storage_dtype(s)
            xd = cudnn.TensorDesc(blob.shape, dt, nhwc=nhwc)
            self._descs16 = (key, xd, cudnn.BNParamDesc(xd, cudnn.BN_SPATIAL))
        return self._descs16[1:]

    def forward_gpu_scale(self, bottom, top, scale, relu=False):
        """The fused type BatchNorm+Scale (layers/fused.py): training with batch statistics,
        the learned per-channel Scale ``scale`` after us, in place on our top, is applied in
        the same cuDNN call (y = gamma x_hat + beta), as PyTorch's affine batch norm does,
        and our backward gives its parameters' gradients.  False, with nothing done, where
        this pass cannot (Caffe's kernels for this shape, global statistics).  ``relu``
        (BatchNorm+Scale+ReLU): also y = max(y, 0) where our channels-last kernels run
        (2-byte maps held channels-last), and our backward masks dy by y > 0 first; "relu"
        is returned when they did, True when the ReLU is left to the caller."""
        if not self._use or self.use_global_stats or not scale.per_channel(top):
            return False
        relu = bool(relu) and r16.layout(bottom[0]) is not None
        self._forward_cudnn(bottom, top, scale, relu)
        return "relu" if relu else True

    def forward_gpu(self, bottom, top):
        if not self._use:
            return super().forward_gpu(bottom, top)
        self._forward_cudnn(bottom, top, None)

    # the fused ReLU the last training forward applied (our channels-last kernels)
    _fused_relu = False

    def _forward_cudnn(self, bottom, top, sc, relu=False):
        dt = bottom[0].dtype
        h = cudnn.handle()
        C = self.channels
        grid = ((C + 255) // 256,)
        x = bottom[0].gpu_data()
        if self._x_copy_needed:
            xc = getattr(self, "_x_saved", None)
            if xc is None or xc.shape != x.shape:
                xc = self._x_saved = backend.gpu_module().empty_like(x)
            xc[...] = x
            x = xc
        y = top[0].mutable_gpu_data()
        xd, pd = self._descs(bottom[0])
        stats = [s.mutable_gpu_data() for s in self.blobs]
        if self.use_global_stats:
            self._kernel("mc_bn_global", dt)(grid, (256,), (stats[0], stats[1], stats[2],
                                                            self._mean, self._var, np.int32(C)))
            cudnn.call("cudnnBatchNormalizationForwardInference", h, cudnn.BN_SPATIAL,
                       cudnn.one(dt), cudnn.zero(dt), self.x_desc.ptr, _ptr(x), self.x_desc.ptr,
                       _ptr(y), self.p_desc.ptr, _ptr(self._ones), _ptr(self._zeros),
                       _ptr(self._mean), _ptr(self._var), float(self.eps))
            return
        gamma, beta = self._ones, self._zeros
        if sc is not None:
            gamma = sc.blobs[0].gpu_data()
            beta = sc.blobs[1].gpu_data() if sc.bias_term else self._zeros
        self._fused, self._fused_relu = sc, relu
        if r16.layout(bottom[0]) is not None:     # channels-last 2-byte maps: our kernels
            r16.bn_nhwc_forward(x, y, C, r16.storage(bottom[0]), gamma, beta, self.eps,
                                self._save_mean, self._save_inv, self._mean, self._var,
                                self._bn16_work(x.size // C, C), relu=relu)
        else:
            cudnn.call("cudnnBatchNormalizationForwardTraining", h, cudnn.BN_SPATIAL,
                       cudnn.one(dt), cudnn.zero(dt), xd.ptr, _ptr(x), xd.ptr, _ptr(y),
                       pd.ptr, _ptr(gamma), _ptr(beta), 1.0, _ptr(self._mean),
                       _ptr(self._var), float(self.eps), _ptr(self._save_mean),
                       _ptr(self._save_inv))
        self._kernel("mc_bn_fold", dt)(grid, (256,), (stats[0], stats[1], stats[2], self._mean,
                                                      self._var, dt.type(self.moving_average_fraction),
                                                      np.int32(C)))

    def _bn16_work(self, M, C):
        """float64 scratch of the channels-last kernels (kernels/reduced.bn_work_size: the
        chunks' sums and counters the kernels leave at zero), zeroed when made."""
        n = r16.bn_work_size(M, C)
        p = getattr(self, "_bn16_p", None)
        if p is None or p.size < n:
            p = self._bn16_p = backend.gpu_module().zeros(n, dtype=np.float64)
        return p

    def _bn16_sums(self, C):
        s = getattr(self, "_bn16_s", None)
        if s is None or s.size < 2 * C:
            s = self._bn16_s = backend.gpu_module().empty(2 * C, dtype=np.float32)
        return s

    def backward_gpu(self, top, propagate_down, bottom):
        if not self._use:
            return super().backward_gpu(top, propagate_down, bottom)
        if not propagate_down[0]:
            return
        dt = top[0].dtype
        h = cudnn.handle()
        dy = top[0].gpu_diff()
        dx = bottom[0].mutable_gpu_diff()
        if self.use_global_stats:  # dx = dy / sqrt(var + eps)
            std = backend.gpu_module().sqrt(self._var + dt.type(self.eps))
            shape = (1, self.channels) + (1,) * (dy.ndim - 2)
            backend.gpu_module().divide(dy, std.reshape(shape), out=dx)
            return
        x = self._x_saved if self._x_copy_needed else bottom[0].gpu_data()
        out = dx
        if bottom[0] is top[0]:  # in place: cuDNN writes dx into a shared scratch buffer
            out = scratch(LAYER_SCRATCH, dx.nbytes)[:dx.nbytes].view(dx.dtype).reshape(dx.shape)
        sc, relu = self._fused, self._fused_relu
        gamma, dgamma, dbeta, pbeta = self._ones, self._dscale, self._dbias, cudnn.zero(dt)
        beta = self._zeros
        if sc is not None:      # the Scale after us: its parameters and their gradients
            gamma = sc.blobs[0].gpu_data()
            if sc.bias_term:
                beta = sc.blobs[1].gpu_data()
            dgamma = sc.blobs[0].mutable_gpu_diff() if sc.get_param_propagate_down(0) \
                else self._dscale
            if sc.bias_term and sc.get_param_propagate_down(1):
                dbeta = sc.blobs[1].mutable_gpu_diff()
            pbeta = cudnn.one(dt)   # parameter diffs accumulate (into the scratch too)
        xd, pd = self._descs(bottom[0])
        if r16.layout(bottom[0]) is not None:     # channels-last 2-byte maps: our kernels
            C = self.channels
            r16.bn_nhwc_backward(x, dy, out, C, r16.storage(bottom[0]), gamma,
                                 self._save_mean, self._save_inv, dgamma, dbeta,
                                 sc is not None, self._bn16_sums(C),
                                 self._bn16_work(x.size // C, C), beta=beta, relu=relu)
            if out is not dx:
                dx[...] = out
            return
        cudnn.call("cudnnBatchNormalizationBackward", h, cudnn.BN_SPATIAL, cudnn.one(dt),
                   cudnn.zero(dt), cudnn.one(dt), pbeta, xd.ptr, _ptr(x),
                   xd.ptr, _ptr(dy), xd.ptr, _ptr(out), pd.ptr,
                   _ptr(gamma), _ptr(dgamma), _ptr(dbeta), float(self.eps),
                   _ptr(self._save_mean), _ptr(self._save_inv))
        if out is not dx:
            dx[...] = out
