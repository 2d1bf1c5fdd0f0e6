"""Per-channel sums on the GPU, deterministic: a bias gradient db[c] (+)= sum over n and
the spatial axes of dy[n, c, ...].

cuDNN's ConvolutionBackwardBias took 25-50 us for LeNet's and CIFAR-10's small
convolutions on an H100 (benchmarks/profile_kernels.py), several times what reading dy
costs.  Here: stage 1 gives each (channel, slice of the batch) one block, which walks
its rows with coalesced loads (whole rows when a row is at least a block wide, several
rows at once when it is narrower) and writes one partial sum; stage 2 adds a channel's
partials in order.  Fixed partitions and orders: the same bits every run.
"""
import numpy as np

from ._backend import cuda_type, raw_kernel

_SRC = r"""
// dy's element type and how one is read: T by default; kernels/reduced.py's 2-byte
// buffers define MC_IN (unsigned short) and MC_LOAD (their float value) first
#ifndef MC_IN
#define MC_IN T
#define MC_LOAD(v) (v)
#endif
extern "C" __global__ void mc_channel_sum_partial(const MC_IN* dy, int N, int C, long long S,
                                                  int rows_per_split, double* partial) {
  __shared__ double part[256];
  const int c = blockIdx.x, b = blockIdx.y;
  const int n0 = b * rows_per_split;
  const int n1 = min(N, n0 + rows_per_split);
  const int tid = threadIdx.x;
  double acc = 0;
  if (S >= 256) {
    for (int n = n0; n < n1; ++n) {
      const MC_IN* row = dy + ((long long)n * C + c) * S;
      for (long long s = tid; s < S; s += 256) acc += (double)MC_LOAD(row[s]);
    }
  } else {
    const int R = 256 / (int)S;
    const int r = tid / (int)S, s = tid % (int)S;
    if (r < R)
      for (int n = n0 + r; n < n1; n += R)
        acc += (double)MC_LOAD(dy[((long long)n * C + c) * S + s]);
  }
  part[tid] = acc;
  __syncthreads();
  for (int w = 128; w > 0; w >>= 1) {
    if (tid < w) part[tid] += part[tid + w];
    __syncthreads();
  }
  if (tid == 0) partial[(long long)c * gridDim.y + b] = part[0];
}

extern "C" __global__ void mc_channel_sum_final(const double* partial, int C, int splits,
                                                T* out, int accumulate) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  double s = 0;
  for (int b = 0; b < splits; ++b) s += partial[(long long)c * splits + b];
  out[c] = accumulate ? (T)((double)out[c] + s) : (T)s;
}
"""
TARGET_BLOCKS = 1024


def _splits(N, C):
    want = max(1, -(-TARGET_BLOCKS // max(C, 1)))
    splits = min(N, want)
    rows = -(-N // splits)
    return -(-N // rows), rows


def partial_size(N, C):
    splits, _ = _splits(N, C)
    return C * splits


def channel_sum(dy, out, partial, accumulate=True):
    """out[c] (+)= sum of dy (N, C, ...) over every axis but 1.  ``partial`` is a float64
    device buffer of at least ``partial_size(N, C)`` elements."""
    N, C = dy.shape[0], dy.shape[1]
    S = dy.size // max(N * C, 1)
    splits, rows = _splits(N, C)
    ct = cuda_type(dy.dtype)
    raw_kernel(_SRC, "mc_channel_sum_partial", ct)(
        (C, splits), (256,), (dy, np.int32(N), np.int32(C), np.int64(S), np.int32(rows), partial))
    raw_kernel(_SRC, "mc_channel_sum_final", ct)(
        ((C + 255) // 256,), (256,), (partial, np.int32(C), np.int32(splits), out,
                                      np.int32(accumulate)))
