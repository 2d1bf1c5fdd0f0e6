#!/usr/bin/env bash
# BVLC's train_caffenet.sh; NET=alexnet, NET=googlenet or NET=resnet50 for the others.  Extra arguments
# go to `minicaffe train` (e.g. --gpu 0, --data_workers 12, --snapshot FILE to resume).
set -e
NET=${NET:-caffenet}
minicaffe=${MINICAFFE:-python -m minicaffe}
$minicaffe train --solver "examples/imagenet/${NET}_solver.prototxt" "$@"
