"""minicaffe's core: what every other package stands on, and which imports none of them.

    backend.py        the numpy/CuPy choice (the one place that imports CuPy besides gpu/),
                      the device allocator
    context.py        Caffe's per-thread manager: mode, device, seeds, solver count/rank
    config.py         the run's settings (RunConfig) and the MINICAFFE_* environment
    synced_memory.py  SyncedMemory, the 4-state host/device memory (Caffe's syncedmem)
    blob.py           Blob (Caffe's blob.hpp)
    filler.py         the weight fillers (Caffe's filler.hpp)
    flat_params.py    flat parameter buffers (one layout for params, diffs and history)
    protoio.py        prototxt and binary proto files (Caffe's io.cpp ReadProto*/WriteProto*)
    fileio.py         atomic file writes
    log.py            glog-style logging;  errors.py  the error classes;
    threads.py        numpy's BLAS thread count

The old flat paths (``minicaffe.context``...) are these same modules (``minicaffe.MOVED``).
"""
