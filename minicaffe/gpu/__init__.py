"""minicaffe's GPU runtime: what sits between the layers and the CUDA libraries.

- ``libs``: finding and loading libcublas and libcudnn (ctypes; CuPy 14 ships no cuDNN);
- ``cublas``, ``cudnn``: thin bindings named after the libraries' calls, one handle per
  thread and device, always on the current CuPy stream (so they capture in CUDA graphs);
- ``pool``: the allocator (CuPy's default pool or the stream-ordered cudaMallocAsync pool)
  and peak-memory readings;
- ``options``: process-wide switches (TF32, deterministic algorithms, graphs);
- ``plan``: the static memory plan of a net (one arena, buffers shared where lifetimes
  do not overlap);
- ``graph``: the training iteration captured once as CUDA graphs and replayed.

Policy (which engine, which buffers, when to capture) lives here and in the layers; the
bindings know nothing of nets.
"""
