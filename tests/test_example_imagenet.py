"""examples/imagenet: the generated image folder, create_imagenet.sh (convert_imageset with
resize and shuffle, raw and --encoded) and make_imagenet_mean.sh, on a few images."""
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("lmdb")
pytest.importorskip("PIL")
REPO = pathlib.Path(__file__).resolve().parents[1]
EX = REPO / "examples" / "imagenet"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("encoded", ["0", "1"])
def test_create_and_mean_steps_on_a_generated_folder(tmp_path, encoded):
    from minicaffe.data.db import open_db, parse_datum
    from minicaffe.data.transformer import load_mean_file
    sys.path.insert(0, str(EX))
    try:
        from make_image_folder import make_image_folder
    finally:
        sys.path.remove(str(EX))
    train, val, mean_bytes = make_image_folder(str(tmp_path / "imgs"), classes=3, per_class=4,
                                               val_per_class=1, size=48)
    assert mean_bytes > 500
    path = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), EXAMPLE=str(tmp_path), DATA=str(tmp_path),
               LISTS=str(tmp_path / "imgs"), TRAIN_DATA_ROOT=str(tmp_path / "imgs/train") + "/",
               VAL_DATA_ROOT=str(tmp_path / "imgs/val") + "/", ENCODED=encoded)
    for script in ("create_imagenet.sh", "make_imagenet_mean.sh"):
        r = subprocess.run(["bash", str(EX / script)], env=env, capture_output=True, text=True,
                           cwd=str(tmp_path), timeout=120)
        assert r.returncode == 0, r.stdout[-1000:] + r.stderr[-2000:]
    db = open_db(str(tmp_path / "ilsvrc12_train_lmdb"))
    try:
        records = [(k, parse_datum(v)) for k, v in db]
    finally:
        db.close()
    assert len(records) == 12
    assert {d.label for _, d in records} == {0, 1, 2}
    assert all(d.encoded == (encoded == "1") for _, d in records)
    if encoded == "0":
        assert all((d.channels, d.height, d.width) == (3, 256, 256) for _, d in records)
    order = [k.split(b"_", 1)[1] for k, _ in records]
    assert order != sorted(order)  # --shuffle
    mean = load_mean_file(str(tmp_path / "imagenet_mean.binaryproto"))
    assert mean.shape == (3, 256, 256) and 0 < float(np.mean(mean)) < 255
