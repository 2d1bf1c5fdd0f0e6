"""Caffe's protobuf schema for minicaffe.

``caffe_pb2`` is generated from ``protos/caffe.proto`` by
``python tools/gen_proto.py``; do not edit it by hand.
"""

from . import caffe_pb2

__all__ = ["caffe_pb2"]
