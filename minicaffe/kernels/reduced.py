"""GPU bodies of layers on 2-byte buffers (real 16-bit storage, issue 20: the memory
plan holds feature maps and their diffs in bfloat16 or float16, engine/precision.py).

CuPy has no bfloat16 dtype: a BFLOAT16 buffer is an array of uint16 words (the high
half of an fp32 word), a FLOAT16 one an array of float16.  Every kernel here loads its
2-byte inputs into fp32 registers, computes in fp32 and stores rounded to nearest even
(NVIDIA Caffe's and PyTorch's autocast's rule: 16-bit storage, fp32 math):

- ``storage(blob, diff=False)``: FLOAT16/BFLOAT16 when the blob's device side is held in
  2-byte words now (``SyncedMemory.storage``), else None;
- ``relu_forward(x, y)``, ``relu_backward(x, dy, dx)``: y = max(x, 0) (NaN kept);
  dx = dy where x > 0 (a non-finite dy kept, as the fp32 product would be);
- ``bias_act(y, bias, relu, nhwc)``: y = [max](y + bias[c], 0) in place, channel axis 1
  or, held channels-last, the last (a cuDNN convolution's output in the reduced type);
- ``layout(blob, diff=False)``: (N, C, H, W) when the device side is held channels-last;
- ``add(a, b, out, relu)``: out = a + b [then max(., 0)] (Split's backward of two
  tops, Eltwise SUM, ResNet's Eltwise+ReLU);
- ``channel_sum(dy, out, partial)``: out[c] += the sum of dy over every axis but 1 in
  float64 (a bias gradient), deterministic (kernels/reduce.py's partition).
"""
import numpy as np

from ..core import precision as P
from ._backend import elementwise_kernel, raw_kernel
from .reduce import _SRC as _SUM_SRC, _splits

_TYPE = {P.BFLOAT16: "uint16", P.FLOAT16: "float16"}
_LOAD = {P.BFLOAT16: "__uint_as_float(((unsigned int)({x})) << 16)",
         P.FLOAT16: "((float)({x}))"}
_STORE = {P.BFLOAT16: """{{ unsigned int u_ = __float_as_uint({v});
  {out} = ((u_ & 0x7fffffffu) > 0x7f800000u) ? (unsigned short)((u_ >> 16) | 0x40u)
        : (unsigned short)((u_ + 0x7fffu + ((u_ >> 16) & 1u)) >> 16); }}""",
          P.FLOAT16: "{out} = (float16)({v});"}
_ZERO = {P.BFLOAT16: "(unsigned short)0", P.FLOAT16: "(float16)0.0f"}


def layout(blob, diff=False):
    """(N, C, H, W) when ``blob``'s data (or diff) is held channels-last on the device
    now (``SyncedMemory.layout``), else None."""
    m = blob.diff_mem if diff else blob.data_mem
    return getattr(m, "layout", None)


def storage(blob, diff=False):
    """FLOAT16 or BFLOAT16 when ``blob``'s data (or diff) is held in 2-byte words on the
    device now, else None."""
    m = blob.diff_mem if diff else blob.data_mem
    return getattr(m, "storage", None)


def _kernel(s, what):
    t, load, store, zero = _TYPE[s], _LOAD[s], _STORE[s], _ZERO[s]
    tag = "bf16" if s == P.BFLOAT16 else "f16"
    if what == "relu_f":
        return elementwise_kernel(
            f"{t} x", f"{t} y",
            f"float v = {load.format(x='x')}; y = (v > 0.0f || v != v) ? x : {zero};",
            f"mc_relu_f_{tag}")
    if what == "relu_b":
        return elementwise_kernel(
            f"{t} x, {t} dy", f"{t} dx",
            f"float d = {load.format(x='dy')};\n"
            f"dx = ({load.format(x='x')} > 0.0f || !isfinite(d)) ? dy : {zero};",
            f"mc_relu_b_{tag}")
    if what == "bias_act":
        return elementwise_kernel(
            "raw float32 b, int64 c, int64 hw, int32 mode", f"{t} y",
            f"float v = {load.format(x='y')};\n"
            "if (mode & 1) v += b[(i / hw) % c];\n"
            "if (mode & 2) v = v > 0.0f ? v : 0.0f;\n" + store.format(v="v", out="y"),
            f"mc_bias_act_{tag}")
    if what == "add":
        return elementwise_kernel(
            f"{t} a, {t} b, int32 relu", f"{t} y",
            f"float v = {load.format(x='a')} + {load.format(x='b')};\n"
            "if (relu && !(v > 0.0f)) v = 0.0f;\n"
            + store.format(v="v", out="y"), f"mc_add_{tag}")
    raise ValueError(what)


def relu_forward(x, y, s):
    _kernel(s, "relu_f")(x, y)


def relu_backward(x, dy, dx, s):
    _kernel(s, "relu_b")(x, dy, dx)


def bias_act(y, s, bias=None, relu=False, nhwc=False):
    """In place on ``y`` (N, C, ...): the per-channel ``bias`` (float32) and a ReLU;
    ``nhwc``: ``y`` is held channels-last (the channel is the fastest axis)."""
    if bias is None and not relu:
        return y
    c = y.shape[1] if y.ndim > 1 else 1
    hw = 1 if nhwc else (int(np.prod(y.shape[2:])) if y.ndim > 2 else 1)
    mode = (1 if bias is not None else 0) | (2 if relu else 0)
    _kernel(s, "bias_act")(bias if bias is not None else _dummy(), c, hw, mode, y)
    return y


_DUMMY = []


def _dummy():
    if not _DUMMY:
        from ..core import backend
        _DUMMY.append(backend.gpu_module().zeros(1, dtype=np.float32))
    return _DUMMY[0]


def add(a, b, out, s, relu=False):
    """out = a + b (then max(., 0) with ``relu``), rounded once."""
    _kernel(s, "add")(a, b, np.int32(bool(relu)), out)


_H2F = r"""
__device__ __forceinline__ float mc_load(unsigned short h) {
#if MC_BF16
  return __uint_as_float(((unsigned int)h) << 16);
#else
  unsigned int s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) { float f = (float)m * 5.9604644775390625e-08f; return s ? -f : f; }
  if (e == 31) return __uint_as_float(s | 0x7f800000u | (m << 13));
  return __uint_as_float(s | ((e + 112u) << 23) | (m << 13));
#endif
}
"""


def channel_sum(dy, out, partial, s):
    """out[c] += sum of the 2-byte ``dy`` (N, C, ...) over every axis but 1 (``out``
    float32; ``partial`` float64 of ``partial_size(N, C)``)."""
    N, C = dy.shape[0], dy.shape[1] if dy.ndim > 1 else 1
    S = dy.size // max(N * C, 1)
    splits, rows = _splits(N, C)
    src = (f"#define MC_BF16 {1 if s == P.BFLOAT16 else 0}\n" + _H2F +
           "#define MC_IN unsigned short\n#define MC_LOAD(v) mc_load(v)\n" + _SUM_SRC)
    raw_kernel(src, "mc_channel_sum_partial", "float")(
        (C, splits), (256,), (dy.view(np.uint16), np.int32(N), np.int32(C), np.int64(S),
                              np.int32(rows), partial))
    raw_kernel(_SUM_SRC, "mc_channel_sum_final", "float")(
        ((C + 255) // 256,), (256,), (partial, np.int32(C), np.int32(splits), out,
                                      np.int32(1)))


# -- training batch norm on channels-last 2-byte maps (x, y, dy, dx: [M = N*H*W, C]) -------
# cuDNN's legacy batch norm is fast on NCHW only (benchmarks/bn_layout.py): these kernels
# are its channels-last counterpart.  Per-channel sums in float64 over fixed row chunks,
# then a fixed-order sum of the chunks (deterministic), then one element-wise pass.
_BN16 = r"""
extern "C" __global__ void mc_bn16_partial(const unsigned short* x, const unsigned short* dy,
    long long M, int C, long long rows, const float* mean, const float* inv, double* p1,
    double* p2, int mode) {
  __shared__ double sa[8][33], sb[8][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int c = blockIdx.x * 32 + tx;
  const long long r0 = (long long)blockIdx.y * rows;
  const long long r1 = min(M, r0 + rows);
  double a = 0, b = 0;
  if (c < C) {
    const float m = mode ? mean[c] : 0.0f, iv = mode ? inv[c] : 0.0f;
    for (long long r = r0 + ty; r < r1; r += 8) {
      const float v = mc_load(x[r * C + c]);
      if (mode == 0) { a += (double)v; b += (double)v * (double)v; }
      else { const float d = mc_load(dy[r * C + c]); a += (double)d;
             b += (double)d * (double)((v - m) * iv); }
    }
  }
  sa[ty][tx] = a; sb[ty][tx] = b;
  __syncthreads();
  if (ty == 0 && c < C) {
    for (int k = 1; k < 8; ++k) { a += sa[k][tx]; b += sb[k][tx]; }
    p1[(long long)blockIdx.y * C + c] = a;
    p2[(long long)blockIdx.y * C + c] = b;
  }
}
// mode 0: the batch statistics: mean, 1/sqrt(var + eps), and for Caffe's running sums
// the mean and the unbiased variance; mode 1: the sums of dy and dy * x_hat, and the
// parameters' gradients (added into, or written over: acc)
extern "C" __global__ void mc_bn16_final(const double* p1, const double* p2, int chunks,
    int C, long long M, double eps, float* o1, float* o2, float* o3, float* o4,
    float* dgamma, float* dbeta, int mode, int acc) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  double a = 0, b = 0;
  for (int k = 0; k < chunks; ++k) { a += p1[(long long)k * C + c]; b += p2[(long long)k * C + c]; }
  if (mode == 0) {
    const double mean = a / (double)M;
    double var = b / (double)M - mean * mean;
    if (var < 0) var = 0;
    o1[c] = (float)mean; o2[c] = (float)(1.0 / sqrt(var + eps));
    o3[c] = (float)mean; o4[c] = (float)(M > 1 ? var * (double)M / (double)(M - 1) : var);
  } else {
    o1[c] = (float)a; o2[c] = (float)b;
    if (dgamma) dgamma[c] = (acc ? dgamma[c] : 0.0f) + (float)b;
    if (dbeta) dbeta[c] = (acc ? dbeta[c] : 0.0f) + (float)a;
  }
}
"""


def _bn16_kernels(s):
    src = f"#define MC_BF16 {1 if s == P.BFLOAT16 else 0}\n" + _H2F.split(
        'extern "C"')[0] + _BN16
    return (raw_kernel(src, "mc_bn16_partial", "float"),
            raw_kernel(src, "mc_bn16_final", "float"))


def _bn16_apply(s, what):
    t, load, store = _TYPE[s], _LOAD[s], _STORE[s]
    tag = "bf16" if s == P.BFLOAT16 else "f16"
    if what == "fwd":
        return elementwise_kernel(
            f"{t} x, raw float32 mean, raw float32 inv, raw float32 g, raw float32 b, "
            "int64 C", f"{t} y",
            f"const long long c = i % C;\n"
            f"float v = ({load.format(x='x')} - mean[c]) * inv[c] * g[c] + b[c];\n"
            + store.format(v="v", out="y"), f"mc_bn16_fwd_{tag}")
    return elementwise_kernel(
        f"{t} x, {t} dy, raw float32 mean, raw float32 inv, raw float32 g, raw float32 sdy, "
        "raw float32 sdyx, float32 rm, int64 C", f"{t} dx",
        f"const long long c = i % C;\n"
        f"const float xh = ({load.format(x='x')} - mean[c]) * inv[c];\n"
        f"float v = g[c] * inv[c] * ({load.format(x='dy')} - rm * sdy[c] - rm * xh * sdyx[c]);\n"
        + store.format(v="v", out="dx"), f"mc_bn16_bwd_{tag}")


def _bn16_grid(M, C):
    cx = -(-C // 32)
    chunks = int(max(1, min(-(-M // 64), -(-2048 // cx))))
    rows = -(-M // chunks)
    return cx, -(-M // rows), rows


def bn_partial_size(M, C):
    return C * _bn16_grid(M, C)[1]


def bn_nhwc_forward(x, y, C, s, gamma, beta, eps, save_mean, save_inv, batch_mean,
                    batch_var, p1, p2):
    """Training batch norm of the channels-last 2-byte ``x`` ([M, C] flat) into ``y``:
    the batch statistics (``save_mean``, ``save_inv`` = 1/sqrt(var + eps); ``batch_mean``,
    ``batch_var`` unbiased, what cuDNN's running average with factor 1 gives), then
    y = (x - mean) * inv * gamma + beta.  ``p1``/``p2``: float64 of ``bn_partial_size``."""
    M = x.size // C
    cx, chunks, rows = _bn16_grid(M, C)
    part, final = _bn16_kernels(s)
    u = x.view(np.uint16)
    part((cx, chunks), (32, 8), (u, u, np.int64(M), np.int32(C), np.int64(rows), save_mean,
                                 save_inv, p1, p2, np.int32(0)))
    final(((C + 127) // 128,), (128,), (p1, p2, np.int32(chunks), np.int32(C), np.int64(M),
                                         np.float64(eps), save_mean, save_inv, batch_mean,
                                         batch_var, p1, p1, np.int32(0), np.int32(0)))
    _bn16_apply(s, "fwd")(x, save_mean, save_inv, gamma, beta, np.int64(C), y)


def bn_nhwc_backward(x, dy, dx, C, s, gamma, save_mean, save_inv, dgamma, dbeta, acc,
                     sums, p1, p2):
    """Its backward: dgamma (+)= sum dy x_hat, dbeta (+)= sum dy (``acc``: added into),
    dx = gamma inv (dy - mean(dy) - x_hat mean(dy x_hat)); ``sums``: float32 of 2 C."""
    M = x.size // C
    cx, chunks, rows = _bn16_grid(M, C)
    part, final = _bn16_kernels(s)
    part((cx, chunks), (32, 8), (x.view(np.uint16), dy.view(np.uint16), np.int64(M),
                                 np.int32(C), np.int64(rows), save_mean, save_inv, p1, p2,
                                 np.int32(1)))
    sdy, sdyx = sums[:C], sums[C:2 * C]
    final(((C + 127) // 128,), (128,), (p1, p2, np.int32(chunks), np.int32(C), np.int64(M),
                                         np.float64(0), sdy, sdyx, sdy, sdyx, dgamma, dbeta,
                                         np.int32(1), np.int32(int(bool(acc)))))
    _bn16_apply(s, "bwd")(x, dy, save_mean, save_inv, gamma, sdy, sdyx,
                          np.float32(1.0 / M), np.int64(C), dx)
