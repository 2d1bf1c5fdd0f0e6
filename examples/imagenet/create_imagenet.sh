#!/usr/bin/env bash
# BVLC's examples/imagenet/create_imagenet.sh for minicaffe: the train and val LMDBs of
# Datums, images resized to 256x256 and shuffled.  Run from the repository root.
#   TRAIN_DATA_ROOT=/path/to/imagenet/train/ VAL_DATA_ROOT=/path/to/imagenet/val/ \
#   LISTS=/path/to/lists examples/imagenet/create_imagenet.sh
# LISTS holds train.txt and val.txt (BVLC's data/ilsvrc12/get_ilsvrc_aux.sh fetches them;
# make_image_folder.py writes them for its generated folder).  ENCODED=1 stores the JPEG
# bytes instead of pixels (convert_imageset --encoded: 10x smaller, decoded by the data
# workers while training); the default stores raw pixels, as BVLC's script does.
set -e
EXAMPLE=${EXAMPLE:-examples/imagenet}
LISTS=${LISTS:-data/ilsvrc12}
TRAIN_DATA_ROOT=${TRAIN_DATA_ROOT:-/path/to/imagenet/train/}
VAL_DATA_ROOT=${VAL_DATA_ROOT:-/path/to/imagenet/val/}
RESIZE=${RESIZE:-true}
if $RESIZE; then RESIZE_ARGS="--resize_height=256 --resize_width=256"; else RESIZE_ARGS=""; fi
ENC_ARGS=""
if [ "${ENCODED:-0}" = "1" ]; then ENC_ARGS="--encoded"; fi
for d in "$TRAIN_DATA_ROOT" "$VAL_DATA_ROOT"; do
  if [ ! -d "$d" ]; then
    echo "error: $d is not a directory: set TRAIN_DATA_ROOT and VAL_DATA_ROOT" >&2
    exit 1
  fi
done
echo "Creating train lmdb..."
python -m minicaffe.tools.convert_imageset $RESIZE_ARGS $ENC_ARGS --shuffle \
    "$TRAIN_DATA_ROOT" "$LISTS/train.txt" "$EXAMPLE/ilsvrc12_train_lmdb"
echo "Creating val lmdb..."
python -m minicaffe.tools.convert_imageset $RESIZE_ARGS $ENC_ARGS --shuffle \
    "$VAL_DATA_ROOT" "$LISTS/val.txt" "$EXAMPLE/ilsvrc12_val_lmdb"
echo "Done."
