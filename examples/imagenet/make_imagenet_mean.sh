#!/usr/bin/env bash
# BVLC's examples/imagenet/make_imagenet_mean.sh: the mean image of the train LMDB, which
# the CaffeNet/AlexNet/GoogLeNet train_val prototxts read as mean_file.
set -e
EXAMPLE=${EXAMPLE:-examples/imagenet}
DATA=${DATA:-data/ilsvrc12}
mkdir -p "$DATA"
python -m minicaffe.tools.compute_image_mean "$EXAMPLE/ilsvrc12_train_lmdb" \
    "$DATA/imagenet_mean.binaryproto"
echo "Done."
