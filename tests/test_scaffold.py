"""`mixerzoo new-plugin`: name validation, no overwriting, the generated files, the generated mechanism checked
against an independent formula, and (end to end) pip install -e + the plugin's own tests + `mixerzoo fit`."""

import csv
import importlib
import math
import os
import subprocess
import sys
import tomllib
import uuid
from pathlib import Path

import pytest
import torch
import yaml

from mixerzoo.cli import main
from mixerzoo.scaffold import TEMPLATES, ScaffoldError, generate_plugin, plugin_names, render_plugin
from mixerzoo.testing import ConformanceError, run_conformance

REPO = Path(__file__).resolve().parents[1]


def unique_name(prefix="zz"):
    return f"{prefix}{uuid.uuid4().hex[:8]}"


# -- names ------------------------------------------------------------------------------------------------------
def test_names_derived_from_name():
    n = plugin_names("lin-attn")
    assert (n.name, n.dist, n.pkg, n.Class, n.State) == (
        "lin_attn", "mixerzoo-lin-attn", "mixerzoo_lin_attn", "LinAttnMixer", "LinAttnState")
    assert plugin_names("mixerzoo-foo2") == plugin_names("foo2")


@pytest.mark.parametrize("bad, fragment", [
    ("", "is empty"),
    ("2fast", "must be a valid Python identifier"),
    ("my.attn", "must be a valid Python identifier"),
    ("my attn", "must be a valid Python identifier"),
    ("attné", "must be a valid Python identifier"),
    ("MyAttn", "lowercase"),
    ("_private", "start with a letter"),
    ("class", "Python keyword"),
    ("attention", "already installed (from mixerzoo"),
])
def test_bad_names_are_refused_with_the_reason(bad, fragment):
    with pytest.raises(ScaffoldError) as e:
        plugin_names(bad)
    assert fragment in str(e.value)


def test_never_overwrites(tmp_path):
    target = tmp_path / "mixerzoo-foo"
    target.mkdir()
    (target / "mine.txt").write_text("keep me")
    with pytest.raises(ScaffoldError, match="already exists; new-plugin never overwrites"):
        generate_plugin("foo", tmp_path)
    assert sorted(p.name for p in target.iterdir()) == ["mine.txt"]


# -- the command ----------------------------------------------------------------------------------------------
def test_cli_creates_the_plugin_and_refuses_bad_input(tmp_path, capsys):
    main(["--help"])
    assert "new-plugin NAME [--dir PATH]" in capsys.readouterr().out
    assert main(["new-plugin", "my-attn", "--dir", str(tmp_path / "plugins")]) == 0
    out = capsys.readouterr().out
    target = tmp_path / "plugins" / "mixerzoo-my-attn"
    assert f"created {target}/" in out and "pip install --no-deps -e" in out
    assert {str(p.relative_to(target)) for p in target.rglob("*") if p.is_file()} == {
        "pyproject.toml", "README.md", "tests/test_my_attn_plugin.py", "recipes/my_attn-mqar-cpu.yaml",
        *(f"src/mixerzoo_my_attn/{f}.py" for f in ("__init__", "naive", "chunk", "recurrent", "ops", "layer", "state"))}
    assert main(["new-plugin", "my-attn", "--dir", str(tmp_path / "plugins")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["new-plugin", "my.attn", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mixerzoo new-plugin: error:") and "valid Python identifier" in err


# -- the generated files ----------------------------------------------------------------------------------------
def test_generated_files_are_consistent():
    names = plugin_names("lin-attn")
    files = render_plugin(names)
    assert len(files) == len(TEMPLATES)
    for path, text in files.items():
        assert "${" not in text, path
        if path.endswith(".py"):
            compile(text, path, "exec")
    project = tomllib.loads(files["pyproject.toml"])
    assert project["project"]["name"] == "mixerzoo-lin-attn"
    assert project["project"]["entry-points"]["mixerzoo.mixers"] == {"lin_attn": "mixerzoo_lin_attn:LinAttnMixer"}
    assert any(d.startswith("mixerzoo") for d in project["project"]["dependencies"])
    recipe = yaml.safe_load(files["recipes/lin_attn-mqar-cpu.yaml"])
    assert "lin_attn" in recipe["model"]["layer_types"] and "lin_attn" in recipe["model"]["mixers"]
    assert recipe["data"]["class_path"] == "mixerzoo.data.RecallDataModule"
    # pytest collects plugins/ from mixerzoo's root: a generated test module name must be unique
    assert "tests/test_lin_attn_plugin.py" in files


def test_tutorial_shows_the_entry_point_lines_of_pyproject():
    """A hand-written package needs the entry point; the tutorial shows the lines the scaffold writes (they were
    only in docs/architecture.md), with the install step that makes them take effect."""
    pyproject = render_plugin(plugin_names("lin-attn"))["pyproject.toml"].splitlines()
    start = pyproject.index('[project.entry-points."mixerzoo.mixers"]')
    block = "\n".join(pyproject[start:start + 2])
    assert block == '[project.entry-points."mixerzoo.mixers"]\nlin_attn = "mixerzoo_lin_attn:LinAttnMixer"'
    tutorial = (REPO / "docs" / "plugin-tutorial.md").read_text()
    assert f"```toml\n{block}\n```" in tutorial.split("## 2. The protocol")[0], "not in section 1 (Generate)"


@pytest.fixture
def generated_package(tmp_path):
    """Generate a plugin and import its package from src/ (no install), cleaning sys.path/modules after."""
    names = plugin_names(unique_name())
    target = generate_plugin(names.name, tmp_path)
    sys.path.insert(0, str(target / "src"))
    try:
        yield names, importlib.import_module(names.pkg)
    finally:
        sys.path.remove(str(target / "src"))
        for mod in [m for m in sys.modules if m == names.pkg or m.startswith(names.pkg + ".")]:
            del sys.modules[mod]


def test_generated_mixer_matches_an_independent_formula(generated_package):
    """The generated mixer, recomputed here from its weights with softmax replaced by the elu+1 kernel."""
    names, pkg = generated_package
    torch.manual_seed(0)
    d_model, heads, T = 16, 2, 13
    mixer = getattr(pkg, names.Class)(d_model, n_heads=heads, chunk_len=4)
    x = torch.randn(2, T, d_model)
    with torch.no_grad():
        y, state = mixer(x)

        def split(a):  # (B, T, H*D) -> (B, H, T, D)
            return a.view(2, T, heads, -1).transpose(1, 2)

        phi = lambda a: torch.where(a > 0, a + 1, torch.exp(a))  # elu(a) + 1 written out
        q, k = phi(split(x @ mixer.qkv.q_proj.weight.T)), phi(split(x @ mixer.qkv.k_proj.weight.T))
        v = split(x @ mixer.qkv.v_proj.weight.T)
        weights = torch.tril(q @ k.transpose(-1, -2))
        o = (weights @ v) / (weights.sum(-1, keepdim=True) + mixer.eps)
        expected = o.transpose(1, 2).reshape(2, T, -1) @ mixer.o_proj.weight.T
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.kv, k.transpose(-1, -2) @ v, atol=1e-4, rtol=1e-5)
    assert state.next_pos == T and state.nbytes() == 4 * 2 * heads * 8 * (8 + 1)
    report = run_conformance(lambda: getattr(pkg, names.Class)(d_model, n_heads=heads, chunk_len=8),
                             d_model, seq_len=24, splits=(3, 8, 13))
    assert report.state_bytes[0] == report.state_bytes[1]  # constant-size state


def test_conformance_catches_a_state_bug_in_the_generated_mixer(generated_package):
    """Sanity of the kit on the template: a state that forgets the normaliser must fail continuation."""
    names, pkg = generated_package
    cls = getattr(pkg, names.Class)

    class ForgetsNormaliser(cls):
        def forward(self, x, state=None):
            y, s = super().forward(x, state)
            s.k_sum = torch.zeros_like(s.k_sum)
            return y, s

    with pytest.raises(ConformanceError, match="continuation differs at split 5") as e:
        run_conformance(lambda: ForgetsNormaliser(16, n_heads=2, chunk_len=4), 16, seq_len=16, splits=(5,))
    assert e.value.check == "continuation"


def _fake_install(target: Path, names, site: Path) -> dict:
    """What ``pip install -e`` gives the generated package, without pip: a dist-info folder with its entry point
    on ``PYTHONPATH`` beside its ``src/`` (importlib.metadata finds both), so ``registry.get(name)`` resolves."""
    info = site / f"{names.pkg}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {names.dist}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[mixerzoo.mixers]\n{names.name} = {names.pkg}:{names.Class}\n")
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(site), str(target / "src"), str(REPO)])}


def test_generated_package_follows_the_plugin_layout_and_its_tests_check_the_registered_mixer(tmp_path):
    """The scaffold writes the layout every bundled plugin follows (naive, chunk, recurrent, layer, state; no
    use_reference), its tests pass, and they test the mixer the package registers: a forward rewritten in
    layer.py fails them while naive.py still describes the template's linear attention."""
    from test_architecture import layout_problems

    names = plugin_names(unique_name())
    clean = generate_plugin(names.name, tmp_path / "clean")
    assert layout_problems(clean / "src" / names.pkg) == []
    rewritten = generate_plugin(names.name, tmp_path / "rewritten")
    layer = rewritten / "src" / names.pkg / "layer.py"
    layer.write_text(layer.read_text().replace(
        "        return y, " + names.State, "        y = 2 * y  # a changed mechanism\n        return y, " + names.State))
    runs = {}
    for label, target in (("clean", clean), ("rewritten", rewritten)):
        env = _fake_install(target, names, tmp_path / f"site-{label}")
        runs[label] = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                                       cwd=target, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = {label: p.communicate(timeout=600)[0] for label, p in runs.items()}
    assert runs["clean"].returncode == 0 and " passed" in out["clean"] and "failed" not in out["clean"], out["clean"]
    assert runs["rewritten"].returncode == 1, out["rewritten"]
    failed = {line.split("::")[1].split("[")[0] for line in out["rewritten"].splitlines() if line.startswith("FAILED")}
    assert failed == {"test_registered_mixer_equals_naive"}, out["rewritten"]


# -- end to end: install, its tests, training --------------------------------------------------------------------
def _run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)


@pytest.mark.slow  # 48-104 s wall on the shared 2-core machine (~20 s CPU: pip, then torch + Lightning start-ups)
def test_generated_plugin_installs_passes_its_tests_and_trains(tmp_path):
    names = plugin_names(unique_name())
    target = generate_plugin(names.name, tmp_path)
    # Subprocesses import this checkout's mixerzoo (the one under test), whichever is installed.
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    try:
        r = _run(pip + ["install", "--no-deps", "--no-build-isolation", "-e", str(target)])
        assert r.returncode == 0, r.stdout + r.stderr
        # The plugin's own tests and a 2-step training run are independent: run them side by side.
        tests = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                                 cwd=target, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        fit = _run([sys.executable, "-m", "mixerzoo.cli", "fit",
                    "--config", str(target / "recipes" / f"{names.name}-mqar-cpu.yaml"),
                    "--model.d_model", "32", "--model.warmup_steps", "1",
                    "--data.init_args.train_examples", "64", "--data.init_args.val_examples", "16",
                    "--data.init_args.batch_size", "16", "--trainer.max_steps", "2",
                    "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
                    "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false"],
                   cwd=run_dir, env=env)
        test_out, _ = tests.communicate(timeout=600)
        assert tests.returncode == 0 and " passed" in test_out, test_out
        assert fit.returncode == 0, fit.stdout[-3000:] + fit.stderr[-3000:]
        config = next(run_dir.glob("runs/mixerzoo/version_*/config.yaml")).read_text()
        assert names.name in yaml.safe_load(config)["model"]["layer_types"]
        rows = list(csv.DictReader(next(run_dir.glob("runs/mixerzoo/version_*/metrics.csv")).open()))
        train = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
        val = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
        assert len(train) == 2 and val and all(math.isfinite(v) for v in train + val)
        assert list(run_dir.glob("runs/mixerzoo/version_*/checkpoints/last.ckpt"))
    finally:
        r = _run(pip + ["uninstall", "-y", names.dist])
        assert r.returncode == 0, r.stdout + r.stderr


def test_tutorial_answers_what_plugin_authors_had_to_read_source_for():
    """The tutorial states what the code does for: QKVProjection.stream's return values, which parameters weight
    decay takes, the bf16 checks casting buffers, `mixerzoo plugins NAME`, layer.py importing naive.py only for the forced naive form
    (as tests/test_architecture.py enforces), and trust_remote_code for AutoTokenizer."""
    import torch

    from mixerzoo.mixers.qkv import QKVProjection
    from mixerzoo.training.optim import param_groups

    text = " ".join((REPO / "docs" / "plugin-tutorial.md").read_text().split())
    qkv = QKVProjection(16, 2)
    out = qkv.stream(torch.randn(1, 3, 16), None)
    assert len(out) == 5 and out[3].tolist() == [0, 1, 2]  # positions fourth
    assert "returns `q, k, v`, the absolute `positions (T,)` fourth and the new carry fifth" in text
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decayed, not_decayed = param_groups(model, 0.1)
    assert all(p.ndim >= 2 for p in decayed["params"]) and all(p.ndim < 2 for p in not_decayed["params"])
    assert "parameters with `ndim < 2` (biases, norm weights" in text and "never decay" in text
    assert "every floating parameter **and buffer** is cast to bf16" in text
    assert "`mixerzoo plugins lin_attn` shows one mixer" in text
    import test_architecture

    assert "layer" not in test_architecture.FORBIDDEN  # layer.py may offer naive as a forced form
    assert "| `layer.py` |" in text and "`naive` only as the forced `backend: naive` form" in text
    assert "`trust_remote_code=True` to both `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer" in text
