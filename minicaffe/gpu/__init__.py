"""minicaffe's GPU bindings: what sits between the engine/layers and the CUDA libraries.

- ``libs``: finding and loading libcublas and libcudnn (ctypes; CuPy 14 ships no cuDNN);
- ``cublas``, ``cudnn``: thin bindings named after the libraries' calls, one handle per
  thread and device, always on the current CuPy stream (so they capture in CUDA graphs);
- ``nccl``: CuPy's NCCL communicator and ``ncclCommAbort`` without the GIL;
- ``host``: page-locked host memory, pinned or mapped (the one host allocator);
- ``graph``: CUDA graph capture with a private pool (as ``torch.cuda.graph``);
- ``pool``: the allocator (CuPy's default pool or the stream-ordered cudaMallocAsync pool)
  and peak-memory readings (its code is in ``backend.py``);
- ``options``: process-wide switches (TF32, deterministic algorithms, cuDNN on/off);
- ``jpeg``: JPEG decode on the GPU with nvImageCodec (nvJPEG), for ``--gpu_decode``.

The memory plan (which buffers share the arena) is policy: engine/plan.py, a pass over
the schedule (it was ``gpu/plan.py`` before issue 18's last round).

gpu/ imports nothing of layers, solvers, the engine, offload, the Net or parallel
(tests/test_architecture.py): policy (which engine, which buffers, when to capture) lives
one level up, in ``engine/`` and the layers.
"""
