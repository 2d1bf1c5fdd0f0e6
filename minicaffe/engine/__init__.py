"""minicaffe's engine: how one training iteration runs on a device.

- ``schedule``: the iteration as a printable list of ops and the passes over it (fusion,
  offload copies, all-reduce buckets);
- ``plan``: the memory plan, a pass over the schedule (lifetimes from the ops' reads and
  writes; one arena);
- ``executor``: the one executor of the ops (eager with numpy or CuPy, or the GPU step's
  body replayed as a CUDA graph), what the Solver's loop calls;
- ``step``: ``GpuStep``, the device's side of an SGD-family solver's iteration on one GPU
  (data prologue, the rings, the fused update, capture and replay); it applies the memory
  plan, makes the offloader (``offload.py``) and sizes the cuDNN workspace.

The engine sits above the Net, the layers and ``gpu/`` (the bindings it drives: capture,
host memory, pools) and below the solvers, which call it (docs/architecture.md).
"""
