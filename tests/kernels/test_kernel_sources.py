"""The CUDA sources of the 2-byte kernels (pool16, vec16, conv16, the channels-last batch
norm of reduced.py) and of SoftmaxWithLoss, assembled as the GPU compiles them
(``_backend.kernel_code``), checked on the CPU: every function is defined once in each
(the helpers they share -- vec16's LD16, ST16, ROUND_V, pool16's MC_DECODE/MC_WINDOW,
the loss's mc_label_loss -- are pasted in once, not restated), and where ``nvcc`` is
installed each compiles to PTX for sm_90 with the kernels' NVRTC options.  Their
results are the GPU tests' business (tests/test_pool16_gpu.py, test_reduced_kernels_gpu.py,
test_conv16_gpu.py, layers/test_loss.py)."""
import collections
import re
import shutil
import subprocess

import pytest

from minicaffe.core import precision as P
from minicaffe.kernels import _backend, conv16, pool16, reduced, vec16
from minicaffe.layers import loss

KINDS = {"bf16": P.BFLOAT16, "f16": P.FLOAT16}


@pytest.fixture
def sources(monkeypatch):
    """{label: CUDA C} of every variant the factories build (V lanes, 32/64-bit indices,
    each storage type), built without CuPy: the factories' raw_kernel gives the code."""
    def code(source, name, ctype):
        return _backend.kernel_code(source, ctype)
    for m in (pool16, vec16, conv16, reduced):
        monkeypatch.setattr(m, "raw_kernel", code)
    out = {}
    for tag, s in KINDS.items():
        for v in (1, 2, 4, 8):
            for wide in (False, True):
                out[f"pool16 {tag} V{v} wide{int(wide)}"] = pool16._kernel.__wrapped__(
                    s, v, wide, "mc_max_pool16_fwd")
            out[f"vec16 {tag} V{v}"] = vec16._fn.__wrapped__(s, v, "mc_v16_to")
            out[f"bn16v {tag} V{v}"] = reduced._bn16_kernels(s, v)[0]
        out[f"conv16 {tag}"] = conv16._module.__wrapped__(
            s, 3, 3, 3, 16, 1, 1, 1, 1, 1, 1)["mc_conv16_wgrad"]
    for ct in ("float", "double"):
        out[f"softmax loss {ct}"] = _backend.kernel_code(loss._SOFTMAX_LOSS_SRC, ct)
    return out


_DEF = re.compile(r"(?:__device__[\w\s]*?|__global__ void(?: __launch_bounds__\([^)]*\))?)"
                  r"\s+(\w+)\s*\(")


def test_every_function_is_defined_once(sources):
    for label, code in sources.items():
        funcs = collections.Counter(_DEF.findall(code))
        assert "mc_ld" in funcs or label.startswith(("bn16v", "softmax")), label
        assert [f for f, n in funcs.items() if n > 1] == [], label


def test_the_shared_helpers_are_pasted_in_once(sources):
    for label, code in sources.items():
        if label.startswith(("pool16", "vec16", "conv16")):
            assert code.count(vec16.LD16) == 1, label
        if label.startswith(("pool16", "vec16", "bn16v")):
            assert code.count(vec16.ST16) == 1, label
        if label.startswith("vec16"):
            for s in KINDS.values():
                assert code.count(vec16.ROUND_V[s]) == 1, label
    assert sources["softmax loss float"].count("atomicCAS(bad") == 1
    for tag in KINDS:
        code = sources[f"pool16 {tag} V8 wide0"]
        assert code.count("IDX t = (i) / CV;") == 1      # the thread decode, MC_DECODE's
        assert code.count("const int h0 =") == 1          # the window, MC_WINDOW's


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA toolkit)")
def test_the_sources_compile_for_sm_90(sources, tmp_path):
    # a variant of each kind (the V = 2, 4 ones differ only in their typedefs)
    picked = [k for k in sources if not re.search(r" V[24]\b| V1 wide0| V8 wide1", k)]
    procs = []
    for i, label in enumerate(picked):
        cu = tmp_path / f"k{i}.cu"
        cu.write_text(sources[label])
        procs.append((label, subprocess.Popen(
            ["nvcc", "-ptx", "-arch=sm_90", *_backend.NVRTC_OPTIONS, str(cu), "-o",
             str(tmp_path / f"k{i}.ptx")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)))
        if len(procs) >= 2:
            _check(procs.pop(0))
    for p in procs:
        _check(p)


def _check(labelled):
    label, proc = labelled
    out, _ = proc.communicate()
    assert proc.returncode == 0, f"{label}:\n{out}"
