"""cuDNN through ctypes: descriptors and the calls Caffe's cuDNN layers make.

CuPy 14 has no cuDNN; minicaffe loads pip's ``nvidia-cudnn`` library (``libs.load_cudnn``)
and calls its C API with CuPy device pointers.  The calls take no host-side decisions
and allocate nothing (workspaces come from the caller), so they capture inside CUDA
graphs.  One handle per thread and device, always set to the current CuPy stream.

Thin on purpose: descriptor classes that free themselves, the calls under their cuDNN
names, and the algorithm search (``find_*``, once per geometry, cached).  Which algorithm
and how much workspace is the layers' business (``layers/cudnn_layers.py``).
"""
import ctypes
import threading

import numpy as np

from ..core import backend, context
from ..core import precision as P
from . import libs, options

# enums (cudnn_graph.h, cudnn_ops.h, cudnn_cnn.h)
SUCCESS = 0
DATA = {np.dtype(np.float32): 0, np.dtype(np.float64): 1}
# reduced storage types (cudnnDataType_t): CUDNN_DATA_HALF, CUDNN_DATA_BFLOAT16; bfloat16
# has no numpy dtype here (it travels as uint16 words), so it is named by its string
HALF, BFLOAT16 = 2, 9
REDUCED = {"float16": HALF, "bfloat16": BFLOAT16}
TENSOR_OP_MATH = 1
NCHW, NHWC = 0, 1
CROSS_CORRELATION = 1
DEFAULT_MATH, FMA_MATH = 0, 3
DETERMINISTIC = 1
POOL_MAX, POOL_AVE_INCLUDE_PAD, POOL_AVE_EXCLUDE_PAD, POOL_MAX_DETERMINISTIC = 0, 1, 2, 3
NOT_PROPAGATE_NAN, PROPAGATE_NAN = 0, 1
ACT_SIGMOID, ACT_RELU, ACT_TANH = 0, 1, 2
LRN_CROSS_CHANNEL = 0
SOFTMAX_ACCURATE, SOFTMAX_LOG = 1, 2
SOFTMAX_MODE_CHANNEL = 1
BN_SPATIAL, BN_SPATIAL_PERSISTENT = 1, 2

_v, _i, _u, _d, _sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_double, ctypes.c_size_t
_ip = ctypes.POINTER(ctypes.c_int)


class AlgoPerf(ctypes.Structure):
    """cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t (one layout for the three)."""
    _fields_ = [("algo", _i), ("status", _i), ("time", ctypes.c_float), ("memory", _sz),
                ("determinism", _i), ("mathType", _i), ("reserved", _i * 3)]


_SIGS = {
    "cudnnCreate": [ctypes.POINTER(_v)],
    "cudnnSetStream": [_v, _v],
    "cudnnCreateTensorDescriptor": [ctypes.POINTER(_v)],
    "cudnnDestroyTensorDescriptor": [_v],
    "cudnnSetTensorNdDescriptor": [_v, _i, _i, _ip, _ip],
    "cudnnCreateFilterDescriptor": [ctypes.POINTER(_v)],
    "cudnnDestroyFilterDescriptor": [_v],
    "cudnnSetFilterNdDescriptor": [_v, _i, _i, _i, _ip],
    "cudnnCreateConvolutionDescriptor": [ctypes.POINTER(_v)],
    "cudnnDestroyConvolutionDescriptor": [_v],
    "cudnnSetConvolutionNdDescriptor": [_v, _i, _ip, _ip, _ip, _i, _i],
    "cudnnSetConvolutionGroupCount": [_v, _i],
    "cudnnSetConvolutionMathType": [_v, _i],
    "cudnnGetConvolutionNdForwardOutputDim": [_v, _v, _v, _i, _ip],
    "cudnnFindConvolutionForwardAlgorithmEx": [_v, _v, _v, _v, _v, _v, _v, _v, _i, _ip,
                                               ctypes.POINTER(AlgoPerf), _v, _sz],
    "cudnnFindConvolutionBackwardDataAlgorithmEx": [_v, _v, _v, _v, _v, _v, _v, _v, _i, _ip,
                                                    ctypes.POINTER(AlgoPerf), _v, _sz],
    "cudnnFindConvolutionBackwardFilterAlgorithmEx": [_v, _v, _v, _v, _v, _v, _v, _v, _i, _ip,
                                                      ctypes.POINTER(AlgoPerf), _v, _sz],
    "cudnnGetConvolutionForwardAlgorithm_v7": [_v, _v, _v, _v, _v, _i, _ip,
                                               ctypes.POINTER(AlgoPerf)],
    "cudnnGetConvolutionBackwardDataAlgorithm_v7": [_v, _v, _v, _v, _v, _i, _ip,
                                                    ctypes.POINTER(AlgoPerf)],
    "cudnnGetConvolutionBackwardFilterAlgorithm_v7": [_v, _v, _v, _v, _v, _i, _ip,
                                                      ctypes.POINTER(AlgoPerf)],
    "cudnnConvolutionForward": [_v, _v, _v, _v, _v, _v, _v, _i, _v, _sz, _v, _v, _v],
    "cudnnConvolutionBackwardData": [_v, _v, _v, _v, _v, _v, _v, _i, _v, _sz, _v, _v, _v],
    "cudnnConvolutionBackwardFilter": [_v, _v, _v, _v, _v, _v, _v, _i, _v, _sz, _v, _v, _v],
    "cudnnConvolutionBackwardBias": [_v, _v, _v, _v, _v, _v, _v],
    "cudnnConvolutionBiasActivationForward": [_v, _v, _v, _v, _v, _v, _v, _i, _v, _sz, _v, _v,
                                              _v, _v, _v, _v, _v, _v],
    "cudnnAddTensor": [_v, _v, _v, _v, _v, _v, _v],
    "cudnnCreatePoolingDescriptor": [ctypes.POINTER(_v)],
    "cudnnDestroyPoolingDescriptor": [_v],
    "cudnnSetPoolingNdDescriptor": [_v, _i, _i, _i, _ip, _ip, _ip],
    "cudnnGetPoolingNdForwardOutputDim": [_v, _v, _i, _ip],
    "cudnnPoolingForward": [_v, _v, _v, _v, _v, _v, _v, _v],
    "cudnnPoolingBackward": [_v, _v, _v, _v, _v, _v, _v, _v, _v, _v, _v, _v],
    "cudnnCreateLRNDescriptor": [ctypes.POINTER(_v)],
    "cudnnDestroyLRNDescriptor": [_v],
    "cudnnSetLRNDescriptor": [_v, _u, _d, _d, _d],
    "cudnnLRNCrossChannelForward": [_v, _v, _i, _v, _v, _v, _v, _v, _v],
    "cudnnLRNCrossChannelBackward": [_v, _v, _i, _v, _v, _v, _v, _v, _v, _v, _v, _v, _v],
    "cudnnCreateActivationDescriptor": [ctypes.POINTER(_v)],
    "cudnnDestroyActivationDescriptor": [_v],
    "cudnnSetActivationDescriptor": [_v, _i, _i, _d],
    "cudnnActivationForward": [_v, _v, _v, _v, _v, _v, _v, _v],
    "cudnnActivationBackward": [_v, _v, _v, _v, _v, _v, _v, _v, _v, _v, _v, _v],
    "cudnnSoftmaxForward": [_v, _i, _i, _v, _v, _v, _v, _v, _v],
    "cudnnSoftmaxBackward": [_v, _i, _i, _v, _v, _v, _v, _v, _v, _v, _v],
    "cudnnDeriveBNTensorDescriptor": [_v, _v, _i],
    "cudnnBatchNormalizationForwardTraining": [_v, _i, _v, _v, _v, _v, _v, _v, _v, _v, _v, _d,
                                               _v, _v, _d, _v, _v],
    "cudnnBatchNormalizationForwardInference": [_v, _i, _v, _v, _v, _v, _v, _v, _v, _v, _v, _v,
                                                _v, _d],
    "cudnnBatchNormalizationBackward": [_v, _i, _v, _v, _v, _v, _v, _v, _v, _v, _v, _v, _v, _v,
                                        _v, _v, _d, _v, _v],
}

_lib = None
_lib_path = None
_state = {"checked": False, "error": None}
_lock = threading.Lock()


class CudnnError(RuntimeError):
    pass


def lib():
    global _lib, _lib_path
    if _lib is None:
        l, path = libs.load_cudnn()
        l.cudnnGetVersion.restype = _sz
        l.cudnnGetErrorString.restype = ctypes.c_char_p
        l.cudnnGetErrorString.argtypes = [_i]
        for name, args in _SIGS.items():
            f = getattr(l, name)
            f.argtypes = args
            f.restype = _i
        _lib, _lib_path = l, path
    return _lib


def version():
    return int(lib().cudnnGetVersion())


def library_path():
    lib()
    return _lib_path


def _check(status, what):
    if status != SUCCESS:
        msg = lib().cudnnGetErrorString(status).decode()
        raise CudnnError(f"{what}: {msg} (cuDNN status {status})")


def call(name, *args):
    """Call cuDNN function ``name``; raise CudnnError naming it on failure."""
    _check(getattr(lib(), name)(*args), name)


def available():
    """(True, '') when the cuDNN engine can run here, else (False, why)."""
    if not options.cudnn:    # checked first: switching cuDNN back on probes again
        return False, "switched off (MINICAFFE_CUDNN=0 or options.set_cudnn(False))"
    with _lock:
        if not _state["checked"]:
            _state["checked"] = True
            _state["error"] = None
            try:
                if not backend.gpu_available():
                    raise OSError(backend.why_no_gpu())
                v = version()
                if v < 8000:
                    raise OSError(f"cuDNN {v} is too old (8.0 or newer is needed)")
                h = _v()
                with backend.cp.cuda.Device(context.device_id()):
                    _check(lib().cudnnCreate(ctypes.byref(h)), "cudnnCreate")
                _state["probe"] = h
            except Exception as e:  # OSError, CudnnError, CUDA errors
                _state["error"] = str(e)
    return (_state["error"] is None), (_state["error"] or "")


def describe():
    ok, why = available()
    if not ok:
        return f"cuDNN unavailable ({why})"
    v = version()
    return f"cuDNN {v // 10000}.{v // 100 % 100}.{v % 100} ({library_path()})"


# -- handles --------------------------------------------------------------------------
class _Handle:
    def __init__(self):
        h = _v()
        call("cudnnCreate", ctypes.byref(h))
        self.ptr = h
        self.stream = None

    def ready(self):
        s = backend.cp.cuda.get_current_stream().ptr
        if s != self.stream:
            call("cudnnSetStream", self.ptr, s)
            self.stream = s
        return self.ptr


def handle():
    """This thread's handle for the current device, on the current CuPy stream."""
    handles = context.get().handles
    h = handles.get("cudnn")
    if h is None:
        h = handles["cudnn"] = _Handle()
    return h.ready()


# -- scalars --------------------------------------------------------------------------
_ONE = {np.dtype(np.float32): ctypes.c_float(1.0), np.dtype(np.float64): ctypes.c_double(1.0)}
_ZERO = {np.dtype(np.float32): ctypes.c_float(0.0), np.dtype(np.float64): ctypes.c_double(0.0)}


def one(dtype):
    """alpha = 1 for data of ``dtype`` (reduced types compute, and scale, in float)."""
    return ctypes.byref(_ONE[np.dtype(np.float32) if _is_reduced(dtype) else np.dtype(dtype)])


def zero(dtype):
    return ctypes.byref(_ZERO[np.dtype(np.float32) if _is_reduced(dtype) else np.dtype(dtype)])


def _is_reduced(dtype):
    return isinstance(dtype, str) and dtype in REDUCED or (
        not isinstance(dtype, str) and np.dtype(dtype) == np.float16)


def data_type(dtype):
    """cudnnDataType_t of ``dtype``: a numpy dtype, or "float16"/"bfloat16"."""
    if isinstance(dtype, str) and dtype in REDUCED:
        return REDUCED[dtype]
    if np.dtype(dtype) == np.float16:
        return HALF
    return DATA[np.dtype(dtype)]


def storage_dtype(storage):
    """The ``dtype`` argument of the descriptors for buffers held in the 2-byte storage
    type ``storage`` (core/precision.py): "bfloat16" for BFLOAT16 (its uint16 words have
    no numpy dtype), float16 for FLOAT16."""
    if storage == P.BFLOAT16:
        return "bfloat16"
    if storage == P.FLOAT16:
        return np.dtype(np.float16)
    raise ValueError(f"not a 2-byte storage type: {storage!r}")


def _ints(vals):
    vals = [int(v) for v in vals]
    return (ctypes.c_int * len(vals))(*vals)


def ptr(a):
    return a.data.ptr


# -- descriptors ------------------------------------------------------------------------
class _Desc:
    _create = _destroy = None

    def __init__(self):
        self.ptr = _v()
        call(self._create, ctypes.byref(self.ptr))

    def __del__(self):
        p = getattr(self, "ptr", None)
        if p is not None and p.value and _lib is not None:
            try:
                getattr(_lib, self._destroy)(p)
            except Exception:
                pass


class TensorDesc(_Desc):
    """A packed N-D tensor (N, C, *spatial); fewer than 4 dims are padded with ones, as
    cuDNN wants at least 4.  ``nhwc``: a 4-D tensor held channels-last (N, H, W, C in
    memory; the shape stays N, C, H, W)."""
    _create, _destroy = "cudnnCreateTensorDescriptor", "cudnnDestroyTensorDescriptor"

    def __init__(self, shape, dtype, nhwc=False):
        super().__init__()
        shape = tuple(int(d) for d in shape) + (1,) * max(0, 4 - len(shape))
        strides, s = [], 1
        for d in reversed(shape):
            strides.append(s)
            s *= d
        if nhwc:
            if len(shape) != 4:
                raise ValueError(f"channels-last wants 4 dims, not {shape}")
            n, c, h, w = shape
            strides = [c, w * c, 1, h * w * c]     # reversed: W, H, C, N
        self.shape = shape
        self.dtype = dtype if isinstance(dtype, str) else np.dtype(dtype)
        call("cudnnSetTensorNdDescriptor", self.ptr, data_type(dtype), len(shape),
             _ints(shape), _ints(reversed(strides)))


class FilterDesc(_Desc):
    _create, _destroy = "cudnnCreateFilterDescriptor", "cudnnDestroyFilterDescriptor"

    def __init__(self, shape, dtype, nhwc=False):
        """``nhwc``: the filter held K, R, S, C in memory (the shape stays K, C, R, S)."""
        super().__init__()
        self.shape = tuple(int(d) for d in shape)
        call("cudnnSetFilterNdDescriptor", self.ptr, data_type(dtype), NHWC if nhwc else NCHW,
             len(self.shape), _ints(self.shape))


class ConvDesc(_Desc):
    _create, _destroy = "cudnnCreateConvolutionDescriptor", "cudnnDestroyConvolutionDescriptor"

    def __init__(self, pad, stride, dilation, groups, dtype, tf32=None):
        """``dtype``: the data's; reduced data (float16, "bfloat16") computes in float
        with tensor-op math (cuDNN's pseudo-half configuration)."""
        super().__init__()
        reduced = _is_reduced(dtype)
        call("cudnnSetConvolutionNdDescriptor", self.ptr, len(pad), _ints(pad), _ints(stride),
             _ints(dilation), CROSS_CORRELATION, 0 if reduced else data_type(dtype))
        if groups > 1:
            call("cudnnSetConvolutionGroupCount", self.ptr, int(groups))
        tf32 = options.tf32 if tf32 is None else tf32
        call("cudnnSetConvolutionMathType", self.ptr,
             TENSOR_OP_MATH if reduced else DEFAULT_MATH if tf32 else FMA_MATH)

    def output_dims(self, xdesc, wdesc):
        n = len(xdesc.shape)
        out = (ctypes.c_int * n)()
        call("cudnnGetConvolutionNdForwardOutputDim", self.ptr, xdesc.ptr, wdesc.ptr, n, out)
        return tuple(out)


class PoolDesc(_Desc):
    _create, _destroy = "cudnnCreatePoolingDescriptor", "cudnnDestroyPoolingDescriptor"

    def __init__(self, mode, window, pad, stride):
        super().__init__()
        call("cudnnSetPoolingNdDescriptor", self.ptr, mode, PROPAGATE_NAN, len(window),
             _ints(window), _ints(pad), _ints(stride))

    def output_dims(self, xdesc):
        n = len(xdesc.shape)
        out = (ctypes.c_int * n)()
        call("cudnnGetPoolingNdForwardOutputDim", self.ptr, xdesc.ptr, n, out)
        return tuple(out)


class LRNDesc(_Desc):
    _create, _destroy = "cudnnCreateLRNDescriptor", "cudnnDestroyLRNDescriptor"

    def __init__(self, n, alpha, beta, k):
        super().__init__()
        call("cudnnSetLRNDescriptor", self.ptr, int(n), float(alpha), float(beta), float(k))


class ActDesc(_Desc):
    _create, _destroy = "cudnnCreateActivationDescriptor", "cudnnDestroyActivationDescriptor"

    def __init__(self, mode, coef=0.0):
        super().__init__()
        call("cudnnSetActivationDescriptor", self.ptr, mode, PROPAGATE_NAN, float(coef))


class BNParamDesc(_Desc):
    """The (1, C, 1, 1) descriptor of scale, bias, mean and variance derived from x's."""
    _create, _destroy = "cudnnCreateTensorDescriptor", "cudnnDestroyTensorDescriptor"

    def __init__(self, xdesc, mode):
        super().__init__()
        call("cudnnDeriveBNTensorDescriptor", self.ptr, xdesc.ptr, mode)


# -- convolution algorithm search ------------------------------------------------------------
_FIND = {
    "fwd": "cudnnFindConvolutionForwardAlgorithmEx",
    "bwd_data": "cudnnFindConvolutionBackwardDataAlgorithmEx",
    "bwd_filter": "cudnnFindConvolutionBackwardFilterAlgorithmEx",
}
_GET = {
    "fwd": "cudnnGetConvolutionForwardAlgorithm_v7",
    "bwd_data": "cudnnGetConvolutionBackwardDataAlgorithm_v7",
    "bwd_filter": "cudnnGetConvolutionBackwardFilterAlgorithm_v7",
}
_WS = {
    "fwd": "cudnnGetConvolutionForwardWorkspaceSize",
    "bwd_data": "cudnnGetConvolutionBackwardDataWorkspaceSize",
    "bwd_filter": "cudnnGetConvolutionBackwardFilterWorkspaceSize",
}
_algo_cache = {}


def workspace_size(kind, descs, algo):
    """Bytes of workspace cuDNN requires for ``algo`` of ``kind`` with ``descs`` (the 4
    descriptors in the heuristics call's order) as they are set now: what the call
    itself checks (it can exceed the figure Find reported for that algorithm)."""
    n = _sz(0)
    call(_WS[kind], handle(), *descs, int(algo), ctypes.byref(n))
    return int(n.value)


def clear_algorithm_cache():
    """Forget every algorithm Find has timed: the next layer set up times its shapes again
    (after a change of workspace limit, or to measure Find itself)."""
    _algo_cache.clear()


def search_workspace(kind, descs, limit):
    """Bytes of workspace worth giving Find: the most any algorithm of ``kind`` asks for
    (cuDNN's heuristics list them with their needs), capped at ``limit``, so that small
    layers are not timed with a gigabyte of scratch.  ``descs``: the 4 descriptors in the
    heuristics call's order."""
    perf = (AlgoPerf * 16)()
    n = ctypes.c_int(0)
    call(_GET[kind], handle(), *descs, 16, ctypes.byref(n), perf)
    need = [p.memory for p in perf[:n.value] if p.status == SUCCESS and p.memory <= limit]
    return int(max(need, default=0))


def find_algorithms(kind, key, args, workspace, limit, tf32=None):
    """The usable algorithms of ``kind`` (fwd, bwd_data, bwd_filter) for the geometry
    ``key``, timed by cuDNN's Find on the buffers in ``args`` (7 pointers/descriptors in
    the Find call's order), within ``limit`` bytes of workspace; deterministic ones only
    when ``options.deterministic``, FMA math only unless ``tf32`` (None: ``options.tf32``)
    is on.  Cached per (device,
    kind, key, options).  Returns [(algo, workspace bytes, time ms)], fastest first."""
    tf32 = options.tf32 if tf32 is None else bool(tf32)
    ck = (context.device_id(), kind, key, options.deterministic, tf32)
    hit = _algo_cache.get(ck)
    if hit is not None and limit <= hit[0]:     # timed with at least this much room
        fit = [a for a in hit[1] if a[1] <= limit]
        if fit:
            return fit
    perf = (AlgoPerf * 16)()
    n = ctypes.c_int(0)
    call(_FIND[kind], handle(), *args, 16, ctypes.byref(n), perf,
         workspace.data.ptr if workspace is not None else None,
         0 if workspace is None else workspace.nbytes)
    found = []
    for p in perf[:n.value]:
        if p.status != SUCCESS or p.memory > limit:
            continue
        if options.deterministic and p.determinism != DETERMINISTIC:
            continue
        if not tf32 and p.mathType not in (DEFAULT_MATH, FMA_MATH):
            continue
        found.append((int(p.algo), int(p.memory), float(p.time)))
    if not found:
        raise CudnnError(f"no usable cuDNN {kind} algorithm for {key} within {limit} bytes of "
                         f"workspace{' (deterministic)' if options.deterministic else ''}")
    found.sort(key=lambda a: a[2])
    _algo_cache[ck] = (limit, found)
    return found


def pick(found, cap):
    """The fastest of ``found`` (find_algorithms' list) needing at most ``cap`` bytes."""
    fit = [a for a in found if a[1] <= cap]
    return min(fit, key=lambda a: a[2]) if fit else min(found, key=lambda a: a[1])


def choose_workspace(candidates, price_per_gib):
    """One workspace for a set of convolution calls (each a find_algorithms list; the
    workspace is one buffer shared by every layer of a thread): the size W minimising
    T(W) * (1 + price_per_gib * W / GiB), T(W) being the calls' summed Find time with
    the fastest algorithm each within W -- a GiB of workspace must buy at least
    ``price_per_gib`` of the convolutions' time.  Returns W in bytes."""
    if not candidates:
        return 0
    sizes = sorted({a[1] for c in candidates for a in c})
    def cost(cap):
        return sum(pick(c, cap)[2] for c in candidates) * (1.0 + price_per_gib * cap / 2 ** 30)
    return min(sizes, key=lambda cap: (cost(cap), cap))
