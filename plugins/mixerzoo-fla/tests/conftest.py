"""On a CUDA machine, this plugin's tests compile each of fla's Triton kernels with one configuration.

fla 0.6.0 autotunes its kernels on first use: Triton's ``Autotuner`` compiles and benchmarks every configuration
of a kernel's list, serially, once per new key (shapes, flags and dtypes), and fla ships no tuned configurations
(``FLA_CACHE_MODE`` is off by default and ``fla/configs`` holds none). Measured on a cold H100 (Triton 3.6.0): GDN's
inference forward alone tuned 7 kernels with 75 configurations in 80 s (l2norm 25, causal_conv1d 16, the state
recurrence 12, ...); a training step adds the backward's kernels, and GSA's lists are longer (``chunk_fwd_h`` and
``chunk_bwd_dh`` 48 each). The tests check what the kernels compute, not how fast, and every configuration of fla's
lists computes the same thing, so they keep the one with the smallest tiles, fewest stages and warps (the least
shared memory, the likeliest to compile on any GPU): one compilation per kernel and specialisation, no benchmark.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch


def _footprint(config) -> tuple:
    """Order of a ``triton.Config`` by resources: product of its integer meta-parameters (tile sizes), stages, warps."""
    tiles = math.prod(v for v in config.kwargs.values() if isinstance(v, int) and not isinstance(v, bool))
    return tiles, config.num_stages or 0, config.num_warps or 0


@pytest.fixture(autouse=True)
def one_config_per_fla_kernel(monkeypatch):
    """Make Triton's autotuner keep one configuration of each list (after a kernel's own pruning); CUDA only."""
    if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        return
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs

    def smallest(self, *args, **kwargs):
        return [min(prune(self, *args, **kwargs), key=_footprint)]

    monkeypatch.setattr(Autotuner, "prune_configs", smallest)
