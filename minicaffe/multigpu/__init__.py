"""Data-parallel training over several GPUs (or CPU processes): Caffe's parallel.cpp.

    parallel.py         P2PManager / P2PSync: one solver per rank, bucketed all-reduce
                        of the gradients from the Net's hooks during backward
    parallel_launch.py  the launcher (threads, or one process per rank)
    comm.py             the communicators: NCCL (through gpu/nccl.py) and FakeComm

Named ``multigpu`` (not ``parallel``) so that ``minicaffe.parallel``, the old module path of
parallel.py, stays that module (``minicaffe.MOVED``).
"""
