"""Pure array kernels for minicaffe's vision layers.

Every function takes and returns arrays (no Blob/Layer classes).  Passing
numpy arrays runs the numpy (CPU-mode) body; passing ``cupy.ndarray`` runs
the CuPy (GPU-mode) body, built from CUDA C kernels compiled lazily on first
use.  Importing this package never imports CuPy.

* :mod:`.im2col`  -- ``im2col``/``col2im`` (whole-batch column layout
  ``(C*kh*kw, N*OH*OW)``), N-D variants.
* :mod:`.pooling` -- Caffe MAX / AVE / STOCHASTIC pooling.
* :mod:`.lrn`     -- Caffe LRN, ACROSS_CHANNELS and WITHIN_CHANNEL.
"""
from ._backend import _cupy, get_array_module, is_cupy_array
from .im2col import (col2im, col2im_nd, conv_output_shape, conv_output_shape_nd,
                     im2col, im2col_nd)
from .lrn import (lrn_across_channels_backward, lrn_across_channels_forward,
                  lrn_backward, lrn_forward, lrn_within_channel_backward,
                  lrn_within_channel_forward)
from .pooling import (ave_pool_backward, ave_pool_forward, max_pool_backward,
                      max_pool_forward, pool_output_shape, stochastic_pool_backward,
                      stochastic_pool_forward_test, stochastic_pool_forward_train)

__all__ = [
    "_cupy", "get_array_module", "is_cupy_array",
    "im2col", "col2im", "im2col_nd", "col2im_nd", "conv_output_shape",
    "conv_output_shape_nd",
    "pool_output_shape", "max_pool_forward", "max_pool_backward",
    "ave_pool_forward", "ave_pool_backward", "stochastic_pool_forward_train",
    "stochastic_pool_forward_test", "stochastic_pool_backward",
    "lrn_across_channels_forward", "lrn_across_channels_backward",
    "lrn_forward", "lrn_backward",
    "lrn_within_channel_forward", "lrn_within_channel_backward",
]
