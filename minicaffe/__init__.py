"""minicaffe: Caffe, rebuilt in Python (numpy on the CPU, CuPy on the GPU).

``import minicaffe as caffe`` gives pycaffe's surface: ``caffe.Net``,
``caffe.set_mode_gpu()``, ``caffe.TRAIN``...
"""
__version__ = "0.1.0"

from .context import (set_mode_cpu, set_mode_gpu, set_device, set_random_seed,
                      solver_count, set_solver_count, solver_rank, set_solver_rank,
                      root_solver)
from .blob import Blob
from .layer import Layer
from .net import Net, TRAIN, TEST
from .registry import layer_type_list
from .errors import MinicaffeError
from .log import init_log
from .proto import caffe_pb2
from . import proto
