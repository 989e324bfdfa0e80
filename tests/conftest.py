import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def benchmark_script():
    """``load(name)``: the module of ``benchmarks/<name>.py`` (a script, not a package; ``papers/<script>`` for a
    paper's reproduction), imported from its file and registered in ``sys.modules`` under its file's stem
    (dataclasses look their module up there), with its folder and ``benchmarks/`` on ``sys.path`` as when the
    script runs (it imports its neighbours, such as ``_device``)."""
    def load(name: str):
        path = REPO / "benchmarks" / f"{name}.py"
        for folder in (str(REPO / "benchmarks"), str(path.parent)):
            if folder not in sys.path:
                sys.path.append(folder)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
        return module
    return load
