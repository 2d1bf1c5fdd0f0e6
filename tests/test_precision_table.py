"""benchmarks/precision_table.py (issue 20's table) without a GPU: which command each
configuration runs, where each run's figures land in the two tables, a failed run as a
'fail' cell with exit 1, and a wrong flag or a machine without a GPU as one error line
with exit 2 and nothing run."""
import json

from repo_scripts import load_script


def _table_module():
    return load_script("benchmarks/precision_table.py")


def test_each_configuration_runs_its_own_command():
    m = _table_module()
    args = m.argparse.Namespace(gpu=1, iterations=4, repeats=2, warmup=1)
    base = ["bench", "--gpu", "1", "--model", "M", "--batch", "8"]
    fp32 = m.mc_command(args, "M", 8, "fp32", "o.json")
    assert fp32[3:10] == base and "--precision" not in fp32 and "--tf32" not in fp32
    assert "--tf32" in m.mc_command(args, "M", 8, "tf32", "o.json")
    for p in ("bf16", "fp16"):
        cmd = m.mc_command(args, "M", 8, p, "o.json")
        assert cmd[cmd.index("--precision") + 1] == p
    t = m.torch_command(args, "M", 8, "defaults", "o.json")
    assert t[t.index("--worker") + 1] == "defaults" and t[t.index("--json") + 1] == "o.json"


def test_figures_land_in_their_cells_and_a_failed_run_is_a_fail_cell(monkeypatch, tmp_path,
                                                                       capsys):
    m = _table_module()
    monkeypatch.setattr(m, "check_environment", lambda gpu: None)
    ms = {("mc", "fp32"): 1.0, ("mc", "tf32"): 2.0, ("mc", "bf16"): 3.0, ("mc", "fp16"): 4.0,
          ("torch", "fp32"): 5.0, ("torch", "defaults"): 6.0, ("torch", "bf16"): 7.0}
    mib = 1 << 20

    def fake_run(cmd, timeout):
        kind = "torch" if "--worker" in cmd else "mc"
        mode = cmd[cmd.index("--worker") + 1] if kind == "torch" else (
            "tf32" if "--tf32" in cmd else
            cmd[cmd.index("--precision") + 1] if "--precision" in cmd else "fp32")
        if kind == "mc" and mode == "fp16":
            return None, "exit 1: boom"
        t = ms[(kind, mode)]
        if kind == "mc":
            return {"machine": {"gpu": "G", "cpu": "C", "logical_cpus": 2},
                    "versions": {"python": "3", "cupy": "14"},
                    "nets": [{"results": [{"ms_per_iter": t, "peak_bytes": 100 * t * mib}],
                              "gpu_step": {"cuda_graph": mode != "tf32"}}]}, None
        return {"machine": {}, "versions": {"torch": "2", "torch_cudnn": 9},
                "graph": {"ms_per_iter": t, "peak_bytes": 100 * t * mib},
                "eager": {"ms_per_iter": 10 * t, "peak_bytes": 1000 * t * mib}}, None

    monkeypatch.setattr(m, "run_one", fake_run)
    out = tmp_path / "t.json"
    assert m.main(["--nets", "lenet", "--json", str(out)]) == 1
    text = capsys.readouterr().out
    assert "LeNet b64: minicaffe fp16: failed (exit 1: boom)" in text
    # a step that was not replayed as a CUDA graph is marked, in its line and its cell
    assert "LeNet b64: minicaffe tf32: 2.00 ms, peak 200.0 MiB (eager: no CUDA graph)" in text
    assert ("| LeNet b64 | 1.00 | 2.00 (eager) | 3.00 | fail | 5.00 | 6.00 | 70.00 / 7.00 |"
            in text)
    assert ("| LeNet b64 | 100.0 | 200.0 | 300.0 | fail | 500.0 | 600.0 | 7,000.0 / 700.0 |"
            in text)
    assert "torch 2 (cuDNN 9)" in text
    rows = json.loads(out.read_text())["rows"]
    assert {(r["engine"], r["mode"]) for r in rows} == set(ms) - {("mc", "fp16")}


def test_a_wrong_flag_or_no_gpu_is_one_line_and_nothing_runs(monkeypatch, capsys):
    m = _table_module()
    monkeypatch.setattr(m, "run_one", lambda *a: (_ for _ in ()).throw(AssertionError("ran")))
    assert m.main(["--nets", "lenet,nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["precision_table: error: --nets: unknown net 'nope' (one of lenet, "
                   "cifar10_quick, alexnet, vgg16, resnet50)"]
    assert m.main(["--gpu", "99", "--nets", "lenet"]) == 2     # no GPU 99 (or no torch/CUDA)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("precision_table: error: ")


def test_configs_runs_only_the_named_configurations(monkeypatch, capsys):
    m = _table_module()
    monkeypatch.setattr(m, "check_environment", lambda gpu: None)
    ran = []
    mib = 1 << 20

    def fake_run(cmd, timeout):
        if "--worker" in cmd:
            ran.append(("torch", cmd[cmd.index("--worker") + 1]))
            return {"machine": {}, "versions": {"torch": "2", "torch_cudnn": 9},
                    "graph": {"ms_per_iter": 2.0, "peak_bytes": 20 * mib},
                    "eager": {"ms_per_iter": 9.0, "peak_bytes": 90 * mib}}, None
        ran.append(("mc", cmd[cmd.index("--precision") + 1]))
        return {"machine": {"gpu": "G", "cpu": "C", "logical_cpus": 2},
                "versions": {"python": "3", "cupy": "14"},
                "nets": [{"results": [{"ms_per_iter": 1.0, "peak_bytes": 10 * mib}],
                          "gpu_step": {"cuda_graph": True}}]}, None

    monkeypatch.setattr(m, "run_one", fake_run)
    assert m.main(["--nets", "lenet", "--configs", "mc-bf16,torch-bf16"]) == 0
    assert ran == [("mc", "bf16"), ("torch", "bf16")]
    text = capsys.readouterr().out
    assert "| LeNet b64 | - | - | 1.00 | - | - | - | 9.00 / 2.00 |" in text
    assert m.main(["--nets", "lenet", "--configs", "mc-bf16,mc-int8"]) == 2
    assert capsys.readouterr().err.strip().startswith(
        "precision_table: error: --configs: unknown configuration 'mc-int8'")
