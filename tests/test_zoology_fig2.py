"""``benchmarks/papers/zoology_fig2.py``: the learning-rate sweep (Zoology's protocol) and the report over every scored run."""

from __future__ import annotations

import json


def test_best_run_per_mixer_and_width_is_the_highest_mean_accuracy(benchmark_script):
    runs = {"a": {"mixer": "gdn", "d_model": 64, "cells": {"64/4": 0.2, "64/8": 0.0}},
            "b": {"mixer": "gdn", "d_model": 64, "cells": {"64/4": 0.1, "64/8": 0.3}},
            "c": {"mixer": "gdn", "d_model": 128, "cells": {"64/4": 0.0}},
            "d": {"mixer": "kvm", "d_model": 64, "cells": {"64/4": 0.9}}}
    assert sorted(benchmark_script("papers/zoology_fig2").best_runs(runs)) == ["b", "c", "d"]


def test_a_learning_rate_sweep_trains_one_run_per_rate_and_reports_every_scored_run(tmp_path, benchmark_script):
    fig2 = benchmark_script("papers/zoology_fig2")
    out = tmp_path / "fig2"
    earlier = out / "runs" / "kvm-d16"  # scored by an earlier command into the same folder
    earlier.mkdir(parents=True)
    (earlier / "score.json").write_text(json.dumps({
        "mixer": "kvm", "d_model": 16, "options": {}, "train_s": 6.0, "cells": {"64/4": 0.5},
        "state_bytes": {"64": 2048}, "parameters": 1000}))
    assert fig2.main(["--mixers", "attention", "--d-models", "16", "--steps", "2", "--lrs", "1e-3", "3e-3",
                      "--eval-seq-lens", "64", "--eval-kv-pairs", "4", "--samples", "8", "--out", str(out)]) == 0
    # the recipe's own rate (3e-3) keeps the plain run name, so runs of earlier commands are reused
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["attention-d16", "attention-d16-lr0.001", "kvm-d16"]
    results = json.loads((out / "results.json").read_text())
    assert {name: r["lr"] for name, r in results["runs"].items()} == {
        "attention-d16": 3e-3, "attention-d16-lr0.001": 1e-3, "kvm-d16": 3e-3}
    table = (out / "results.md").read_text()
    assert table.count("(not best)") == 1 and "| kvm | 16 | 0.003 |" in table
