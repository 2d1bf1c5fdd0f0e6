"""NetSpec: write nets in Python, pycaffe's way (python/caffe/net_spec.py).

``L.<Type>(*bottoms, **kwargs)`` makes a layer and returns its top (or a tuple of tops
when ``ntop`` > 1, or the layer itself when ``ntop=0``).  Keyword rules, as pycaffe:

- ``ntop=n`` sets the number of tops; ``in_place=True`` makes the tops the bottoms;
- a keyword ending in ``param`` (``param``, ``transform_param``, ``loss_param``...) goes on
  the LayerParameter itself;
- any other keyword goes into the layer type's own ``<type>_param`` message (the mapping
  comes from caffe.proto: ``ConvolutionParameter`` -> ``convolution_param``); if the type
  has none or the field is not there, it goes on the LayerParameter (``loss_weight``,
  ``include``...);
- values: lists fill repeated fields (a scalar fills a one-element repeated field), dicts
  fill messages, a list of dicts adds repeated messages.

``P.<Type>.<ENUM>`` gives enum values (``P.Pooling.MAX``).

Names: assign tops to a :class:`NetSpec` (``n.conv1 = L.Convolution(...)``) and
``n.to_proto()`` names each layer and top after the attribute.  Unnamed tops get
``<Type><k>`` (``Convolution1``...), counted per type in the order they are first needed;
a layer takes the name of its first top.  ``to_proto(*tops)`` builds a net from anonymous
tops.  ``str(proto)`` is the prototxt text.
"""
import collections

from ..proto import caffe_pb2


def param_name_dict():
    """{layer type name: parameter field prefix}, e.g. 'Convolution' -> 'convolution',
    from the LayerParameter fields whose names end in ``_param``."""
    out = {}
    for f in caffe_pb2.LayerParameter.DESCRIPTOR.fields:
        if f.name.endswith("_param") and f.message_type is not None:
            type_name = f.message_type.name
            if type_name.endswith("Parameter"):
                type_name = type_name[:-len("Parameter")]
            out[type_name] = f.name[:-len("_param")]
    return out


def to_proto(*tops):
    """A NetParameter with every layer needed to compute ``tops`` (auto-named); a layer
    of no top (``L.Silence(x, ntop=0)``, a Function) may be given in place of a top."""
    layers = collections.OrderedDict()
    autonames = collections.Counter()
    for top in tops:
        getattr(top, "fn", top)._to_proto(layers, {}, autonames)
    net = caffe_pb2.NetParameter()
    net.layer.extend(layers.values())
    return net


def assign_proto(proto, name, val):
    """Assign a Python value to field ``name`` of message ``proto`` (recursively): lists
    become repeated fields, dicts messages; a scalar given to a repeated field becomes a
    one-element list."""
    field = getattr(proto, name)
    is_repeated_field = hasattr(field, "extend")
    if is_repeated_field and not isinstance(val, list):
        val = [val]
    if isinstance(val, list):
        if val and isinstance(val[0], dict):
            for item in val:
                proto_item = field.add()
                for k, v in item.items():
                    assign_proto(proto_item, k, v)
        else:
            field.extend(val)
    elif isinstance(val, dict):
        for k, v in val.items():
            assign_proto(field, k, v)
    else:
        setattr(proto, name, val)


class Top:
    """One output blob of a layer (a Function); ``n`` is its index among the layer's tops."""

    def __init__(self, fn, n):
        self.fn = fn
        self.n = n

    def to_proto(self):
        """A NetParameter with every layer needed to compute this top."""
        return to_proto(self)

    def _to_proto(self, layers, names, autonames):
        return self.fn._to_proto(layers, names, autonames)

    def __repr__(self):
        return f"<Top {self.n} of {self.fn.type_name}>"


class Function:
    """A layer: its type, its input Tops and its parameters."""

    def __init__(self, type_name, inputs, params):
        self.type_name = type_name
        for index, inp in enumerate(inputs):
            if not isinstance(inp, Top):
                raise TypeError(f"{type_name} input {index} is not a Top (type is {type(inp)})")
        self.inputs = inputs
        self.params = params
        self.ntop = self.params.pop("ntop", 1)
        self.in_place = self.params.pop("in_place", False)
        self.tops = tuple(Top(self, n) for n in range(self.ntop))

    def _get_name(self, names, autonames):
        if self not in names and self.ntop > 0:
            names[self] = self._get_top_name(self.tops[0], names, autonames)
        elif self not in names:
            autonames[self.type_name] += 1
            names[self] = self.type_name + str(autonames[self.type_name])
        return names[self]

    def _get_top_name(self, top, names, autonames):
        if top not in names:
            autonames[top.fn.type_name] += 1
            names[top] = top.fn.type_name + str(autonames[top.fn.type_name])
        return names[top]

    def _to_proto(self, layers, names, autonames):
        if self in layers:
            return
        bottom_names = []
        for inp in self.inputs:
            inp._to_proto(layers, names, autonames)
            bottom_names.append(layers[inp.fn].top[inp.n])
        layer = caffe_pb2.LayerParameter()
        layer.type = self.type_name
        layer.bottom.extend(bottom_names)
        if self.in_place:
            layer.top.extend(layer.bottom)
        else:
            for top in self.tops:
                layer.top.append(self._get_top_name(top, names, autonames))
        layer.name = self._get_name(names, autonames)
        for k, v in self.params.items():
            if k.endswith("param"):  # generic *param fields go on the layer
                assign_proto(layer, k, v)
            else:
                try:
                    assign_proto(getattr(layer, _param_names[self.type_name] + "_param"), k, v)
                except (AttributeError, KeyError):
                    assign_proto(layer, k, v)
        layers[self] = layer


class NetSpec:
    """A set of named Tops: assign them as attributes (or items), then ``to_proto()``."""

    def __init__(self):
        super().__setattr__("tops", collections.OrderedDict())

    def __setattr__(self, name, value):
        self.tops[name] = value

    def __getattr__(self, name):
        try:
            return self.tops[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setitem__(self, key, value):
        self.__setattr__(key, value)

    def __getitem__(self, item):
        return self.tops[item]

    def __delitem__(self, name):
        del self.tops[name]

    def keys(self):
        return list(self.tops.keys())

    def vals(self):
        return list(self.tops.values())

    def to_proto(self):
        names = {v: k for k, v in self.tops.items()}
        autonames = collections.Counter()
        layers = collections.OrderedDict()
        for name, top in self.tops.items():
            top._to_proto(layers, names, autonames)
        net = caffe_pb2.NetParameter()
        net.layer.extend(layers.values())
        return net


class Layers:
    """Pseudo-module making layer functions: ``Layers().Convolution(bottom, kernel_size=3)``
    returns the Top of a 3x3 convolution of ``bottom``."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def layer_fn(*args, **kwargs):
            fn = Function(name, args, kwargs)
            if fn.ntop == 0:
                return fn
            if fn.ntop == 1:
                return fn.tops[0]
            return fn.tops
        layer_fn.__name__ = name
        return layer_fn


class Parameters:
    """Pseudo-module of parameter constants: ``Parameters().Pooling.MAX``."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        msg = getattr(caffe_pb2, name + "Parameter")

        class Param:
            def __getattr__(self, param_name):
                return getattr(msg, param_name)
        return Param()


_param_names = param_name_dict()
layers = Layers()
params = Parameters()
