"""Classify images with a deploy model (pycaffe's python/classify.py and caffe.Classifier).

``Classifier(model_file, pretrained_file, image_dims=None, mean=None, input_scale=None,
raw_scale=None, channel_swap=None)`` is a TEST-phase :class:`~minicaffe.network.net.Net` that
resizes images to ``image_dims``, takes the centre crop or the ten oversampled crops of the
net's input size, preprocesses them with a :class:`~minicaffe.compat.io.Transformer` and returns
class probabilities (averaged over the crops).

Command line (pycaffe's flags)::

    python -m minicaffe.compat.classify INPUT OUTPUT.npy --model_def deploy.prototxt \\
        --pretrained_model weights.caffemodel [--gpu] [--center_only] [--images_dim 256,256]
        [--mean_file mean.npy] [--input_scale S] [--raw_scale 255] [--channel_swap 2,1,0]
        [--ext jpg] [--labels_file synset_words.txt --print_results]

INPUT is an image, a folder of ``*.<ext>`` images, or a ``.npy`` array of images (N x H x W
x K).  A net whose input has one channel gets images loaded as intensity.
"""
import argparse
import glob
import os
import sys
import time

import numpy as np

from ..core import context
from . import io as caffe_io
from ..core import protoio
from ..core.errors import MinicaffeError
from ..network.net import Net, TEST


class Classifier(Net):
    """Image classifier: a Net with pre-processing, centre cropping or oversampling."""

    def __init__(self, model_file, pretrained_file, image_dims=None, mean=None,
                 input_scale=None, raw_scale=None, channel_swap=None):
        Net.__init__(self, model_file, TEST, weights=pretrained_file)
        in_ = self.inputs[0]
        self.transformer = caffe_io.Transformer({in_: self.blobs[in_].data.shape})
        self.transformer.set_transpose(in_, (2, 0, 1))
        if mean is not None:
            self.transformer.set_mean(in_, mean)
        if input_scale is not None:
            self.transformer.set_input_scale(in_, input_scale)
        if raw_scale is not None:
            self.transformer.set_raw_scale(in_, raw_scale)
        if channel_swap is not None:
            self.transformer.set_channel_swap(in_, channel_swap)
        self.crop_dims = np.array(self.blobs[in_].data.shape[2:])
        if image_dims is None or len(image_dims) == 0:
            image_dims = self.crop_dims
        self.image_dims = image_dims

    def predict(self, inputs, oversample=True):
        """Class probabilities (N x C) of ``inputs`` (iterable of H x W x K images):
        averaged over the ten oversampled crops, or from the centre crop alone."""
        input_ = np.zeros((len(inputs), self.image_dims[0], self.image_dims[1],
                           inputs[0].shape[2]), dtype=np.float32)
        for ix, in_ in enumerate(inputs):
            input_[ix] = caffe_io.resize_image(in_, self.image_dims)
        if oversample:
            input_ = caffe_io.oversample(input_, self.crop_dims)
        else:
            center = np.array(self.image_dims) / 2.0
            crop = np.tile(center, (1, 2))[0] + np.concatenate([-self.crop_dims / 2.0,
                                                                 self.crop_dims / 2.0])
            crop = crop.astype(int)
            input_ = input_[:, crop[0]:crop[2], crop[1]:crop[3], :]
        caffe_in = np.zeros(np.array(input_.shape)[[0, 3, 1, 2]], dtype=np.float32)
        for ix, in_ in enumerate(input_):
            caffe_in[ix] = self.transformer.preprocess(self.inputs[0], in_)
        out = self.forward_all(**{self.inputs[0]: caffe_in})
        predictions = out[self.outputs[0]]
        if oversample:
            predictions = predictions.reshape((len(predictions) // 10, 10, -1)).mean(1)
        return predictions


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Classify images with a deploy model.")
    p.add_argument("input_file", help="Input image, directory, or npy.")
    p.add_argument("output_file", help="Output npy filename.")
    p.add_argument("--model_def", required=True, help="Model definition file.")
    p.add_argument("--pretrained_model", required=True, help="Trained model weights file.")
    p.add_argument("--gpu", action="store_true", help="Switch for gpu computation.")
    p.add_argument("--center_only", action="store_true",
                   help="Switch for prediction from center crop alone instead of averaging "
                        "predictions across crops (default).")
    p.add_argument("--images_dim", default="256,256",
                   help="Canonical 'height,width' dimensions of input images.")
    p.add_argument("--mean_file", default="",
                   help="Data set image mean of [Channels x Height x Width] dimensions "
                        "(numpy array). Empty for no mean subtraction.")
    p.add_argument("--input_scale", type=float,
                   help="Multiply input features by this scale to finish preprocessing.")
    p.add_argument("--raw_scale", type=float, default=255.0,
                   help="Multiply raw input by this scale before preprocessing.")
    p.add_argument("--channel_swap", default="2,1,0",
                   help="Order to permute input channels. The default converts RGB -> BGR "
                        "since BGR is the Caffe default by way of OpenCV.")
    p.add_argument("--ext", default="jpg",
                   help="Image file extension to take as input when a directory is given "
                        "as the input file.")
    p.add_argument("--labels_file", default="",
                   help="Readable label definition file (one label per line, "
                        "'synset_id name...').")
    p.add_argument("--print_results", action="store_true",
                   help="Print the top-5 labels of the first input.")
    return p.parse_args(argv)


def _load_labels(path):
    with open(path) as f:
        rows = [line.strip().split(" ", 1) for line in f if line.strip()]
    return [(r[1] if len(r) > 1 else r[0]).split(",")[0] for r in rows]


def run(args):
    image_dims = [int(s) for s in args.images_dim.split(",")]
    mean = channel_swap = None
    if args.mean_file:
        mean = np.load(args.mean_file)
    if args.gpu:
        context.set_mode_gpu()
        print("GPU mode")
    else:
        context.set_mode_cpu()
        print("CPU mode")
    for path in (args.model_def, args.pretrained_model):
        if not os.path.exists(path):
            raise MinicaffeError(f"{path}: no such file")
    classifier = Classifier(args.model_def, args.pretrained_model, image_dims=image_dims,
                            mean=mean, input_scale=args.input_scale, raw_scale=args.raw_scale)
    channels = classifier.blobs[classifier.inputs[0]].shape[1]
    if args.channel_swap and channels > 1:
        channel_swap = [int(s) for s in args.channel_swap.split(",")]
        classifier.transformer.set_channel_swap(classifier.inputs[0], channel_swap)
    color = channels != 1
    input_file = os.path.expanduser(args.input_file)
    if input_file.endswith("npy"):
        print(f"Loading file: {input_file}")
        inputs = np.load(input_file)
    elif os.path.isdir(input_file):
        print(f"Loading folder: {input_file}")
        files = sorted(glob.glob(os.path.join(input_file, "*." + args.ext)))
        if not files:
            raise MinicaffeError(f"{input_file}: no *.{args.ext} images")
        inputs = [caffe_io.load_image(f, color=color) for f in files]
    else:
        print(f"Loading file: {input_file}")
        inputs = [caffe_io.load_image(input_file, color=color)]
    print(f"Classifying {len(inputs)} inputs.")
    start = time.time()
    predictions = classifier.predict(inputs, not args.center_only)
    print(f"Done in {time.time() - start:.2f} s.")
    if args.print_results:
        labels = _load_labels(args.labels_file) if args.labels_file else None
        indices = (-predictions[0]).argsort()[:5]
        meta = [(labels[i] if labels else int(i), "%.5f" % predictions[0][i]) for i in indices]
        print(meta)
    print(f"Saving results into {args.output_file}")
    out = args.output_file if args.output_file.endswith(".npy") else args.output_file + ".npy"
    import io as _pyio
    buf = _pyio.BytesIO()
    np.save(buf, predictions)
    protoio.atomic_write(out, buf.getvalue())
    return predictions


def main(argv=None):
    args = parse_args(argv)
    try:
        run(args)
    except MinicaffeError as e:
        print(f"classify: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
