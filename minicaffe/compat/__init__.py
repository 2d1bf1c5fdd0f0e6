"""The Caffe surface: what pycaffe and Caffe's Python tools give, on top of everything else.

    pycaffe.py   Net's pycaffe helpers, Timer, NCCL
    io.py        caffe.io: array <-> BlobProto/Datum, Transformer, load_image
    net_spec.py  NetSpec, layers/params (``from minicaffe import layers as L``)
    draw.py      caffe.draw and ``python -m minicaffe.compat.draw`` (draw_net.py)
    classify.py  Classifier and ``python -m minicaffe.compat.classify`` (classify.py)
    testing.py   the layer test helpers and Caffe's gradient checker

``import minicaffe as caffe`` exposes these as pycaffe does (``caffe.io``, ``caffe.draw``...);
the old paths (``minicaffe.io``...) are these same modules (``minicaffe.MOVED``).
"""
