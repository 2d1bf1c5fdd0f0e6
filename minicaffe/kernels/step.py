"""Small kernels of the GPU training step (``engine/step.py``): the loss into the host
ring, the iteration counter, the squared norm of the gradients for clipping.

Everything here is deterministic (fixed-order reductions, no atomics), so an iteration
replayed from a CUDA graph gives the same bits as the same iteration run eagerly.
"""
import numpy as np

from ._backend import raw_kernel

_SRC = r"""
// ring[counter % K] += sum(data * diff): one block, fixed reduction order
extern "C" __global__ void mc_loss_accumulate(const T* data, const T* diff, long long n,
                                              unsigned long long ring_addr,
                                              const long long* counter, int K) {
  __shared__ double part[256];
  double s = 0;
  for (long long i = threadIdx.x; i < n; i += blockDim.x) s += (double)data[i] * (double)diff[i];
  part[threadIdx.x] = s;
  __syncthreads();
  for (int w = 128; w > 0; w >>= 1) {
    if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    double* ring = (double*)ring_addr;
    ring[(*counter) % K] += part[0];
  }
}

// copy this iteration's scalars from the host ring into device memory (one read over the
// bus instead of one per thread of the update), then advance the iteration counter
extern "C" __global__ void mc_fetch_and_advance(long long* counter,
                                                unsigned long long sched_addr, int S, int K,
                                                float* cur) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    const float* sc = ((const float*)sched_addr) + ((*counter) % K) * S;
    for (int j = 0; j < S; ++j) cur[j] = sc[j];
    *counter += 1;
  }
}

// stage 1 of sum(g^2): block b sums its contiguous range into partial[b]
extern "C" __global__ void mc_sumsq_partial(const T* g, long long n, double* partial) {
  __shared__ double part[256];
  long long per = (n + gridDim.x - 1) / gridDim.x;
  long long lo = per * blockIdx.x, hi = min(n, lo + per);
  double s = 0;
  for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) s += (double)g[i] * (double)g[i];
  part[threadIdx.x] = s;
  __syncthreads();
  for (int w = 128; w > 0; w >>= 1) {
    if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = part[0];
}

// stage 2: one block adds the partials; out[0] = sum as float, the norm into the host ring
extern "C" __global__ void mc_sumsq_final(const double* partial, int nparts, float* out,
                                          unsigned long long ring_addr,
                                          const long long* counter, int K) {
  __shared__ double part[256];
  double s = 0;
  for (int i = threadIdx.x; i < nparts; i += blockDim.x) s += partial[i];
  part[threadIdx.x] = s;
  __syncthreads();
  for (int w = 128; w > 0; w >>= 1) {
    if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    out[0] = (float)part[0];
    if (ring_addr) ((float*)ring_addr)[(*counter) % K] = sqrtf((float)part[0]);
  }
}

// fp16 loss scaling (engine/precision.py's DeviceLossScale): the flat diffs times the
// scale's float32 reciprocal; *found = 1 where a product is not finite (every writer
// writes 1: the flag's value does not depend on the order; mc_ls_update clears it)
extern "C" __global__ void mc_ls_unscale(T* g, long long n, const float* inv, int* found) {
  const float s = *inv;
  bool bad = false;
  CUDA_KERNEL_LOOP(i, n) {
    const float v = g[i] * s;
    g[i] = v;
    bad |= !isfinite(v);
  }
  if (bad) *found = 1;
}

// after the (possibly skipped) update, one thread: the dynamic scale's rule -- x backoff on
// a non-finite step, x growth after ``interval`` clean ones (powers of two: exact) -- and
// the flag cleared for the next step (a fixed scale only clears it)
extern "C" __global__ void mc_ls_update(float* scale, float* inv, long long* good,
                                        long long* skipped, int* found, int dynamic,
                                        long long interval, double backoff, double growth) {
  const long long bad = *found;
  *found = 0;
  if (!dynamic) return;
  const long long g = (*good + 1) * (1 - bad);
  const long long grow = g >= interval ? 1 : 0;
  *good = g * (1 - grow);
  *skipped += bad;
  const double factor = (1.0 - (1.0 - backoff) * bad) * (1.0 + (growth - 1.0) * grow);
  const float sc = *scale * (float)factor;
  *scale = sc;
  *inv = 1.0f / sc;
}
"""
SUMSQ_BLOCKS = 512


def _k(name, dtype=np.float32):
    from ._backend import cuda_type
    return raw_kernel(_SRC, name, cuda_type(dtype))


def loss_accumulate(data, diff, ring_addr, counter, K):
    _k("mc_loss_accumulate", data.dtype)((1,), (256,), (data, diff, np.int64(data.size),
                                                      np.uint64(ring_addr), counter, np.int32(K)))


def fetch_and_advance(counter, sched_addr, S, K, cur):
    _k("mc_fetch_and_advance")((1,), (1,), (counter, np.uint64(sched_addr), np.int32(S),
                                             np.int32(K), cur))


def sumsq(g, partial, out, ring_addr, counter, K):
    """out[0] = sum(g**2) (float32; accumulated in float64 over a fixed split); the norm
    goes to the float ring at ``ring_addr`` (0: no ring)."""
    _k("mc_sumsq_partial", g.dtype)((SUMSQ_BLOCKS,), (256,), (g, np.int64(g.size), partial))
    _k("mc_sumsq_final", g.dtype)((1,), (256,), (partial, np.int32(SUMSQ_BLOCKS), out,
                                                 np.uint64(ring_addr), counter, np.int32(K)))


def loss_scale_unscale(g, inv, found):
    """g *= inv[0] (float32, in place); found[0] = 1 where a product is not finite (it
    must be 0 before: ``loss_scale_update`` leaves it so)."""
    from ._backend import launch
    launch(_k("mc_ls_unscale", g.dtype), g.size, (g, np.int64(g.size), inv, found))


def loss_scale_update(scale, inv, good, skipped, found, dynamic, interval, backoff, growth):
    """The loss scale's rule after a step (one thread; see the kernel), found cleared."""
    _k("mc_ls_update")((1,), (1,), (scale, inv, good, skipped, found, np.int32(bool(dynamic)),
                                    np.int64(interval), np.float64(backoff),
                                    np.float64(growth)))
