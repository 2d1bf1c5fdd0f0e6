"""GPU bodies of layers on 2-byte buffers (real 16-bit storage, issue 20: the memory
plan holds feature maps and their diffs in bfloat16 or float16, engine/precision.py).

CuPy has no bfloat16 dtype: a BFLOAT16 buffer is an array of uint16 words (the high
half of an fp32 word), a FLOAT16 one an array of float16.  Every kernel here loads its
2-byte inputs into fp32 registers, computes in fp32 and stores rounded to nearest even
(NVIDIA Caffe's and PyTorch's autocast's rule: 16-bit storage, fp32 math).  On
C-contiguous arrays the ReLU, add and bias_act bodies are kernels/vec16.py's (8 elements
per thread through 16-byte accesses); strided views take the generic ElementwiseKernels
below, which give the same bits:

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
from . import vec16
from ._backend import elementwise_kernel, raw_kernel
from .reduce import _SRC as _SUM_SRC, _splits

_TYPE = {P.BFLOAT16: "uint16", P.FLOAT16: "float16"}
_LOAD = {P.BFLOAT16: "__uint_as_float(((unsigned int)({x})) << 16)",
         P.FLOAT16: "((float)({x}))"}
_STORE = {P.BFLOAT16: vec16.BF16_STORE, P.FLOAT16: "{out} = (float16)({v});"}
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


def generic_kernel(s, what):
    """The one-element-per-thread ElementwiseKernel of ``what`` (relu_f, relu_b, bias_act,
    add): any strides, the bodies for strided views and the reference of vec16's."""
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
    if vec16.applies(s, (x, y)):
        return vec16.relu_forward(x, y, s)
    generic_kernel(s, "relu_f")(x, y)


def relu_backward(x, dy, dx, s):
    if vec16.applies(s, (x, dy, dx)):
        return vec16.relu_backward(x, dy, dx, s)
    generic_kernel(s, "relu_b")(x, dy, dx)


def bias_act(y, s, bias=None, relu=False, nhwc=False):
    """In place on ``y`` (N, C, ...): the per-channel ``bias`` (float32) and a ReLU;
    ``nhwc``: ``y`` is held channels-last (the channel is the fastest axis)."""
    if bias is None and not relu:
        return y
    c = y.shape[1] if y.ndim > 1 else 1
    hw = 1 if nhwc else (int(np.prod(y.shape[2:])) if y.ndim > 2 else 1)
    mode = (1 if bias is not None else 0) | (2 if relu else 0)
    if vec16.applies(s, (y,), params=(bias,)):
        vec16.bias_act(y, s, bias, c, hw, mode)
        return y
    generic_kernel(s, "bias_act")(bias if bias is not None else _dummy(), c, hw, mode, y)
    return y


_DUMMY = []


def _dummy():
    if not _DUMMY:
        from ..core import backend
        _DUMMY.append(backend.gpu_module().zeros(1, dtype=np.float32))
    return _DUMMY[0]


def add(a, b, out, s, relu=False):
    """out = a + b (then max(., 0) with ``relu``), rounded once."""
    if vec16.applies(s, (a, b, out)):
        return vec16.add(a, b, out, s, relu)
    generic_kernel(s, "add")(a, b, np.int32(bool(relu)), out)


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
# are its channels-last counterpart, two passes over the map per direction:
# 1. ``mc_bn16v_sums``: each thread owns V adjacent channels (one 16-byte load of V = 8
#    2-byte words per row where C allows) and a fixed set of rows of its block's chunk;
#    it sums groups of U rows in fp32 registers and adds each group into float64; the
#    block's rows are summed by a tree of fixed shape in shared memory, written as the chunk's
#    partial; the last block of a column of chunks (an atomic count, reset after use)
#    sums the chunks in a fixed order (lanes of fixed chunks, then the lanes in order) and
#    writes the statistics (forward) or the gradient sums (backward): deterministic;
# 2. ``mc_bn16v_fwd`` / ``mc_bn16v_bwd``: one element-wise pass, the channel's parameters
#    in registers, U independent 16-byte loads in flight per thread.
# ``relu``: the ReLU after the affine batch norm fused in (fused type BatchNorm+Scale+ReLU,
# layers/fused.py): forward y = max(gamma x_hat + beta, 0) rounded as the ReLU of the stored
# value would be; backward masks dy where that stored y is not > 0 (a non-finite dy kept,
# as the ReLU's own backward does), recomputing y from x with the forward's arithmetic.
_BN16V = r"""
#if MC_V == 8
typedef uint4 mc_vec;
#elif MC_V == 4
typedef uint2 mc_vec;
#elif MC_V == 2
typedef unsigned int mc_vec;
#else
typedef unsigned short mc_vec;
#endif
#define MC_U (MC_V >= 8 ? 4 : 8)
#define MC_TPB 256
union mc_pack { mc_vec v; unsigned short h[MC_V]; };

#if MC_BF16
#define MC_PINF 0x7f80u
#else
#define MC_PINF 0x7c00u
#endif
// the stored word of ReLU(y): kept where y > 0 or NaN (the ReLU's rule), else +0
__device__ __forceinline__ unsigned short mc_relu16(unsigned short h) {
  return ((h != 0 && h <= MC_PINF) || (h & 0x7fffu) > MC_PINF) ? h : (unsigned short)0;
}
// the ReLU's backward on the stored y (> 0), a non-finite dy kept
__device__ __forceinline__ float mc_relu_grad(unsigned short h, float d) {
  return ((h != 0 && h <= MC_PINF) ||
          (__float_as_uint(d) & 0x7f800000u) == 0x7f800000u) ? d : 0.0f;
}

// mode 0: sums of x and x^2, then mean, 1/sqrt(var + eps), and for Caffe's running sums
// the mean and the unbiased variance (o1..o4); mode 1: sums of dy and dy x_hat (o1, o2)
// and the parameters' gradients (added into, or written over: acc); mode 2: mode 1 with
// dy masked by the fused ReLU (g, bt: the affine parameters)
extern "C" __global__ void __launch_bounds__(256, 2) mc_bn16v_sums(
    const mc_vec* __restrict__ x, const mc_vec* __restrict__ dy, long long M, int C,
    long long rows, const float* __restrict__ mean, const float* __restrict__ inv,
    const float* __restrict__ g, const float* __restrict__ bt, double* p1, double* p2,
    unsigned int* count, double eps, float* o1, float* o2, float* o3, float* o4,
    float* dgamma, float* dbeta, int mode, int acc) {
  __shared__ double sa[MC_V * MC_TPB], sb[MC_V * MC_TPB];
  __shared__ int last;
  const int CV = C / MC_V;
  const int tx = threadIdx.x, ty = threadIdx.y, bx = blockDim.x, by = blockDim.y;
  const int nt = bx * by, tid = ty * bx + tx;
  const int cv = blockIdx.x * bx + tx;
  const long long r0 = (long long)blockIdx.y * rows;
  const long long r1 = min(M, r0 + rows);
  double a[MC_V], b[MC_V];
#pragma unroll
  for (int k = 0; k < MC_V; ++k) { a[k] = 0.0; b[k] = 0.0; }
  if (cv < CV) {
    float m[MC_V], iv[MC_V], gg[MC_V], be[MC_V];
#pragma unroll
    for (int k = 0; k < MC_V; ++k) {
      m[k] = mode ? mean[cv * MC_V + k] : 0.0f;
      iv[k] = mode ? inv[cv * MC_V + k] : 0.0f;
      gg[k] = mode == 2 ? g[cv * MC_V + k] : 0.0f;
      be[k] = mode == 2 ? bt[cv * MC_V + k] : 0.0f;
    }
    for (long long r = r0 + ty; r < r1; r += (long long)by * MC_U) {
      float fa[MC_V], fb[MC_V];
#pragma unroll
      for (int k = 0; k < MC_V; ++k) { fa[k] = 0.0f; fb[k] = 0.0f; }
      mc_pack px[MC_U], pd[MC_U];
#pragma unroll
      for (int j = 0; j < MC_U; ++j) {
        const long long rr = r + (long long)j * by;
        if (rr < r1) {
          px[j].v = x[rr * CV + cv];
          if (mode) pd[j].v = dy[rr * CV + cv];
        }
      }
#pragma unroll
      for (int j = 0; j < MC_U; ++j) {
        if (r + (long long)j * by < r1) {
#pragma unroll
          for (int k = 0; k < MC_V; ++k) {
            const float v = mc_load(px[j].h[k]);
            if (mode == 0) { fa[k] += v; fb[k] += v * v; }
            else {
              const float xh = (v - m[k]) * iv[k];
              float d = mc_load(pd[j].h[k]);
              if (mode == 2) d = mc_relu_grad(mc_st(xh * gg[k] + be[k]), d);
              fa[k] += d; fb[k] += d * xh;
            }
          }
        }
      }
#pragma unroll
      for (int k = 0; k < MC_V; ++k) { a[k] += (double)fa[k]; b[k] += (double)fb[k]; }
    }
  }
#pragma unroll
  for (int k = 0; k < MC_V; ++k) { sa[k * MC_TPB + tid] = a[k]; sb[k * MC_TPB + tid] = b[k]; }
  __syncthreads();
  // the block's rows: a tree of fixed shape over ty (row ty + h into row ty)
  int h = 1;
  while (h < by) h <<= 1;
  for (h >>= 1; h > 0; h >>= 1) {
    if (ty < h && ty + h < by) {
#pragma unroll
      for (int k = 0; k < MC_V; ++k) {
        a[k] += sa[k * MC_TPB + tid + h * bx]; b[k] += sb[k * MC_TPB + tid + h * bx];
        sa[k * MC_TPB + tid] = a[k]; sb[k * MC_TPB + tid] = b[k];
      }
    }
    __syncthreads();
  }
  if (ty == 0 && cv < CV) {
#pragma unroll
    for (int k = 0; k < MC_V; ++k) {
      p1[(long long)blockIdx.y * C + cv * MC_V + k] = a[k];
      p2[(long long)blockIdx.y * C + cv * MC_V + k] = b[k];
    }
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) last = atomicAdd(&count[blockIdx.x], 1u) == gridDim.y - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  // the last block of this column: the chunks' sums per channel in a fixed order
  const int c_lo = blockIdx.x * bx * MC_V;
  const int nc = min(C, c_lo + bx * MC_V) - c_lo;
  const int L = nc >= nt ? 1 : nt / nc, per = nt / L;
  const int chunks = gridDim.y;
  for (int base = 0; base < nc; base += per) {
    const int j = base + tid % per, l = tid / per;
    double s1 = 0.0, s2 = 0.0;
    if (j < nc && l < L) {      // four running sums of fixed chunks, loads in flight
      const double* q1 = p1 + c_lo + j;
      const double* q2 = p2 + c_lo + j;
      double a0 = 0, a1 = 0, a2 = 0, a3 = 0, b0 = 0, b1 = 0, b2 = 0, b3 = 0;
      int k = l;
      for (; k + 3 * L < chunks; k += 4 * L) {
        a0 += __ldcg(q1 + (long long)k * C); a1 += __ldcg(q1 + (long long)(k + L) * C);
        a2 += __ldcg(q1 + (long long)(k + 2 * L) * C);
        a3 += __ldcg(q1 + (long long)(k + 3 * L) * C);
        b0 += __ldcg(q2 + (long long)k * C); b1 += __ldcg(q2 + (long long)(k + L) * C);
        b2 += __ldcg(q2 + (long long)(k + 2 * L) * C);
        b3 += __ldcg(q2 + (long long)(k + 3 * L) * C);
      }
      for (; k < chunks; k += L) {
        a0 += __ldcg(q1 + (long long)k * C); b0 += __ldcg(q2 + (long long)k * C);
      }
      s1 = (a0 + a1) + (a2 + a3); s2 = (b0 + b1) + (b2 + b3);
    }
    __syncthreads();
    sa[tid] = s1; sb[tid] = s2;
    __syncthreads();
    if (l == 0 && j < nc) {
      for (int t = 1; t < L; ++t) { s1 += sa[t * per + tid]; s2 += sb[t * per + tid]; }
      const int c = c_lo + j;
      if (mode == 0) {
        const double mu = s1 / (double)M;
        double var = s2 / (double)M - mu * mu;
        if (var < 0) var = 0;
        o1[c] = (float)mu; o2[c] = (float)(1.0 / sqrt(var + eps));
        o3[c] = (float)mu; o4[c] = (float)(M > 1 ? var * (double)M / (double)(M - 1) : var);
      } else {
        o1[c] = (float)s1; o2[c] = (float)s2;
        if (dgamma) dgamma[c] = (acc ? dgamma[c] : 0.0f) + (float)s2;
        if (dbeta) dbeta[c] = (acc ? dbeta[c] : 0.0f) + (float)s1;
      }
    }
  }
  if (tid == 0) count[blockIdx.x] = 0u;
}

// y = (x - mean) inv g + b [ReLU], rounded once
extern "C" __global__ void __launch_bounds__(256, 2) mc_bn16v_fwd(
    const mc_vec* __restrict__ x, mc_vec* __restrict__ y, long long M, int C,
    const float* __restrict__ mean, const float* __restrict__ inv,
    const float* __restrict__ g, const float* __restrict__ bt, int relu) {
  const int CV = C / MC_V;
  const int cv = blockIdx.x * blockDim.x + threadIdx.x;
  if (cv >= CV) return;
  float m[MC_V], iv[MC_V], gg[MC_V], be[MC_V];
#pragma unroll
  for (int k = 0; k < MC_V; ++k) {
    m[k] = mean[cv * MC_V + k]; iv[k] = inv[cv * MC_V + k];
    gg[k] = g[cv * MC_V + k]; be[k] = bt[cv * MC_V + k];
  }
  const long long S = (long long)gridDim.y * blockDim.y;
  for (long long r = (long long)blockIdx.y * blockDim.y + threadIdx.y; r < M; r += S * MC_U) {
    mc_pack px[MC_U];
#pragma unroll
    for (int j = 0; j < MC_U; ++j)
      if (r + j * S < M) px[j].v = x[(r + j * S) * CV + cv];
#pragma unroll
    for (int j = 0; j < MC_U; ++j) {
      if (r + j * S < M) {
        mc_pack py;
#pragma unroll
        for (int k = 0; k < MC_V; ++k) {
          const unsigned short h = mc_st((mc_load(px[j].h[k]) - m[k]) * iv[k] * gg[k] + be[k]);
          py.h[k] = relu ? mc_relu16(h) : h;
        }
        y[(r + j * S) * CV + cv] = py.v;
      }
    }
  }
}

// dx = g inv (dy - mean(dy) - x_hat mean(dy x_hat)), dy masked by the fused ReLU (relu)
extern "C" __global__ void __launch_bounds__(256, 2) mc_bn16v_bwd(
    const mc_vec* __restrict__ x, const mc_vec* __restrict__ dy, mc_vec* __restrict__ dx,
    long long M, int C, const float* __restrict__ mean, const float* __restrict__ inv,
    const float* __restrict__ g, const float* __restrict__ bt, const float* __restrict__ sdy,
    const float* __restrict__ sdyx, float rm, int relu) {
  const int CV = C / MC_V;
  const int cv = blockIdx.x * blockDim.x + threadIdx.x;
  if (cv >= CV) return;
  float m[MC_V], iv[MC_V], gg[MC_V], be[MC_V], gi[MC_V], a1[MC_V], a2[MC_V];
#pragma unroll
  for (int k = 0; k < MC_V; ++k) {
    const int c = cv * MC_V + k;
    m[k] = mean[c]; iv[k] = inv[c]; gg[k] = g[c]; be[k] = relu ? bt[c] : 0.0f;
    gi[k] = g[c] * inv[c]; a1[k] = rm * sdy[c]; a2[k] = sdyx[c];
  }
  const long long S = (long long)gridDim.y * blockDim.y;
  for (long long r = (long long)blockIdx.y * blockDim.y + threadIdx.y; r < M; r += S * MC_U) {
    mc_pack px[MC_U], pd[MC_U];
#pragma unroll
    for (int j = 0; j < MC_U; ++j)
      if (r + j * S < M) {
        px[j].v = x[(r + j * S) * CV + cv];
        pd[j].v = dy[(r + j * S) * CV + cv];
      }
#pragma unroll
    for (int j = 0; j < MC_U; ++j) {
      if (r + j * S < M) {
        mc_pack po;
#pragma unroll
        for (int k = 0; k < MC_V; ++k) {
          const float xh = (mc_load(px[j].h[k]) - m[k]) * iv[k];
          float d = mc_load(pd[j].h[k]);
          if (relu) d = mc_relu_grad(mc_st(xh * gg[k] + be[k]), d);
          po.h[k] = mc_st(gi[k] * (d - a1[k] - rm * xh * a2[k]));
        }
        dx[(r + j * S) * CV + cv] = po.v;
      }
    }
  }
}
"""


def _bn16_kernels(s, V):
    src = (f"#define MC_BF16 {1 if s == P.BFLOAT16 else 0}\n#define MC_V {V}\n" + _H2F +
           vec16.ST16 + _BN16V)
    return tuple(raw_kernel(src, n, "float") for n in ("mc_bn16v_sums", "mc_bn16v_fwd",
                                                       "mc_bn16v_bwd"))


_SMS = 132          # blocks of the sums pass: about two per SM of an H100


def _bn16_geometry(M, C, V):
    """(block (tx, ty), column blocks, chunks of rows, rows per chunk, apply's row blocks)
    for V channels per thread: 256 threads, at most 8 channel vectors across (a column
    of blocks covers 64 channels: its last block sums few partials)."""
    cv = C // V
    tx = min(cv, 8)
    ty = max(1, 256 // tx)
    gx = -(-cv // tx)
    chunks = max(1, min(-(-2 * _SMS // gx), -(-M // (ty * 16))))
    rows = -(-M // chunks)
    chunks = -(-M // rows)
    gy = max(1, min(65535, -(-M // (ty * 8))))
    return (tx, ty), gx, chunks, rows, gy


def _bn16_vector(C, *arrays):
    """Channels per thread: 8, 4, 2 or 1, the most that divide C with every array's
    address aligned to the vector."""
    v = 8
    while v > 1 and (C % v or any(a.data.ptr % (2 * v) for a in arrays)):
        v //= 2
    return v


def bn_work_size(M, C):
    """float64 words of the scratch the channels-last batch norm takes for [M, C] maps
    (the chunks' partial sums and the columns' counters; zeroed once when made)."""
    n = max(_bn16_geometry(M, C, v)[2] for v in (1, 2, 4, 8) if C % v == 0)
    return C + 2 * n * C


def _bn16_sums(s, x, dy, M, C, V, work, mean, inv, g, bt, eps, outs, dgamma, dbeta, mode,
               acc):
    block, gx, chunks, rows, _ = _bn16_geometry(M, C, V)
    n = chunks * C
    count = work[:C].view(np.uint32)
    p1, p2 = work[C:C + n], work[C + n:C + 2 * n]
    _bn16_kernels(s, V)[0](
        (gx, chunks), block,
        (x.view(np.uint16), dy.view(np.uint16), np.int64(M), np.int32(C), np.int64(rows),
         mean, inv, g, bt, p1, p2, count, np.float64(eps), *outs, dgamma, dbeta,
         np.int32(mode), np.int32(int(bool(acc)))))


def bn_nhwc_forward(x, y, C, s, gamma, beta, eps, save_mean, save_inv, batch_mean,
                    batch_var, work, relu=False):
    """Training batch norm of the channels-last 2-byte ``x`` ([M, C] flat) into ``y``:
    the batch statistics (``save_mean``, ``save_inv`` = 1/sqrt(var + eps); ``batch_mean``,
    ``batch_var`` unbiased, what cuDNN's running average with factor 1 gives), then
    y = (x - mean) * inv * gamma + beta (``relu``: then max(., 0), as a ReLU of the stored
    y).  ``work``: float64 of ``bn_work_size``, zero when first used."""
    M = x.size // C
    V = _bn16_vector(C, x, y)
    block, gx, _, _, gy = _bn16_geometry(M, C, V)
    _bn16_sums(s, x, x, M, C, V, work, save_mean, save_inv, gamma, beta, eps,
               (save_mean, save_inv, batch_mean, batch_var), save_mean, save_mean, 0, False)
    _bn16_kernels(s, V)[1]((gx, gy), block, (x.view(np.uint16), y.view(np.uint16),
                                             np.int64(M), np.int32(C), save_mean, save_inv,
                                             gamma, beta, np.int32(int(bool(relu)))))


def bn_nhwc_backward(x, dy, dx, C, s, gamma, save_mean, save_inv, dgamma, dbeta, acc,
                     sums, work, beta=None, relu=False):
    """Its backward: dgamma (+)= sum dy x_hat, dbeta (+)= sum dy (``acc``: added into),
    dx = gamma inv (dy - mean(dy) - x_hat mean(dy x_hat)); ``sums``: float32 of 2 C;
    ``relu`` (with the forward's ``beta``): dy masked where the fused ReLU's stored output
    is not > 0 first."""
    M = x.size // C
    V = _bn16_vector(C, x, dy, dx)
    block, gx, _, _, gy = _bn16_geometry(M, C, V)
    sdy, sdyx = sums[:C], sums[C:2 * C]
    bt = beta if relu else gamma
    _bn16_sums(s, x, dy, M, C, V, work, save_mean, save_inv, gamma, bt, 0.0,
               (sdy, sdyx, sdy, sdyx), dgamma, dbeta, 2 if relu else 1, acc)
    _bn16_kernels(s, V)[2]((gx, gy), block, (x.view(np.uint16), dy.view(np.uint16),
                                             dx.view(np.uint16), np.int64(M), np.int32(C),
                                             save_mean, save_inv, gamma, bt, sdy, sdyx,
                                             np.float32(1.0 / M), np.int32(int(bool(relu)))))
