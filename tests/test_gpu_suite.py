"""``benchmarks/gpu_suite.py``: the GPU suite's plumbing, checked on the CPU (its ``--dry-run`` and ``--list``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "gpu_suite.py"


def fake_wheel(folder: Path, dist: str, version: str = "1.0") -> Path:
    """A minimal wheel of one module ``<dist>_probe`` (pip installs it like any other)."""
    import base64
    import hashlib
    import zipfile

    name = dist.replace("-", "_")
    files = {f"{name}_probe.py": "VALUE = 1\n",
             f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
             f"{name}-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                  "Tag: py3-none-any\n"}
    def digest(text: str) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()

    record = "".join(f"{path},sha256={digest(text)},{len(text.encode())}\n" for path, text in files.items())
    files[f"{name}-{version}.dist-info/RECORD"] = record + f"{name}-{version}.dist-info/RECORD,,\n"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return wheel


@pytest.mark.parametrize("dry", [False, True])
def test_every_step_names_files_that_exist(tmp_path, dry, benchmark_script):
    suite = benchmark_script("gpu_suite")
    args = suite.parse_args(["--out", str(tmp_path), "--wheels", str(tmp_path), "--with-training"]
                            + (["--dry-run"] if dry else []))
    steps = suite.plan(args)
    assert [s.name for s in steps] == suite.STEPS + suite.OPTIONAL
    for s in steps:
        for token in s.cmd[1:]:
            if token.endswith((".py", ".yaml")) and not token.startswith("-"):
                assert (ROOT / token).is_file(), f"{s.name}: {token} does not exist"
    by_name = {s.name: s.cmd for s in steps}
    assert ("cuda" not in by_name["efficiency"]) == dry and ("cuda" not in by_name["throughput"]) == dry
    assert by_name["resume"][-2:] == ["--ckpt_path", "last"]
    assert by_name["resume"][by_name["resume"].index("--trainer.max_steps") + 1] == str(2 * args.train_steps)
    assert [s.name for s in suite.plan(suite.parse_args(["--out", str(tmp_path)]))] == suite.STEPS[1:]


def test_the_default_steps_fit_one_nine_minute_command(tmp_path, benchmark_script):
    """The default timeouts (conformance and fla-kernels side by side) fit the default budget, which fits 9
    minutes; the efficiency table is told a budget under 4 minutes; every mixer and length the GPU table needs is in it;
    the conformance run is verbose with fla's tests last; and the files written stay within 8."""
    suite = benchmark_script("gpu_suite")
    steps = suite.plan(suite.parse_args(["--out", str(tmp_path), "--wheels", str(tmp_path)]))
    total, i = 0, 0
    while i < len(steps):
        n = 2 if steps[i].beside_next else 1
        total += max(s.timeout for s in steps[i:i + n])
        i += n
    args = suite.parse_args(["--out", str(tmp_path)])
    assert total <= args.budget - 5 and args.budget <= 540
    eff = next(s for s in steps if s.name == "efficiency")
    assert eff.timeout - suite.BUDGET_MARGIN <= 240 and eff.budget_flag == "--budget"
    mixers = eff.cmd[eff.cmd.index("--mixers") + 1:eff.cmd.index("--lengths")]
    assert sorted(mixers) == sorted(["attention", "kvm-256", "kvm-sqrt", "ovq", "trellis", "gdn", "gsa", "swa-512"])
    assert mixers[0] == "attention"
    assert eff.cmd[eff.cmd.index("--lengths") + 1:][:3] == ["8192", "32768", "--max-len"]
    assert eff.cmd[eff.cmd.index("--decode-contexts") + 1:][:2] == ["1024", "16384"]
    conf = next(s.cmd for s in steps if s.name == "conformance")
    assert "-v" in conf and conf[conf.index("-k") + 1] == "conformance" and conf[-1].endswith("mixerzoo-fla/tests")
    assert len({s.output for s in steps} | {"summary.md", "efficiency.json"}) <= suite.MAX_FILES


def test_the_training_step_is_a_valid_fit_command(tmp_path, benchmark_script):
    """The recipe and every override of the (opt-in) train step parse (``--print_config``: no training)."""
    suite = benchmark_script("gpu_suite")
    cmd = next(s.cmd for s in suite.plan(suite.parse_args(["--out", str(tmp_path), "--dry-run", "--only", "train"]))
               if s.name == "train")
    done = subprocess.run(cmd + ["--print_config"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "d_model: 64" in done.stdout and "accumulate_grad_batches: 1" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_the_full_suite_refuses_with_the_way_out(tmp_path):
    done = subprocess.run([sys.executable, str(SUITE), "--out", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2
    assert "use --dry-run" in done.stderr
    assert not any(tmp_path.iterdir())


def test_carried_wheels_install_what_is_missing_and_ours(tmp_path, benchmark_script):
    suite = benchmark_script("gpu_suite")
    for dist in ("gpu-suite-probe", "pytest", "mixerzoo-kvm"):
        fake_wheel(tmp_path, dist)
    install, skipped = suite.carried_wheels(str(tmp_path))
    assert [Path(w).name for w in install] == ["gpu_suite_probe-1.0-py3-none-any.whl",
                                               "mixerzoo_kvm-1.0-py3-none-any.whl"]
    assert len(skipped) == 1 and skipped[0].startswith("pytest-1.0-py3-none-any.whl: pytest ")
    assert suite.dist_name("fla_core-0.6.0-py3-none-any.whl") == "fla-core"


def test_fetch_wheels_pins_the_versions_here_for_python_312(tmp_path, benchmark_script, monkeypatch):
    """--fetch-wheels: one ``pip download`` of every third-party wheel at the version installed here, for CPython
    3.12 on manylinux x86_64, then ``pip wheel --no-deps`` of mixerzoo and each plugin (pip itself not run)."""
    suite = benchmark_script("gpu_suite")
    calls = []
    monkeypatch.setattr(suite.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    monkeypatch.setattr(suite.importlib.metadata, "version", lambda name: "9.9")
    assert suite.fetch_wheels(str(tmp_path)) == 0
    download = calls[0]
    assert download[3:6] == ["download", "--no-deps", "--only-binary=:all:"]
    assert "3.12" in download and "manylinux_2_28_x86_64" in download
    assert {a for a in download if "==" in a} == {f"{n}==9.9" for n in suite.THIRD_PARTY}
    built = [Path(c[-1]).name for c in calls[1:]]
    assert all(c[3:6] == ["wheel", "-q", "--no-deps"] for c in calls[1:])
    assert built == [ROOT.name] + [p.name for p in suite.plugin_dirs()]


def test_cap_file_keeps_head_and_tail(tmp_path, benchmark_script):
    suite = benchmark_script("gpu_suite")
    f = tmp_path / "big.txt"
    f.write_bytes(b"H" * 3000 + b"T" * 3000)
    suite.cap_file(f, limit=2000)
    data = f.read_bytes()
    assert len(data) <= 2000 and data.startswith(b"H") and data.endswith(b"T") and b"cut here" in data


def test_dry_run_runs_every_step_within_its_files(tmp_path):
    """The whole suite on the CPU at toy sizes, with a folder of carried wheels: the missing one is installed into
    the site and importable in later steps, the one installed already is left out; every step runs (conformance
    verbose, per test); the efficiency step goes through --processes shared; at most 8 files come out."""
    wheels, out = tmp_path / "wheels", tmp_path / "out"
    wheels.mkdir()
    fake_wheel(wheels, "gpu-suite-probe")
    fake_wheel(wheels, "pytest", "0.1")
    done = subprocess.run([sys.executable, str(SUITE), "--dry-run", "--out", str(out), "--wheels", str(wheels),
                           "--site", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True)
    suite_summary = (out / "summary.md").read_text() if (out / "summary.md").exists() else done.stderr
    summary = json.loads(suite_summary.split("```json\n", 1)[1].split("\n```", 1)[0])
    rcs = {r["step"]: r["rc"] for r in summary}
    assert list(rcs) == ["install", "env", "conformance", "fla-kernels", "efficiency", "throughput"], suite_summary
    assert all(rcs[s] == 0 for s in ("install", "env", "fla-kernels", "efficiency", "throughput")), suite_summary
    assert rcs["conformance"] in (0, 1), suite_summary  # 1: a test failed (others' work), not the plumbing
    assert len(list(out.iterdir())) <= 8 and all(f.is_file() for f in out.iterdir())
    env = (out / "env.txt").read_text()
    assert "installed from the carried wheels" in env and "gpu_suite_probe-1.0" in env
    assert "left out: pytest-0.1-py3-none-any.whl" in env and "mixer attention -> " in env
    conformance = (out / "conformance.txt").read_text()
    assert "tests/test_attention_baselines.py::test_conformance[attention-kw0" in conformance
    assert " PASSED" in conformance
    table = (out / "efficiency.md").read_text()
    assert "| 1k | kvm-256 |" in table and "cpu, bf16" in table and "--processes shared" in table
    figures = json.loads((out / "efficiency.json").read_text())
    assert set(figures["train"]) <= {"attention", "kvm-256"} and "attention" in figures["train"]
    assert "ratio mixerzoo / llama" in (out / "throughput.txt").read_text()


def test_efficiency_cells_keep_errors_and_timeouts_to_their_own_mixer(benchmark_script):
    """--processes shared: a mixer that raises fills its own cells with its error; a cell over the timeout is
    killed with its worker, the same mixer's later cells are skipped, and a fresh worker finishes the others."""
    bench = benchmark_script("bench_efficiency")
    task = {"threads": 1, "device": "cpu", "dtype": "fp32", "d_model": 64, "head_dim": 32, "repeats": 1,
            "steps": 2, "rounds": 1}
    broken = ["attention", {"no_such_option": 1}]
    cells = [{"id": "train/attention/128", "what": "train", "mixer": "attention", "spec": bench.MIXERS["attention"],
              "T": 128},
             {"id": "train/broken/128", "what": "train", "mixer": "broken", "spec": broken, "T": 128},
             {"id": "decode/broken", "what": "decode", "mixer": "broken", "spec": broken, "contexts": [64]},
             {"id": "sleep/slow", "what": "sleep", "mixer": "slow", "seconds": 120, "timeout": 2},
             {"id": "sleep/slow-2", "what": "sleep", "mixer": "slow", "seconds": 0},
             {"id": "decode/attention", "what": "decode", "mixer": "attention", "spec": bench.MIXERS["attention"],
              "contexts": [64, 128]}]
    results = bench.run_cells(task, cells, cell_timeout=60)
    assert len(results["train/attention/128"]["times_s"]) == 1 and results["train/attention/128"]["kept_mib"] > 0
    assert all("no_such_option" in results[c]["error"] for c in ("train/broken/128", "decode/broken"))
    assert results["sleep/slow"]["error"].startswith("timed out after")
    assert results["sleep/slow-2"]["error"] == "skipped: its cell sleep/slow timed out"
    assert set(results["decode/attention"]["ms_per_token_rounds"]) == {"64", "128"}
    assert bench.run_cells(task, cells[:1], budget=0)["train/attention/128"]["error"].startswith("not run")


def test_per_cell_timing_keeps_a_mixers_error_in_its_own_row(benchmark_script, monkeypatch):
    """--processes per-cell (the CPU's default): the timed rounds of one length share a process, and a mixer that
    raises there gets its own error, the others their times."""
    bench = benchmark_script("bench_efficiency")
    monkeypatch.setitem(bench.MIXERS, "broken", ("attention", {"no_such_option": 1}))
    times = bench.worker({"what": "time", "T": 64, "mixers": ["attention", "broken"], "repeats": 2, "threads": 1,
                          "d_model": 64, "head_dim": 32})
    assert len(times["attention"]) == 2 and "no_such_option" in times["broken"]["error"]


def test_calling_line_goes_by_module_name_not_by_path(benchmark_script):
    """A frame is mixerzoo's by its module's name: torch's code in a folder named ``mixerzoo`` is not, a plugin's
    module is wherever its file lies."""
    bench = benchmark_script("bench_efficiency")
    found = {}
    for module, path in (("torch.fake", "/clone/mixerzoo/.venv/lib/torch/fake.py"),
                         ("mixerzoo_kvm.fake", "/somewhere/else/fake.py")):
        scope = {"__name__": module, "calling_line": bench.calling_line}
        exec(compile("def f():\n    return calling_line(1)\n", path, "exec"), scope)
        found[module] = scope["f"]()
    assert found == {"torch.fake": "", "mixerzoo_kvm.fake": "fake.py:2 f"}
    assert bench.is_ours("mixerzoo.mixers.attention") and not bench.is_ours("mixerzoo2")


def test_memory_profile_lists_what_is_alive_at_the_peak(capsys, benchmark_script):
    """bench_efficiency --memory-profile: two tables, the storages alive at the step's peak and those kept when the
    forward ends (by operator, shape and calling line); each table's rows add up to the total its header reports,
    the kept total is below the peak, and the projections (aten.mm outputs of T x d_model, made in qkv.py) are in
    both; at the peak, gradients made by autograd's engine are charged to no line of ours."""
    bench = benchmark_script("bench_efficiency")
    bench.memory_profile("attention", 300, {"threads": 1}, rows=1000)
    tables = capsys.readouterr().out.split("# live tensors")[1:]
    assert [t.split(":", 1)[0].strip() for t in tables] == [
        "at the peak of one training step", "kept at the end of the forward pass (for backward, and the output)"]
    totals, table_rows = [], []
    for table in tables:
        lines = table.splitlines()
        totals.append(float(lines[0].rsplit(":", 1)[1].split()[0]))
        rows = [line.split(" | ") for line in lines if line.startswith("| ") and line[2].isdigit()]
        table_rows.append(rows)
        assert abs(sum(float(r[0][2:]) for r in rows) - totals[-1]) < 0.05 * len(rows) + 0.1
        assert any(r[2] == "aten.mm" and r[3] == "(300, 256)" and r[4].startswith("qkv.py:") for r in rows)
    assert any(r[4] == "(autograd) |" for r in table_rows[0])
    assert 0 < totals[1] < totals[0]


def test_model_layers_measure_a_language_model_of_the_mixer(benchmark_script):
    """bench_efficiency --model-layers: the training-step memory of an n-block language model of the mixer (token
    ids in, next-token cross-entropy out): each block keeps its own activations, so two blocks keep more than one
    and the live peak is at least what the forward keeps; asking for decode with it is refused, naming the fix."""
    bench = benchmark_script("bench_efficiency")
    one, two = (bench.worker({"what": "memory", "mixer": "attention", "T": 300, "threads": 1, "layers": n})
                for n in (1, 2))
    assert two["live_mib"] >= two["kept_mib"] > one["kept_mib"] > 0
    model = bench.build("kvm-256", {"layers": 2})
    assert len(model.blocks) == 2 and all(b.mixer_name == "kvm" for b in model.blocks)
    run = subprocess.run([sys.executable, bench.__file__, "--model-layers", "2", "--mixers", "attention"],
                         capture_output=True, text=True)
    assert run.returncode != 0 and "add --decode-contexts with no value" in run.stderr


def test_decode_rounds_take_the_contexts_in_turn_from_their_prefilled_states(benchmark_script):
    """bench_efficiency's decode table: each context is prefilled once; every round starts each context's steps
    from its prefilled state, the contexts in an order rotated by one each round, and gives one ms/token per
    context and round."""
    bench = benchmark_script("bench_efficiency")
    calls = []

    class Counting(torch.nn.Module):  # state: tokens seen; records (tokens in the call, tokens seen before it)
        def forward(self, x, state=None):
            seen = state or 0
            calls.append((x.shape[1], seen))
            return x, seen + x.shape[1]

    times = bench.decode_rounds(Counting(), [3, 5000], steps=2, rounds=3, d_model=4)
    assert set(times) == {3, 5000} and all(len(v) == 3 and min(v) > 0 for v in times.values())
    prefill = [(3, 0), (4096, 0), (904, 4096)]
    assert calls[:3] == prefill
    starts = [seen for n, seen in calls[3:] if n == 1][::2]  # the first step of each context's run
    assert starts == [3, 5000, 5000, 3, 3, 5000]


def test_op_lines_charge_operators_to_the_lines_that_called_them(capsys, benchmark_script):
    """bench_efficiency --op-lines: one row per calling line of mixerzoo code, sorted by time; KVM's read and its
    routing are found where they are, and a training step's backward has rows of autograd's own nodes."""
    bench = benchmark_script("bench_efficiency")
    bench.op_lines("kvm-256", 1100, {"threads": 1, "dtype": "fp32"}, rows=1000)
    out = capsys.readouterr().out
    assert out.startswith("# operators' time per calling line: kvm-256, one training step at T = 1100")
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    times = [float(r[0][2:]) for r in rows]
    assert times == sorted(times, reverse=True) and all(int(r[1]) > 0 for r in rows)
    lines = [r[2] for r in rows]
    assert any(line.startswith("lean_attention.py:") and line.endswith("forward |") for line in lines)
    assert any(line.startswith("ops.py:") and "route_overflow" in line for line in lines)
    assert "(autograd backward nodes) |" in lines


def test_benchmark_precision_must_be_named(benchmark_script):
    """A task's dtype other than fp32 / bf16 is refused, not taken for bf16."""
    device = benchmark_script("_device")
    with pytest.raises(ValueError, match="'fp32' or 'bf16'"):
        device.autocast("cpu", "float32")
