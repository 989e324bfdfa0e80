"""The benchmark runner (``benchmarks/run.py``) and the measurements it is built on
(:mod:`mixerzoo.evaluation.cost`): the launch counter's exact counts and host syncs, the CLI on tiny sizes and the
shape of its JSON and markdown, each cell's error kept to its own mixer, and the diagnostics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixerzoo.evaluation import cost

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "run.py"


def test_launch_count_counts_a_known_sequence_exactly():
    """Forward ``(x * w).sin().sum()`` (mul, sin, sum) and its backward (ones_like, expand: sum's, cos and mul:
    sin's, mul: the product's, detach: the gradient stored), each operator counted; the view and the detach
    launch nothing; no host sync."""
    x = torch.randn(8, 8, requires_grad=True)
    w = torch.randn(8, 8)

    def step():
        (x * w).sin().sum().backward()

    step()
    x.grad = None
    with cost.LaunchCount() as count:
        step()
    assert dict(count.ops) == {"aten.mul": 3, "aten.sin": 1, "aten.sum": 1, "aten.ones_like": 1, "aten.expand": 1,
                               "aten.cos": 1, "aten.detach": 1}
    assert count.n_ops == 9 and count.launches == 7 and not count.host_syncs
    assert cost.count_launches(lambda: torch.add(x, 1)) == {
        "ops": 1, "launches": 1, "host_syncs": 0, "triton": 0, "sync_ops": {}, "top": {"aten.add": 1}}


@torch.library.custom_op("mixerzoo_test::fused_sin_cos", mutates_args=())
def _fused(x: torch.Tensor) -> torch.Tensor:
    return (x.sin() * 2).cos()


def test_launch_count_counts_a_custom_operator_as_one():
    """A custom operator (how a fused kernel is registered) is one launch; the operators of its implementation
    are not counted."""
    counted = cost.count_launches(lambda: _fused(torch.randn(8)))
    assert counted["top"] == {"mixerzoo_test.fused_sin_cos": 1, "aten.randn": 1} and counted["launches"] == 2


def test_launch_count_sees_host_syncs():
    """A planted ``.item()`` (and ``bool``, ``nonzero``, a boolean mask, ``repeat_interleave`` without its output
    size) is a host sync; ``repeat_interleave`` with ``output_size`` is not."""
    x = torch.randn(16)
    plain = cost.count_launches(lambda: x.exp().sum())
    planted = cost.count_launches(lambda: x.exp().sum().item())
    assert plain["host_syncs"] == 0 and planted["host_syncs"] == 1
    assert planted["sync_ops"] == {"aten._local_scalar_dense": 1} and planted["ops"] == plain["ops"] + 1
    reps = torch.tensor([1, 2])
    many = cost.count_launches(lambda: (bool(x[0] > 0), (x > 0).nonzero(), x[x > 0], torch.repeat_interleave(reps),
                                        torch.repeat_interleave(reps, output_size=3)))
    assert many["sync_ops"] == {"aten._local_scalar_dense": 1, "aten.nonzero": 1, "aten.index": 1,
                                "aten.repeat_interleave": 1}


def test_launch_count_counts_a_triton_kernel_as_one(monkeypatch):
    """A Triton kernel (here run by Triton's interpreter on the CPU) counts as one launch, and the interpreter's
    own work inside it is hidden; the launcher is restored afterwards."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

    x = torch.zeros(100)
    launcher = type(add_one).run
    add_one[(4,)](x, 100, BLOCK=32)
    with cost.LaunchCount() as count:
        add_one[(4,)](x, 100, BLOCK=32)
        x.mul(2)
    assert count.triton == 1 and dict(count.ops) == {"aten.mul": 1} and count.launches == 2
    assert torch.equal(x, torch.full((100,), 2.0)) and type(add_one).run is launcher


def test_training_step_time_and_memory_on_one_layer():
    """cost.time_training_steps gives one time per repeat; cost.training_step_memory (CPU): the live peak is at
    least what the forward keeps, and both are positive."""
    layer = torch.nn.Linear(16, 16)
    mixer = lambda x, state=None: (layer(x), None)  # noqa: E731 - the Mixer protocol's shape
    mixer.parameters = layer.parameters
    mixer.zero_grad = layer.zero_grad
    x = torch.randn(1, 64, 16, requires_grad=True)
    assert len(cost.time_training_steps(mixer, x, 3)) == 3
    mem = cost.training_step_memory(mixer, x)
    assert mem["live_mib"] >= mem["kept_mib"] > 0


def test_the_runner_writes_json_and_markdown_on_tiny_sizes(tmp_path):
    """``run.py --measure train decode launches`` on tiny sizes in one shared worker: a markdown table per
    measurement, and JSON with the settings, every cell and no error; attention's training step at 64 tokens
    dispatches the same operators every time and syncs with the host never."""
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, str(RUN), "--measure", "train", "decode", "launches", "--mixers",
                           "attention", "swa-512", "--lengths", "64", "--repeats", "1", "--d-model", "32",
                           "--head-dim", "16", "--decode-contexts", "16", "32", "--decode-steps", "2",
                           "--decode-rounds", "1", "--processes", "shared", "--threads", "1", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    md = done.stdout
    for header in ("## Training step", "## Decode", "## Launch count"):
        assert header in md
    assert "| 64 | swa-512 |" in md and "| swa-512 | 64 |" in md and "| attention | " in md
    figures = json.loads(out.read_text())
    assert figures["errors"] == {}
    settings = figures["settings"]
    assert settings["d_model"] == 32 and settings["command"].startswith("python benchmarks/run.py")
    assert set(figures["train"]) == {"attention", "swa-512"}
    assert len(figures["train"]["attention"]["64"]["times_s"]) == 1
    assert set(figures["decode"]["attention"]) == {"16", "32"}
    assert figures["decode"]["attention"]["32"]["state_bytes"] > figures["decode"]["attention"]["16"]["state_bytes"]
    train = figures["launches"]["attention"]["64"]["train"]
    assert train["ops"] >= train["launches"] > 0 and train["host_syncs"] == 0
    assert figures["launches"]["attention"]["64"]["decode"]["launches"] > 0


def test_the_runner_prints_the_rows_max_len_skips_and_stamps_its_table(tmp_path):
    """A mixer past its ``--max-len`` gets a row saying it was skipped and why (and a JSON entry), not silence; the
    table starts with the stamp: the command, the CPU model and flags, torch, threads, the date."""
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, str(RUN), "--measure", "train", "--mixers", "attention", "swa-512",
                           "--lengths", "32", "64", "--max-len", "swa-512=32", "--repeats", "1", "--d-model", "32",
                           "--head-dim", "16", "--processes", "shared", "--threads", "1", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    md = done.stdout
    assert "skipped" not in next(line for line in md.splitlines() if line.startswith("| 32 | swa-512 | "))
    assert "| 64 | swa-512 | skipped: past its --max-len swa-512=32 (measure it with --max-len swa-512=64" in md
    assert "| 64 | attention | " in md
    figures = json.loads(out.read_text())
    assert set(figures["skipped"]) == {"train/swa-512/64"} and "64" not in figures["train"]["swa-512"]
    head = md.splitlines()[:2]
    assert head[0].startswith("# Made by `python benchmarks/run.py --measure train") and " UTC" in head[0]
    assert head[1].startswith("# Machine: ") and "torch " in head[1] and "1 threads" in head[1]
    assert figures["settings"]["command"].startswith("python benchmarks/run.py --measure train")
    assert {"cpu", "cpu_flags", "date", "torch", "threads"} <= set(figures["settings"])


def test_the_runner_refuses_what_does_not_fit():
    for argv, message in ((["--d-model", "30", "--head-dim", "16"], "not a multiple"),
                          (["--model-layers", "2", "--measure", "launches"], "leave launches out"),
                          (["--measure", "train", "decode", "--skip-kernels"], "a time meaningless"),
                          (["--mixers", "nope"], "invalid choice")):
        done = subprocess.run([sys.executable, str(RUN), *argv], capture_output=True, text=True)
        assert done.returncode == 2 and message in done.stderr


def test_efficiency_cells_keep_errors_and_timeouts_to_their_own_mixer(benchmark_script):
    """--processes shared: a mixer that raises fills its own cells with its error; a cell over the timeout is
    killed with its worker, the same mixer's later cells are skipped, and a fresh worker finishes the others."""
    bench = benchmark_script("run")
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
    bench = benchmark_script("run")
    monkeypatch.setitem(bench.MIXERS, "broken", ("attention", {"no_such_option": 1}))
    times = bench.worker({"what": "time", "T": 64, "mixers": ["attention", "broken"], "repeats": 2, "threads": 1,
                          "d_model": 64, "head_dim": 32})
    assert len(times["attention"]) == 2 and "no_such_option" in times["broken"]["error"]


def test_calling_line_goes_by_module_name_not_by_path(benchmark_script):
    """A frame is mixerzoo's by its module's name: torch's code in a folder named ``mixerzoo`` is not, a plugin's
    module is wherever its file lies."""
    bench = benchmark_script("run")
    found = {}
    for module, path in (("torch.fake", "/clone/mixerzoo/.venv/lib/torch/fake.py"),
                         ("mixerzoo_kvm.fake", "/somewhere/else/fake.py")):
        scope = {"__name__": module, "calling_line": bench.calling_line}
        exec(compile("def f():\n    return calling_line(1)\n", path, "exec"), scope)
        found[module] = scope["f"]()
    assert found == {"torch.fake": "", "mixerzoo_kvm.fake": "fake.py:2 f"}
    assert bench.is_ours("mixerzoo.mixers.attention") and not bench.is_ours("mixerzoo2")


def test_memory_profile_lists_what_is_alive_at_the_peak(capsys, benchmark_script):
    """run.py --memory-profile: two tables, the storages alive at the step's peak and those kept when the
    forward ends (by operator, shape and calling line); each table's rows add up to the total its header reports,
    the kept total is below the peak, and the projections (aten.mm outputs of T x d_model, made in qkv.py) are in
    both; at the peak, gradients made by autograd's engine are charged to no line of ours."""
    bench = benchmark_script("run")
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
    """run.py --model-layers: the training-step memory of an n-block language model of the mixer (token
    ids in, next-token cross-entropy out): each block keeps its own activations, so two blocks keep more than one
    and the live peak is at least what the forward keeps; asking for decode with it is refused, naming the fix."""
    bench = benchmark_script("run")
    one, two = (bench.worker({"what": "memory", "mixer": "attention", "T": 300, "threads": 1, "layers": n})
                for n in (1, 2))
    assert two["live_mib"] >= two["kept_mib"] > one["kept_mib"] > 0
    model = bench.build("swa-512", {"layers": 2})
    assert len(model.blocks) == 2 and all(b.mixer_name == "swa" for b in model.blocks)
    run = subprocess.run([sys.executable, bench.__file__, "--model-layers", "2", "--mixers", "attention"],
                         capture_output=True, text=True)
    assert run.returncode != 0 and "add --decode-contexts with no value" in run.stderr


def test_decode_rounds_take_the_contexts_in_turn_from_their_prefilled_states():
    """The decode table: each context is prefilled once (pieces of 4,096), one untimed step from each follows;
    every round starts each context's steps from its prefilled state, the contexts in an order rotated by one each
    round, and gives one ms/token per context and round; the state bytes are those after each prefill."""
    calls = []

    class Counting(torch.nn.Module):  # state: a tensor of the tokens seen; records (tokens in the call, seen)
        def forward(self, x, state=None):
            seen = 0 if state is None else int(state.numel())
            calls.append((x.shape[1], seen))
            return x, torch.zeros(seen + x.shape[1], dtype=torch.int8)

    times, state = cost.decode_rounds(Counting(), [3, 5000], steps=2, rounds=3, d_model=4)
    assert set(times) == {3, 5000} and all(len(v) == 3 and min(v) > 0 for v in times.values())
    assert state == {3: 3, 5000: 5000}
    assert calls[:5] == [(3, 0), (4096, 0), (904, 4096), (1, 3), (1, 5000)]
    starts = [seen for n, seen in calls[5:] if n == 1][::2]  # the first step of each context's run
    assert starts == [3, 5000, 5000, 3, 3, 5000]


def test_op_lines_charge_operators_to_the_lines_that_called_them(capsys, benchmark_script):
    """run.py --op-lines: one row per calling line of mixerzoo code, sorted by time; the projections are found in
    qkv.py, and a training step's backward has rows of autograd's own nodes."""
    bench = benchmark_script("run")
    bench.op_lines("attention", 300, {"threads": 1, "dtype": "fp32"}, rows=1000)
    out = capsys.readouterr().out
    assert out.startswith("# operators' time per calling line: attention, one training step at T = 300")
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    times = [float(r[0][2:]) for r in rows]
    assert times == sorted(times, reverse=True) and all(int(r[1]) > 0 for r in rows)
    lines = [r[2] for r in rows]
    assert any(line.startswith("qkv.py:") for line in lines)
    assert "(autograd backward nodes) |" in lines


def test_benchmark_precision_must_be_named(benchmark_script):
    """A task's dtype other than fp32 / bf16 is refused, not taken for bf16."""
    device = benchmark_script("_device")
    with pytest.raises(ValueError, match="'fp32' or 'bf16'"):
        device.autocast("cpu", "float32")


def test_tova_memory_table_swaps_through_the_core_and_measures_through_cost(tmp_path, benchmark_script, capsys):
    """``papers/bench_tova_memory.py`` at its smallest: the state of TOVA at multi-state 16 is 16 of full
    attention's 64 entries per layer (keys, values and an int64 position each), the table carries the stamp."""
    memory = benchmark_script("papers/bench_tova_memory")
    out = tmp_path / "m.md"
    memory.main(["--tokens", "64", "--batch", "2", "--decode", "2", "--chunk", "32", "--sizes", "16,full",
                 "--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--vocab-size", "64", "--threads", "1",
                 "--out", str(out)])
    rows = {r["size"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    per_entry = 2 * (2 * 2 * 16 * 4 + 8)  # 2 layers x (2 heads x key + value of 16 fp32 channels, one position)
    assert rows["16"]["state_mib_per_row"] * 2**20 == 16 * per_entry
    assert rows["full"]["state_mib_per_row"] * 2**20 == 64 * 2 * 2 * 2 * 16 * 4  # attention keeps no positions
    assert rows["16"]["peak_mem_bytes"] > 0
    text = out.read_text()
    assert text.startswith("Made by `python ") and "\nMachine: " in text and "| 16 | " in text
