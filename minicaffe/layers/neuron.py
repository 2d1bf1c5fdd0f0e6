"""Neuron layers: elementwise, one bottom, one top of the same shape."""
from ..layer import NeuronLayer
from ..registry import register_layer


@register_layer("ReLU")
class ReLULayer(NeuronLayer):
    """y = max(x, 0) + negative_slope * min(x, 0);  dx = dy * (x > 0 ? 1 : negative_slope)."""

    def forward_xp(self, xp, bottom, top):
        x = bottom[0].data_for(xp)
        slope = self.layer_param.relu_param.negative_slope
        y = top[0].mutable_data_for(xp)
        if slope:
            y[...] = xp.where(x > 0, x, x * x.dtype.type(slope))
        else:
            xp.maximum(x, 0, out=y)

    def backward_xp(self, xp, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        # In place, bottom data is the top data; the sign is the same either way.
        x = bottom[0].data_for(xp)
        dy = top[0].diff_for(xp)
        slope = self.layer_param.relu_param.negative_slope
        dx = bottom[0].mutable_diff_for(xp)
        if slope:
            dx[...] = dy * xp.where(x > 0, x.dtype.type(1), x.dtype.type(slope))
        else:
            dx[...] = dy * (x > 0)
