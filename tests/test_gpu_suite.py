"""``benchmarks/gpu_suite.py`` (the GPU check) and ``benchmarks/device/carry.py`` (its wheels and bounded outputs on a
borrowed machine), checked on the CPU (the suite's ``--dry-run`` and ``--list``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "gpu_suite.py"
CARRY = ROOT / "benchmarks" / "device" / "carry.py"


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
    args = suite.parse_args(["--out", str(tmp_path), "--with-training"] + (["--dry-run"] if dry else []))
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
    assert [s.name for s in suite.plan(suite.parse_args(["--out", str(tmp_path)]))] == suite.STEPS


def test_the_default_steps_fit_one_nine_minute_command(tmp_path, benchmark_script):
    """The default timeouts (conformance and kernels side by side) fit the default budget, which fits 9
    minutes; the efficiency table is told a budget under 4 minutes; every mixer and length the GPU table needs is in it;
    the conformance run is verbose with fla's tests last; and the files written, with carry.py's install log, stay
    within what a borrowed machine returns."""
    suite = benchmark_script("gpu_suite")
    carry = benchmark_script("device/carry")
    steps = suite.plan(suite.parse_args(["--out", str(tmp_path)]))
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
    assert eff.cmd[eff.cmd.index("--decode-contexts") + 1:][:3] == ["1024", "16384", "65536"]
    assert eff.cmd[1] == "benchmarks/run.py" and eff.cmd[eff.cmd.index("--d-model") + 1] == "1024"
    conf = next(s.cmd for s in steps if s.name == "conformance")
    assert "-v" in conf and conf[conf.index("-k") + 1] == "conformance" and conf[-1].endswith("mixerzoo-fla/tests")
    assert len({s.output for s in steps} | {"summary.md", "efficiency.json", "install.txt"}) <= carry.MAX_FILES


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
    suite = benchmark_script("device/carry")
    for dist in ("gpu-suite-probe", "pytest", "mixerzoo-kvm"):
        fake_wheel(tmp_path, dist)
    install, skipped = suite.carried_wheels(str(tmp_path))
    assert [Path(w).name for w in install] == ["gpu_suite_probe-1.0-py3-none-any.whl",
                                               "mixerzoo_kvm-1.0-py3-none-any.whl"]
    assert len(skipped) == 1 and skipped[0].startswith("pytest-1.0-py3-none-any.whl: pytest ")
    assert suite.dist_name("fla_core-0.6.0-py3-none-any.whl") == "fla-core"


def test_fetch_wheels_pins_the_versions_here_for_python_312(tmp_path, benchmark_script, monkeypatch):
    """``carry.py fetch``: one ``pip download`` of every third-party wheel at the version installed here, for CPython
    3.12 on manylinux x86_64, then ``pip wheel --no-deps`` of mixerzoo and each plugin (pip itself not run)."""
    suite = benchmark_script("device/carry")
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
    suite = benchmark_script("device/carry")
    f = tmp_path / "big.txt"
    f.write_bytes(b"H" * 3000 + b"T" * 3000)
    suite.cap_file(f, limit=2000)
    data = f.read_bytes()
    assert len(data) <= 2000 and data.startswith(b"H") and data.endswith(b"T") and b"cut here" in data


def test_dry_run_runs_every_step_within_its_files(tmp_path):
    """The whole suite on the CPU at toy sizes through carry.py with a folder of carried wheels: the missing one is
    installed into the site and importable in later steps, the one installed already is left out; every step runs
    (conformance verbose, per test); the efficiency step goes through --processes shared; at most 8 files come
    out."""
    wheels, out = tmp_path / "wheels", tmp_path / "out"
    wheels.mkdir()
    fake_wheel(wheels, "gpu-suite-probe")
    fake_wheel(wheels, "pytest", "0.1")
    done = subprocess.run([sys.executable, str(CARRY), "run", "--wheels", str(wheels), "--out", str(out), "--site",
                           str(tmp_path / "site"), "--", "--dry-run",
                           "--timeout", "env=90"],  # env imports every plugin: over 25 s on a loaded 2-core CPU
                          cwd=ROOT, capture_output=True, text=True)
    suite_summary = (out / "summary.md").read_text() if (out / "summary.md").exists() else done.stderr
    summary = json.loads(suite_summary.split("```json\n", 1)[1].split("\n```", 1)[0])
    rcs = {r["step"]: r["rc"] for r in summary}
    assert list(rcs) == ["env", "conformance", "kernels", "efficiency", "throughput"], suite_summary
    assert all(rcs[s] == 0 for s in ("env", "kernels", "efficiency", "throughput")), suite_summary
    assert rcs["conformance"] in (0, 1), suite_summary  # 1: a test failed (others' work), not the plumbing
    assert len(list(out.iterdir())) <= 8 and all(f.is_file() for f in out.iterdir())
    installed = (out / "install.txt").read_text()
    assert "installed from the carried wheels" in installed and "gpu_suite_probe-1.0" in installed
    assert "left out: pytest-0.1-py3-none-any.whl" in installed
    assert "mixer attention -> " in (out / "env.txt").read_text()
    probe = subprocess.run([sys.executable, "-c", "import gpu_suite_probe_probe"], capture_output=True,
                           env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert probe.returncode == 0
    conformance = (out / "conformance.txt").read_text()
    assert "tests/test_attention_baselines.py::test_conformance[attention-kw0" in conformance
    assert " PASSED" in conformance
    table = (out / "efficiency.md").read_text()
    assert "| 1k | kvm-256 |" in table and "cpu, bf16" in table and "--processes shared" in table
    figures = json.loads((out / "efficiency.json").read_text())
    assert set(figures["train"]) <= {"attention", "kvm-256"} and "attention" in figures["train"]
    assert "ratio mixerzoo / llama" in (out / "throughput.txt").read_text()
