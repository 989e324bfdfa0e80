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


@pytest.mark.parametrize("dry", [False, True])
def test_every_step_names_files_that_exist(tmp_path, dry, benchmark_script):
    suite = benchmark_script("gpu_suite")
    args = suite.parse_args(["--out", str(tmp_path), "--wheels", str(tmp_path)] + (["--dry-run"] if dry else []))
    steps = suite.plan(args)
    assert [s.name for s in steps] == suite.STEPS
    for s in steps:
        for token in s.cmd[1:]:
            if token.endswith((".py", ".yaml")) and not token.startswith("-"):
                assert (ROOT / token).is_file(), f"{s.name}: {token} does not exist"
    by_name = {s.name: s.cmd for s in steps}
    assert ("cuda" not in by_name["efficiency"]) == dry and ("cuda" not in by_name["throughput"]) == dry
    assert by_name["resume"][-2:] == ["--ckpt_path", "last"]
    assert by_name["resume"][by_name["resume"].index("--trainer.max_steps") + 1] == str(2 * args.train_steps)


def test_the_training_step_is_a_valid_fit_command(tmp_path, benchmark_script):
    """The recipe and every override of the train step parse (``--print_config``: no training)."""
    suite = benchmark_script("gpu_suite")
    cmd = next(s.cmd for s in suite.plan(suite.parse_args(["--out", str(tmp_path), "--dry-run"]))
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


def test_dry_run_of_the_benchmarks_writes_their_tables(tmp_path):
    """The efficiency and throughput steps at toy sizes on the CPU (bf16 autocast): exit 0, tables written, and
    the summary records each step."""
    done = subprocess.run([sys.executable, str(SUITE), "--dry-run", "--out", str(tmp_path), "--only", "efficiency",
                           "throughput"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, (tmp_path / "summary.md").read_text() if (tmp_path / "summary.md").exists() else done
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(r["step"], r["rc"]) for r in summary] == [("efficiency", 0), ("throughput", 0)]
    table = (tmp_path / "efficiency.md").read_text()
    assert "| 1k | kvm-256 |" in table and "cpu, bf16" in table
    figures = json.loads((tmp_path / "efficiency.json").read_text())
    assert set(figures["train"]) == {"attention", "kvm-256"}
    assert "ratio mixerzoo / llama" in (tmp_path / "throughput.txt").read_text()


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
