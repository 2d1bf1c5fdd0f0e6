"""Vectorised element-wise kernels and casts on 2-byte buffers (issue 20: bf16/fp16 at the
memory's bandwidth), the bodies behind kernels/reduced.py's ReLU, add and bias_act and
kernels/precision.py's casts when their arrays are C-contiguous.

Each kernel moves V = 8, 4, 2 or 1 elements per thread and step (at V = 8 one 16-byte
load or store of 2-byte words, two of fp32 words) in a grid-stride loop over the whole
vectors, then the n % V last elements: one launch.  V is the most every array's address
allows (a view at an odd offset takes less).  Per element the arithmetic is the generic
kernels' (the ElementwiseKernels of kernels/reduced.py and kernels/precision.py, kept for
strided views): the same fp32 operations in the same order under the same --fmad=false,
the same rounding (bf16: to nearest even by bits, a NaN made quiet; fp16: cvt.rn.f16.f32
and cvt.f32.f16, what CuPy's float16 conversions run), hence the same bits
(tests/test_reduced_kernels_gpu.py checks them against those kernels).

- ``relu_forward``, ``relu_backward``, ``add``, ``bias_act``, ``to_reduced``,
  ``from_reduced``: the contiguous bodies (``applies`` says when they take the arrays);
- ``to_reduced_t(x, out, s)``: ``x`` float32 (B, P, Q) -> ``out`` (B, Q, P) in the 2-byte
  type (the KCRS -> KRSC weight cast of a channels-last convolution, NCHW <-> NHWC maps);
  ``from_reduced_t(h, out, s, accumulate)``: its way back, into (or added into) fp32.
  Both through tiles in shared memory (a short axis, a weight's R*S, whole in each):
  reads and writes in runs of consecutive addresses.
"""
import functools

import numpy as np

from ..core import precision as P
from ._backend import raw_kernel

# the 2-byte word's fp32 value (exact; fp16 by the hardware's cvt): with MC_BF16 defined,
# for any kernel source (pool16.py's, conv16.py's)
LD16 = r"""__device__ __forceinline__ float mc_ld(unsigned short h) {
#if MC_BF16
  return __uint_as_float(((unsigned int)h) << 16);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#endif
}
"""

# the fp32 {v} -> its bf16 word, into {out}, to nearest even by bits (a NaN keeps its
# sign and payload, made quiet): one statement, for any kernel body (format it), the
# ElementwiseKernels' of reduced.py, precision.py and dropout.py included
BF16_STORE = """{{ unsigned int u_ = __float_as_uint({v});
  {out} = ((u_ & 0x7fffffffu) > 0x7f800000u) ? (unsigned short)((u_ >> 16) | 0x40u)
        : (unsigned short)((u_ + 0x7fffu + ((u_ >> 16) & 1u)) >> 16); }}"""

# fp32 -> the 2-byte word, to nearest even (bf16: BF16_STORE; fp16 by the hardware's
# cvt.rn): with MC_BF16 defined, for any kernel source (reduced.py's batch norm)
ST16 = r"""__device__ __forceinline__ unsigned short mc_st(float v) {
  unsigned short h;
#if MC_BF16
  """ + BF16_STORE.format(v="v", out="h") + r"""
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
#endif
  return h;
}
"""

# the fp32 v rounded in place to the 2-byte type's values, kept in fp32 (to nearest even;
# NaN and inf kept; fp16 by bits, no half type needed: subnormals on fp16's 2^-24 grid
# (rintf: ties to even), normals to 10 mantissa bits, beyond 65504: inf): statements for
# any kernel body, mc_round's here and precision.py's ElementwiseKernels'
ROUND_V = {P.BFLOAT16: """  const unsigned int u = __float_as_uint(v);
  if ((u & 0x7fffffffu) <= 0x7f800000u)
    v = __uint_as_float((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);""",
           P.FLOAT16: """  const float ax = fabsf(v);
  if (ax < 6.103515625e-05f) v = rintf(v * 16777216.0f) * 5.9604644775390625e-08f;
  else if (ax <= 3.402823466e+38f) {
    const unsigned int u = __float_as_uint(v);
    const float r = __uint_as_float((u + 0xfffu + ((u >> 13) & 1u)) & 0xffffe000u);
    v = fabsf(r) > 65504.0f ? copysignf(__int_as_float(0x7f800000), v) : r;
  }"""}

_SRC = r"""
#if MC_V == 8
typedef uint4 mc_hv;
struct __align__(16) mc_fv { float4 a, b; };
#elif MC_V == 4
typedef uint2 mc_hv;
typedef float4 mc_fv;
#elif MC_V == 2
typedef unsigned int mc_hv;
typedef float2 mc_fv;
#else
typedef unsigned short mc_hv;
typedef float mc_fv;
#endif
union mc_h { mc_hv v; unsigned short w[MC_V]; };
union mc_f { mc_fv v; float f[MC_V]; };

""" + LD16 + ST16 + r"""// v rounded to the 2-byte type's values, kept in fp32 (ROUND_V)
__device__ __forceinline__ float mc_round(float v) {
#if MC_BF16
""" + ROUND_V[P.BFLOAT16] + r"""
#else
""" + ROUND_V[P.FLOAT16] + r"""
#endif
  return v;
}

// v > 0 where v may be an fp32 subnormal (a bf16 subnormal word, widened): 1 the
// flush-to-zero compare (a subnormal is not > 0), 2 IEEE's (it is).  CuPy compiles every
// kernel with -ftz=true, yet what the compiler makes of a written "v > 0.0f" differs
// between compilations (benchmarks/ew16_bits.py, H100: main's contiguous generic bias_act
// keeps positive subnormals, its 2-D strided one and a 1-wide vec16 one flushed them), so
// each body pins the compare the generic kernel on contiguous arrays gave: ReLU forward
// and backward, add and from_reduced flush, bias_act does not.  MC_CMP (set, the probe's
// override) pins them all one way; 0: as written.
#ifdef MC_CMP
#define MC_CMP_RELU MC_CMP
#define MC_CMP_ADD MC_CMP
#define MC_CMP_BIAS MC_CMP
#define MC_CMP_FROM MC_CMP
#else
#define MC_CMP_RELU 1
#define MC_CMP_ADD 1
#define MC_CMP_BIAS 2
#define MC_CMP_FROM 1
#endif
template <int K> __device__ __forceinline__ bool mc_pos(float v) {
  if (K == 1) {
    unsigned int r;
    asm("{\n .reg .pred p;\n setp.gt.ftz.f32 p, %1, 0f00000000;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(r) : "f"(v));
    return r != 0u;
  }
  if (K == 2) {
    unsigned int r;
    asm("{\n .reg .pred p;\n setp.gt.f32 p, %1, 0f00000000;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(r) : "f"(v));
    return r != 0u;
  }
  return v > 0.0f;
}

// the per-element operations (the generic kernels' bodies)
__device__ __forceinline__ unsigned short mc_relu_f(unsigned short x) {
  const float v = mc_ld(x);
  return (mc_pos<MC_CMP_RELU>(v) || v != v) ? x : (unsigned short)0;
}
__device__ __forceinline__ unsigned short mc_relu_b(unsigned short x, unsigned short dy) {
  const float d = mc_ld(dy);
  return (mc_pos<MC_CMP_RELU>(mc_ld(x)) || !isfinite(d)) ? dy : (unsigned short)0;
}
__device__ __forceinline__ unsigned short mc_add(unsigned short a, unsigned short b,
                                                 int relu) {
  float v = mc_ld(a) + mc_ld(b);
  if (relu && !mc_pos<MC_CMP_ADD>(v)) v = 0.0f;
  return mc_st(v);
}
__device__ __forceinline__ unsigned short mc_bias_act(unsigned short y, const float* b,
                                                      long long ch, int mode) {
  float v = mc_ld(y);
  if (mode & 1) v += b[ch];
  if (mode & 2) v = mc_pos<MC_CMP_BIAS>(v) ? v : 0.0f;
  return mc_st(v);
}
__device__ __forceinline__ void mc_from(unsigned short h, float& y, const float* b,
                                        long long ch, int mode) {
  float v = mc_ld(h);
  if (mode & 1) v += b[ch];
  if (mode & 2) v = mc_pos<MC_CMP_FROM>(v) ? v : 0.0f;
  if (mode & 8) v = mc_round(v);
  if (mode & 4) y += v; else y = v;
}

// the channel (i / hw) % c of flat index i and i's place in its plane; 32-bit division
// where the sizes allow
__device__ __forceinline__ void mc_chan(long long i, long long hw, long long c,
                                        long long& r, long long& ch) {
  if (i < 2147483648LL && hw < 2147483648LL && c < 2147483648LL) {
    const unsigned int q = (unsigned int)i / (unsigned int)hw;
    r = (long long)((unsigned int)i - q * (unsigned int)hw);
    ch = (long long)(q % (unsigned int)c);
  } else {
    const long long q = i / hw;
    r = i - q * hw;
    ch = q % c;
  }
}
__device__ __forceinline__ void mc_chan_next(long long hw, long long c, long long& r,
                                             long long& ch) {
  if (++r == hw) { r = 0; if (++ch == c) ch = 0; }
}

#define MC_VECTORS(v) \
  const long long nv_ = n / MC_V, st_ = (long long)gridDim.x * blockDim.x; \
  for (long long v = (long long)blockIdx.x * blockDim.x + threadIdx.x; v < nv_; v += st_)
#define MC_TAIL(t) \
  for (long long t = nv_ * MC_V + (long long)blockIdx.x * blockDim.x + threadIdx.x; \
       t < n; t += st_)

extern "C" __global__ void mc_v16_relu_f(const mc_hv* x, mc_hv* y, long long n) {
  MC_VECTORS(v) {
    mc_h a, o;
    a.v = x[v];
#pragma unroll
    for (int k = 0; k < MC_V; ++k) o.w[k] = mc_relu_f(a.w[k]);
    y[v] = o.v;
  }
  MC_TAIL(t) ((unsigned short*)y)[t] = mc_relu_f(((const unsigned short*)x)[t]);
}

extern "C" __global__ void mc_v16_relu_b(const mc_hv* x, const mc_hv* dy, mc_hv* dx,
                                         long long n) {
  MC_VECTORS(v) {
    mc_h a, d, o;
    a.v = x[v];
    d.v = dy[v];
#pragma unroll
    for (int k = 0; k < MC_V; ++k) o.w[k] = mc_relu_b(a.w[k], d.w[k]);
    dx[v] = o.v;
  }
  MC_TAIL(t) ((unsigned short*)dx)[t] = mc_relu_b(((const unsigned short*)x)[t],
                                                  ((const unsigned short*)dy)[t]);
}

extern "C" __global__ void mc_v16_add(const mc_hv* a, const mc_hv* b, mc_hv* y, long long n,
                                      int relu) {
  MC_VECTORS(v) {
    mc_h p, q, o;
    p.v = a[v];
    q.v = b[v];
#pragma unroll
    for (int k = 0; k < MC_V; ++k) o.w[k] = mc_add(p.w[k], q.w[k], relu);
    y[v] = o.v;
  }
  MC_TAIL(t) ((unsigned short*)y)[t] = mc_add(((const unsigned short*)a)[t],
                                              ((const unsigned short*)b)[t], relu);
}

extern "C" __global__ void mc_v16_bias_act(mc_hv* y, const float* b, long long n, long long c,
                                           long long hw, int mode) {
  MC_VECTORS(v) {
    long long r = 0, ch = 0;
    if (mode & 1) mc_chan(v * MC_V, hw, c, r, ch);
    mc_h p;
    p.v = y[v];
#pragma unroll
    for (int k = 0; k < MC_V; ++k) {
      p.w[k] = mc_bias_act(p.w[k], b, ch, mode);
      if (mode & 1) mc_chan_next(hw, c, r, ch);
    }
    y[v] = p.v;
  }
  MC_TAIL(t) {
    long long r = 0, ch = 0;
    if (mode & 1) mc_chan(t, hw, c, r, ch);
    ((unsigned short*)y)[t] = mc_bias_act(((unsigned short*)y)[t], b, ch, mode);
  }
}

extern "C" __global__ void mc_v16_to(const mc_fv* x, mc_hv* y, long long n) {
  MC_VECTORS(v) {
    mc_f a;
    mc_h o;
    a.v = x[v];
#pragma unroll
    for (int k = 0; k < MC_V; ++k) o.w[k] = mc_st(a.f[k]);
    y[v] = o.v;
  }
  MC_TAIL(t) ((unsigned short*)y)[t] = mc_st(((const float*)x)[t]);
}

extern "C" __global__ void mc_v16_from(const mc_hv* h, mc_fv* y, const float* b, long long n,
                                       long long c, long long hw, int mode) {
  MC_VECTORS(v) {
    long long r = 0, ch = 0;
    if (mode & 1) mc_chan(v * MC_V, hw, c, r, ch);
    mc_h p;
    mc_f o;
    p.v = h[v];
    if (mode & 4) o.v = y[v];
#pragma unroll
    for (int k = 0; k < MC_V; ++k) {
      mc_from(p.w[k], o.f[k], b, ch, mode);
      if (mode & 1) mc_chan_next(hw, c, r, ch);
    }
    y[v] = o.v;
  }
  MC_TAIL(t) {
    long long r = 0, ch = 0;
    if (mode & 1) mc_chan(t, hw, c, r, ch);
    mc_from(((const unsigned short*)h)[t], ((float*)y)[t], b, ch, mode);
  }
}

// batched transposes x (B, P, Q) -> y (B, Q, P) through a tile of Lp x Lq <= 1024 elements
// in shared memory, rows of an odd pitch (Lp (Lq | 1) <= MC_TILE; a short axis whole: a
// KCRS weight's RS, a KRSC one's): 256 threads, 4 elements each (loads in flight), read in
// x's order, written in y's, both in runs of consecutive addresses, no bank conflicts
#define MC_TILE 1056
#define MC_TILE_LOOP(P_, Q_, N_, BODY)                                             \
  {                                                                                 \
    int P_ = threadIdx.x / N_, Q_ = threadIdx.x - P_ * N_;                          \
    const int dp_ = blockDim.x / N_, dq_ = blockDim.x - dp_ * N_;                   \
    _Pragma("unroll")                                                               \
    for (int k_ = 0; k_ < 4; ++k_) {                                                \
      if (threadIdx.x + k_ * blockDim.x < m) { BODY; }                              \
      P_ += dp_; Q_ += dq_;                                                         \
      if (Q_ >= N_) { Q_ -= N_; ++P_; }                                             \
    }                                                                               \
  }

extern "C" __global__ void __launch_bounds__(256) mc_t16_to(
    const float* __restrict__ x, unsigned short* __restrict__ y, int B, int P, int Q, int Lp,
    int Lq) {
  __shared__ float t[MC_TILE];
  const int p0 = blockIdx.y * Lp, q0 = blockIdx.x * Lq;
  const int np = min(Lp, P - p0), nq = min(Lq, Q - q0), m = np * nq, pitch = nq | 1;
  const long long PQ = (long long)P * Q;
  for (long long b = blockIdx.z; b < B; b += gridDim.z) {
    const float* xb = x + b * PQ + (long long)p0 * Q + q0;
    MC_TILE_LOOP(p, q, nq, t[p * pitch + q] = xb[(long long)p * Q + q])
    __syncthreads();
    unsigned short* yb = y + b * PQ + (long long)q0 * P + p0;
    MC_TILE_LOOP(q, p, np, yb[(long long)q * P + p] = mc_st(t[p * pitch + q]))
    __syncthreads();
  }
}

// h (B, P, Q) 2-byte -> y (B, Q, P) fp32: y = v, or y += v (acc)
extern "C" __global__ void __launch_bounds__(256) mc_t16_from(
    const unsigned short* __restrict__ h, float* __restrict__ y, int B, int P, int Q, int Lp,
    int Lq, int acc) {
  __shared__ float t[MC_TILE];
  const int p0 = blockIdx.y * Lp, q0 = blockIdx.x * Lq;
  const int np = min(Lp, P - p0), nq = min(Lq, Q - q0), m = np * nq, pitch = nq | 1;
  const long long PQ = (long long)P * Q;
  for (long long b = blockIdx.z; b < B; b += gridDim.z) {
    const unsigned short* hb = h + b * PQ + (long long)p0 * Q + q0;
    MC_TILE_LOOP(p, q, nq, t[p * pitch + q] = mc_ld(hb[(long long)p * Q + q]))
    __syncthreads();
    float* yb = y + b * PQ + (long long)q0 * P + p0;
    MC_TILE_LOOP(q, p, np, {
      float& o = yb[(long long)q * P + p];
      if (acc) o += t[p * pitch + q]; else o = t[p * pitch + q];
    })
    __syncthreads();
  }
}
"""

_THREADS = 256
_MAX_BLOCKS = 2048          # about 16 resident blocks' worth per SM of an H100: grid-stride


@functools.lru_cache(maxsize=None)
def _fn(s, v, name):
    src = f"#define MC_BF16 {1 if s == P.BFLOAT16 else 0}\n#define MC_V {v}\n" + _SRC
    return raw_kernel(src, name, "float")


def applies(s, halves, floats=(), params=()):
    """True when the vector bodies take these arrays: every one C-contiguous, the 2-byte
    ones (``halves``) of ``s``'s buffer dtype, the fp32 ones (``floats``, and ``params``:
    per-channel values, None for none) float32, and the halves and floats of one size."""
    n = halves[0].size
    bt = P.buffer_dtype(s)
    return all(a.flags.c_contiguous and a.size == n and a.dtype == bt for a in halves) and \
        all(a.flags.c_contiguous and a.size == n and a.dtype == np.float32 for a in floats) \
        and all(a is None or (a.flags.c_contiguous and a.dtype == np.float32) for a in params)


def _width(*arrays):
    """Elements per thread: 8, 4, 2 or 1, the most every address is aligned for (16 bytes
    at most per access)."""
    v = 8
    while v > 1 and any(a.data.ptr % min(16, v * a.itemsize) for a in arrays):
        v //= 2
    return v


def _launch(s, name, n, arrays, args):
    if n == 0:
        return
    v = _width(*arrays)
    blocks = max(1, min(_MAX_BLOCKS, -(-max(n // v, 1) // _THREADS)))
    _fn(s, v, name)((blocks,), (_THREADS,), args)


def _words(a):
    return a.view(np.uint16) if a.dtype != np.uint16 else a


def relu_forward(x, y, s):
    _launch(s, "mc_v16_relu_f", x.size, (x, y), (_words(x), _words(y), np.int64(x.size)))


def relu_backward(x, dy, dx, s):
    _launch(s, "mc_v16_relu_b", x.size, (x, dy, dx),
            (_words(x), _words(dy), _words(dx), np.int64(x.size)))


def add(a, b, out, s, relu=False):
    _launch(s, "mc_v16_add", a.size, (a, b, out),
            (_words(a), _words(b), _words(out), np.int64(a.size), np.int32(bool(relu))))


def bias_act(y, s, bias, c, hw, mode):
    """In place: y = [max](y + bias[(i / hw) % c], 0) by ``mode`` (1: bias, 2: ReLU)."""
    _launch(s, "mc_v16_bias_act", y.size, (y,),
            (_words(y), bias if bias is not None else y, np.int64(y.size), np.int64(c),
             np.int64(hw), np.int32(mode)))


def to_reduced(x, out, s):
    _launch(s, "mc_v16_to", x.size, (x, out), (x, _words(out), np.int64(x.size)))


def from_reduced(h, out, s, bias, c, hw, mode):
    """out (float32) from the 2-byte ``h``: + bias[(i / hw) % c] (mode 1), ReLU (2),
    rounded to the type's values (8), added into ``out`` (4)."""
    _launch(s, "mc_v16_from", h.size, (h, out),
            (_words(h), out, bias if bias is not None else out, np.int64(h.size),
             np.int64(c), np.int64(hw), np.int32(mode)))


_TILE = 1024                # elements of a transpose's tile (4 per thread of 256); with
                            # the odd pitch at most MC_TILE = 1056 floats of shared memory


def _tiles(B, Pn, Q):
    """(grid, block, (Lp, Lq)): a short axis (<= 32) whole in each tile, else 32 x 32;
    Lp Lq <= _TILE and Lp (Lq | 1) <= 1056."""
    if Q <= 32:
        lp, lq = min(Pn, _TILE // (Q | 1)), Q
    elif Pn <= 32:
        lp, lq = Pn, min(Q, _TILE // Pn - 1)
    else:
        lp = lq = 32
    return (-(-Q // lq), -(-Pn // lp), max(1, min(B, 65535))), (256,), \
        (np.int32(lp), np.int32(lq))


def _transpose(s, name, src, out, halves, floats, extra=()):
    B, Pn, Q = src.shape
    if src.size == 0:
        return out
    if not (applies(s, halves, floats) and out.shape == (B, Q, Pn)):
        raise ValueError(f"{name}: contiguous (B, P, Q) -> (B, Q, P), got {src.shape} "
                         f"-> {out.shape}")
    grid, block, tile = _tiles(B, Pn, Q)
    _fn(s, 1, "mc_t16_" + name.split("_")[0])(
        grid, block, (_words(src) if src.dtype != np.float32 else src,
                      _words(out) if out.dtype != np.float32 else out,
                      np.int32(B), np.int32(Pn), np.int32(Q), *tile, *extra))
    return out


def to_reduced_t(x, out, s):
    """``out`` (B, Q, P), 2-byte, = the float32 ``x`` (B, P, Q) transposed, rounded."""
    return _transpose(s, "to_reduced_t", x, out, (out,), (x,))


def from_reduced_t(h, out, s, accumulate=False):
    """``out`` (B, Q, P), float32, = (or += with ``accumulate``) the 2-byte ``h`` (B, P, Q)
    transposed (exact: every 2-byte value is an fp32 one)."""
    return _transpose(s, "from_reduced_t", h, out, (h,), (out,),
                      (np.int32(bool(accumulate)),))
