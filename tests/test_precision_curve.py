"""benchmarks/precision_curve.py (issue 20's loss-curve target) on a tiny input: the
ResNet-style net trains in fp32, bf16 and fp16 from the same seed on the same batches, so
the three first losses are finite and nearly equal, and the reduced ones are not fp32's."""
import numpy as np

from repo_scripts import load_script


def _curve_module():
    return load_script("benchmarks/precision_curve.py")


def test_three_precisions_start_on_the_same_loss_and_stay_finite():
    m = _curve_module()
    x, y = m.synthetic_images(24, 8)
    res = m.run_curves(x, y, iterations=6, batch=4, size=8, channels=(4, 8), blocks=1)
    ref = res["fp32"][0]
    assert len(ref) == 6 and ref[0] > 1.0          # ten classes at the start: about ln 10
    for p in ("bf16", "fp16"):
        losses, scaler = res[p]
        assert np.isfinite(losses).all(), (p, losses)
        # same weights, same batch: only the rounding of the feature maps differs
        assert abs(losses[0] - ref[0]) < 1e-2 * ref[0], (p, losses[0], ref[0])
        assert losses != ref, p                      # the rounding did happen
    assert res["bf16"][1] is None                    # bf16 needs no loss scaling
    assert res["fp16"][1].dynamic and res["fp16"][1].skipped == 0
    gap, _ = m.max_gap(res["bf16"][0], ref, window=3)
    assert 0 < gap < 0.1
