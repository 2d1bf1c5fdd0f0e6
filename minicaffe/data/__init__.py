"""The data pipeline: Caffe's data formats, the DataTransformer and the prefetch thread.

    db.py          LMDB / LevelDB key-value stores of Datum records (Caffe's db.hpp)
    images.py      image decoding/encoding with Pillow, OpenCV-compatible resize, BGR order
    transformer.py DataTransformer (crop, mirror, mean, scale; Caffe's data_transformer.cpp)
    prefetch.py    the prefetch thread and BasePrefetchingDataLayer (base_data_layer.cpp)

The layers themselves (Data, ImageData, HDF5Data, HDF5Output, WindowData) live in
``minicaffe.layers.data_layers``.
"""
