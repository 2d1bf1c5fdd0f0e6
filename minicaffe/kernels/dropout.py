"""Dropout's mask from a counter-based generator (Philox4x32-10), on the GPU.

cuRAND's host API cannot be captured in a CUDA graph, and a stored mask costs memory.
Philox maps (key, counter) to random bits with no state: element i of forward pass k
draws philox(counter = (i, k), key = the layer's seed).  The layer keeps k in device
memory; forward uses it and a second kernel increments it, so a replayed graph draws a
new mask every iteration, and backward recomputes the same mask from (i, k - 1)
instead of reading a saved one.  Keep rule as Caffe's: keep when bits > UINT_MAX * ratio.  ``dropout16`` does the same
on 2-byte buffers (bfloat16 words, float16; real 16-bit storage): fp32 product, one
rounding on store.
"""
import numpy as np

from ._backend import cuda_type, raw_kernel

_SRC = r"""
__device__ __forceinline__ unsigned int mc_mulhi(unsigned int a, unsigned int b) {
  return __umulhi(a, b);
}
// Philox4x32-10 (Salmon et al., 2011), first output word
__device__ __forceinline__ unsigned int mc_philox(unsigned long long idx, unsigned long long pass,
                                                  unsigned int k0, unsigned int k1) {
  unsigned int c0 = (unsigned int)idx, c1 = (unsigned int)(idx >> 32);
  unsigned int c2 = (unsigned int)pass, c3 = (unsigned int)(pass >> 32);
  #pragma unroll
  for (int r = 0; r < 10; ++r) {
    unsigned int hi0 = mc_mulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    unsigned int hi1 = mc_mulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    unsigned int n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
    k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
  }
  return c0;
}

extern "C" __global__ void mc_dropout(const T* x, T* y, long long n, unsigned int k0,
                                      unsigned int k1, const long long* pass, long long delta,
                                      unsigned int threshold, T scale) {
  const unsigned long long k = (unsigned long long)(*pass + delta);
  CUDA_KERNEL_LOOP(i, n) {
    y[i] = mc_philox((unsigned long long)i, k, k0, k1) > threshold ? x[i] * scale : (T)0;
  }
}

extern "C" __global__ void mc_pass_increment(long long* pass) {
  if (threadIdx.x == 0 && blockIdx.x == 0) *pass += 1;
}

// the bits themselves, for tests
extern "C" __global__ void mc_philox_bits(unsigned int* out, long long n, unsigned int k0,
                                          unsigned int k1, long long pass) {
  CUDA_KERNEL_LOOP(i, n) { out[i] = mc_philox((unsigned long long)i, (unsigned long long)pass, k0, k1); }
}
"""


def threshold(ratio):
    """Caffe's ``uint_thres_``: keep an element when its bits exceed it."""
    return np.uint32(min(int(4294967295 * float(ratio)), 4294967295))


def dropout(x, y, seed, pass_counter, ratio, scale, backward=False):
    """y = x * scale where the bits of (element, pass) exceed the threshold, else 0.
    Forward uses the current pass and then advances it; backward (``backward=True``)
    redraws the mask of the pass forward last used."""
    from ._backend import launch
    k = raw_kernel(_SRC, "mc_dropout", cuda_type(x.dtype))
    launch(k, x.size, (x, y, np.int64(x.size), np.uint32(seed & 0xFFFFFFFF),
                       np.uint32((seed >> 32) & 0xFFFFFFFF), pass_counter,
                       np.int64(-1 if backward else 0), threshold(ratio), x.dtype.type(scale)))
    if not backward:
        raw_kernel(_SRC, "mc_pass_increment", cuda_type(x.dtype))((1,), (1,), (pass_counter,))


def philox_bits(cp, n, seed, pass_index):
    from ._backend import launch
    out = cp.empty(n, dtype=np.uint32)
    launch(raw_kernel(_SRC, "mc_philox_bits", "float"), n,
           (out, np.int64(n), np.uint32(seed & 0xFFFFFFFF), np.uint32((seed >> 32) & 0xFFFFFFFF),
            np.int64(pass_index)))
    return out


_PHILOX = _SRC.split("extern")[0]


def dropout16(x, y, seed, pass_counter, ratio, scale, storage, backward=False):
    """``dropout`` on 2-byte ``x``, ``y`` of ``storage`` (FLOAT16, BFLOAT16)."""
    from ._backend import _cupy, NVRTC_OPTIONS
    from . import reduced
    k = _K16.get(storage)
    if k is None:
        t, load, store = (reduced._TYPE[storage], reduced._LOAD[storage],
                          reduced._STORE[storage])
        k = _K16[storage] = _cupy().ElementwiseKernel(
            f"{t} x, raw int64 pass, int64 delta, uint32 k0, uint32 k1, uint32 thr, "
            "float32 scale", f"{t} y",
            "const unsigned long long kk = (unsigned long long)(pass[0] + delta);\n"
            f"float v = {load.format(x='x')};\n"
            "v = mc_philox((unsigned long long)i, kk, k0, k1) > thr ? v * scale : 0.0f;\n"
            + store.format(v="v", out="y"), f"mc_dropout16_{t}", preamble=_PHILOX,
            options=NVRTC_OPTIONS)
    k(x, pass_counter, np.int64(-1 if backward else 0), np.uint32(seed & 0xFFFFFFFF),
      np.uint32((seed >> 32) & 0xFFFFFFFF), threshold(ratio), np.float32(scale), y)
    if not backward:
        raw_kernel(_SRC, "mc_pass_increment", "float")((1,), (1,), (pass_counter,))


_K16 = {}
