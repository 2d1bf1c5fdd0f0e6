"""Write the values of some blobs of a trained net, image by image, to databases: Caffe's
``tools/extract_features.cpp``, with its arguments.

    minicaffe extract_features WEIGHTS.caffemodel MODEL.prototxt BLOB[,BLOB2...] \\
        DB[,DB2...] NUM_MINI_BATCHES lmdb|leveldb [CPU|GPU] [DEVICE_ID]
    (also: minicaffe-extract-features ...)

The net is built in the TEST phase from MODEL (its data layer supplies the images), the
weights copied from WEIGHTS; each of NUM_MINI_BATCHES forwards writes, for every image of
the batch and every BLOB, one Datum into that blob's database: ``channels``, ``height``,
``width`` the blob's (1 where it has fewer axes), the values in ``float_data``, under the
key ``%010d`` of the image's index, as Caffe does.  Each database must not exist yet; it is
written under a temporary name and renamed when complete (nothing is left on an error).
"""
import argparse
import contextlib
import sys

from minicaffe.data import toolutil

LOG_EVERY = 1000   # Caffe commits and logs every 1000 images


def _legacy(shape, axis):
    return int(shape[axis]) if len(shape) > axis else 1


def extract_features(weights, model, blob_names, db_names, num_batches, db_type="lmdb",
                     gpu=None):
    """The tool's work; returns {blob: images written}."""
    import numpy as np
    from minicaffe.core import context, log
    from minicaffe.data.db import open_db
    from minicaffe.core.errors import MinicaffeError
    from minicaffe.network.net import Net, TEST
    from minicaffe.proto import caffe_pb2
    if len(blob_names) != len(db_names):
        raise MinicaffeError(f"the number of blob names ({len(blob_names)}) and database "
                             f"names ({len(db_names)}) must be equal")
    if num_batches < 1:
        raise MinicaffeError(f"num_mini_batches must be at least 1 (got {num_batches})")
    if gpu is not None:
        from minicaffe.cli import _check_gpus
        _check_gpus([gpu])
        log.info("Using GPU %d", gpu)
        context.set_device(gpu)
        context.set_mode_gpu()
    else:
        log.info("Using CPU")
        context.set_mode_cpu()
    net = Net(model, TEST)
    net.copy_from(weights)
    for name in blob_names:
        if name not in net.blobs:
            raise MinicaffeError(f"Unknown feature blob name {name} in the network {model}")
    log.info("Extracting Features")
    counts = {name: 0 for name in blob_names}
    datum = caffe_pb2.Datum()
    with contextlib.ExitStack() as stack:
        dbs = [stack.enter_context(open_db(path, db_type, "new")) for path in db_names]
        txns = [db.new_transaction() for db in dbs]
        for _ in range(num_batches):
            net.forward_prefilled()
            for name, txn in zip(blob_names, txns):
                values = np.asarray(net.blobs[name].cpu_data(), dtype=np.float32)
                shape = values.shape
                datum.channels, datum.height, datum.width = (_legacy(shape, 1),
                                                             _legacy(shape, 2),
                                                             _legacy(shape, 3))
                for image in values.reshape(shape[0] if shape else 1, -1):
                    del datum.float_data[:]
                    datum.float_data.extend(image.tolist())
                    txn.put(b"%010d" % counts[name], datum.SerializeToString())
                    counts[name] += 1
                    if counts[name] % LOG_EVERY == 0:
                        txn.commit()
                        log.info("Extracted features of %d query images for feature blob %s",
                                 counts[name], name)
        for name, txn in zip(blob_names, txns):
            txn.commit()
            if counts[name] % LOG_EVERY:
                log.info("Extracted features of %d query images for feature blob %s",
                         counts[name], name)
    log.info("Successfully extracted the features!")
    return counts


def _main(argv):
    from minicaffe.core.errors import MinicaffeError
    ap = argparse.ArgumentParser(
        prog="minicaffe extract_features",
        description="Write blobs of a trained net, image by image, to LMDB/LevelDB "
                    "(Caffe's extract_features).")
    ap.add_argument("pretrained_net_param", help="the trained weights (.caffemodel)")
    ap.add_argument("feature_extraction_proto_file",
                    help="the net definition (its TEST phase; its data layer feeds it)")
    ap.add_argument("extract_feature_blob_names", help="blob names, separated by ','")
    ap.add_argument("save_feature_dataset_names",
                    help="one new database per blob, separated by ','")
    ap.add_argument("num_mini_batches", type=int, help="the number of forward passes")
    ap.add_argument("db_type", choices=("lmdb", "leveldb"), help="the database type")
    ap.add_argument("mode", nargs="?", default="CPU", choices=("CPU", "GPU"),
                    help="CPU (default) or GPU")
    ap.add_argument("device_id", nargs="?", type=int, default=0,
                    help="the GPU (default 0)")
    args = ap.parse_args(argv)
    for path, what in ((args.pretrained_net_param, "pretrained_net_param"),
                       (args.feature_extraction_proto_file, "feature_extraction_proto_file")):
        import os
        if not os.path.isfile(path):
            raise MinicaffeError(f"{path}: no such file ({what})")
    extract_features(args.pretrained_net_param, args.feature_extraction_proto_file,
                     args.extract_feature_blob_names.split(","),
                     args.save_feature_dataset_names.split(","), args.num_mini_batches,
                     args.db_type, args.device_id if args.mode == "GPU" else None)


def main(argv=None):
    return toolutil.run("extract_features", _main, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
