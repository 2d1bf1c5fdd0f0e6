"""minicaffe's engine: how one training iteration runs on a device.

- ``step``: ``GpuStep``, the iteration of an SGD-family solver on one GPU (data prologue,
  forward/backward of the body, fused update), run eagerly or captured once as CUDA graphs
  and replayed; it builds the memory plan (``gpu/plan.py``), the offloader (``offload.py``)
  and sizes the cuDNN workspace.

The engine sits above the Net, the layers and ``gpu/`` (the bindings it drives: capture,
host memory, pools) and below the solvers, which call it (docs/architecture.md).
"""
