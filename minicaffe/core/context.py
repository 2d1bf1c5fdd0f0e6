"""The per-thread manager: Caffe's ``Caffe::Get()``.

Each thread has its own mode (CPU/GPU), device id, random generators,
solver rank and GPU handles; a new thread starts from the defaults, never
from another thread's settings.  ``solver_count`` is per process.
"""
import os
import threading
import time

import numpy as np

from . import backend

CPU = 0
GPU = 1

_local = threading.local()
_process_lock = threading.Lock()
_process = {"solver_count": 1, "multiprocess": False, "shard_test": False}


def cluster_seedgen():
    """Caffe's seed for an unseeded generator: mixes time and process id."""
    s = int(time.time() * 1e6)
    pid = os.getpid()
    return abs(((s * 181) * ((pid - 83) * 359)) % 104729) + threading.get_ident() % 7919


class _State:
    def __init__(self):
        self.mode = CPU
        self.device_id = 0
        self.seed = None
        self._rng = None
        self._gpu_rng = None
        self.solver_rank = 0
        self.handles = {}
        self.stop_check = None

    @property
    def rng(self):
        if self._rng is None:
            self._rng = np.random.RandomState(self.seed if self.seed is not None else cluster_seedgen())
        return self._rng

    @property
    def gpu_rng(self):
        if self._gpu_rng is None:
            seed = self.seed if self.seed is not None else cluster_seedgen()
            with backend.on_device(self.device_id):
                self._gpu_rng = backend.gpu_random_state(seed)
        return self._gpu_rng


def get():
    """This thread's manager state (created with the defaults on first use)."""
    st = getattr(_local, "state", None)
    if st is None:
        st = _local.state = _State()
    return st


def mode():
    return get().mode


def is_gpu():
    return get().mode == GPU


def set_mode_cpu():
    get().mode = CPU


def set_mode_gpu():
    st = get()
    backend.check_device(st.device_id)
    backend.use_device(st.device_id)
    backend.ensure_allocator()
    st.mode = GPU


def set_mode(m):
    set_mode_gpu() if m == GPU else set_mode_cpu()


def set_device(device_id):
    """Select the GPU for this thread and renew its handles and GPU generator."""
    device_id = int(device_id)
    backend.check_device(device_id)
    st = get()
    st.device_id = device_id
    backend.use_device(device_id)
    st.handles = {}
    st._gpu_rng = None


def device_id():
    return get().device_id


def set_random_seed(seed):
    """Seed this thread's CPU and GPU generators."""
    st = get()
    st.seed = int(seed)
    st._rng = np.random.RandomState(st.seed)
    st._gpu_rng = None


def rng():
    """This thread's Mersenne Twister generator (numpy RandomState)."""
    return get().rng


def gpu_rng():
    return get().gpu_rng


def xp():
    """The array module of this thread's mode."""
    return backend.gpu_module() if get().mode == GPU else np


def solver_count():
    return _process["solver_count"]


def set_solver_count(n):
    with _process_lock:
        _process["solver_count"] = int(n)


def multiprocess():
    return _process["multiprocess"]


def set_multiprocess(v):
    _process["multiprocess"] = bool(v)


def shard_test():
    """True while data-parallel training tests on every rank: TEST data is sharded too."""
    return _process["shard_test"]


def set_shard_test(v):
    _process["shard_test"] = bool(v)


def solver_rank():
    return get().solver_rank


def set_solver_rank(r):
    get().solver_rank = int(r)


def root_solver():
    return get().solver_rank == 0


def set_stop_check(fn):
    """``fn()`` says whether this thread was asked to stop (a signal); long waits on other
    threads (the data prefetch) poll it, so they end when it says so.  None: never."""
    get().stop_check = fn


def stop_requested():
    fn = get().stop_check
    return bool(fn is not None and fn())


_kept_streams = {}


def kept_stream(name):
    """A non-blocking stream of this thread and GPU, made once and kept for the process:
    arrays allocated while it is current (a layer's buffers grown in a GPU step) are
    freed on it by the stream-ordered pool, later, by whoever holds them then -- a
    stream destroyed under them would make that free fail."""
    key = (name, threading.get_ident(), device_id())
    s = _kept_streams.get(key)
    if s is None:
        s = _kept_streams[key] = backend.new_stream(non_blocking=True)
    return s
