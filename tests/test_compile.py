"""``torch.compile`` on every registered mixer's training step and on the language model's.

Each case compiles one layer's forward with ``backend="eager"`` (Dynamo's graph capture without a code generator:
fast on the CPU, and what decides graph breaks). A case with no graph break compiles with ``fullgraph=True``,
which raises on any break, so it proves there is none; a case with known breaks compiles without it and the
number of breaks Dynamo counts must not grow. Outputs and gradients (input and every parameter, after a backward
through the compiled forward) equal eager's.

Breaks that stay, and why (``docs/training.md``, "torch.compile"):

- gsa (CPU form): none; eager reads the largest log-decay inside a chunk on the host to choose the chunk length
  and the factored or exact form, a compiled graph takes the exact form (``mixerzoo_fla/gsa/chunk.py``).
- A plugin whose breaks stay is listed with the ``file:line`` of its break in ``KNOWN_BREAKS``; its fullgraph
  case is a strict xfail, so a fix shows up as an unexpected pass.
- The Triton paths (``backend: triton``, what a GPU runs; here through Triton's interpreter): each kernel is one
  ``torch.library`` custom operator, opaque to Dynamo, so they compile with ``fullgraph=True``.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from mixerzoo import registry

D = 64  # d_model: 2 heads x 32

# (id, registry name, options, T, mode, known graph breaks of the forward (0: compiled with fullgraph=True))
CASES = [
    ("attention", "attention", {"n_heads": 2}, 48, "train", 0),
    ("swa", "swa", {"n_heads": 2, "window": 16}, 48, "train", 0),
    ("bswa", "bswa", {"n_heads": 2, "chunk_len": 16}, 48, "train", 0),
    # the chunk form (appendix A, KVM's parallel form on a CPU): states no larger than the window, and one larger
    # (48 rows, window 32)
    ("kvm-fixed", "kvm", {"n_heads": 2, "chunk_len": 16, "schedule": {"name": "fixed", "size": 8}}, 64, "train", 0),
    ("kvm-power_law", "kvm", {"n_heads": 2, "chunk_len": 16,
                              "schedule": {"name": "power_law", "coef": 2.0, "exponent": 0.5}}, 64, "train", 0),
    ("kvm-large_state", "kvm", {"n_heads": 2, "chunk_len": 16, "schedule": {"name": "fixed", "size": 48}}, 96,
     "train", 0),
    ("ovq", "ovq", {"n_heads": 2, "chunk_len": 16, "max_size": 32}, 64, "train", 0),
    ("vq", "vq", {"n_heads": 2, "chunk_len": 16, "codebook_size": 16}, 64, "train", 0),
    ("trellis", "trellis", {"n_heads": 2, "num_slots": 8, "chunk_len": 8}, 32, "train", 0),
    ("gdn", "gdn", {"n_heads": 2, "chunk_len": 16}, 48, "train", 0),
    ("gsa", "gsa", {"n_heads": 2, "num_slots": 8, "chunk_len": 16}, 48, "train", 0),
    ("tova-train", "tova", {"n_heads": 2, "multi_state": 16}, 48, "train", 0),
    # eval mode with more tokens than multi_state: the prefill evicts (decode-exact eviction, one decision a token)
    ("tova-eval", "tova", {"n_heads": 2, "multi_state": 16, "chunk_len": 16}, 40, "eval", 0),
]

# Other plugins' breaks (file:line in their source), kept here until they are fixed there. None today.
KNOWN_BREAKS: dict[str, str] = {}

# compiled and eager take different forms of the same equations (gsa: exact vs factored intra-chunk decay), equal up
# to float32 rounding: compared in float64, where rounding is far below the tolerance
FLOAT64 = {"gsa"}


def build(name: str, options: dict, mode: str) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = registry.get(name)(d_model=D, **options)
    return layer.train(mode == "train")


def run(layer: torch.nn.Module, forward, x: torch.Tensor, mode: str) -> tuple[torch.Tensor, list]:
    """The output and, in training, the gradients of the input and every parameter after one backward."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(mode == "train")
    if mode != "train":
        with torch.no_grad():
            return forward(x).detach(), []
    y = forward(x)
    w = torch.linspace(-1, 1, y.numel()).view_as(y)  # a loss whose gradient differs across every output
    (y * w).sum().backward()
    return y.detach(), [x.grad] + [p.grad for p in layer.parameters()]


def breaks() -> int:
    return sum(counters["graph_break"].values())


def compare(layer, x, mode, fullgraph: bool) -> int:
    """Eager against compiled (``backend="eager"``): equal outputs and gradients; returns the graph breaks."""
    y0, g0 = run(layer, lambda t: layer(t)[0], x, mode)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda t: layer(t)[0], backend="eager", fullgraph=fullgraph)
    y1, g1 = run(layer, compiled, x, mode)
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    assert len(g1) == len(g0)
    for a, b in zip(g1, g0):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    found = breaks()
    torch._dynamo.reset()
    return found


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_compiled_step_equals_eager(case):
    _, name, options, T, mode, known = case
    layer = build(name, options, mode)
    x = torch.randn(1, T, D, generator=torch.Generator().manual_seed(1))
    if case[0] in FLOAT64:
        layer, x = layer.double(), x.double()
    found = compare(layer, x, mode, fullgraph=known == 0)
    assert found <= known, (f"{case[0]}: {found} graph breaks, {known} known: "
                            f"{dict(counters['graph_break']) or 'see TORCH_LOGS=graph_breaks'}")


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=pytest.mark.xfail(strict=True, raises=torch._dynamo.exc.TorchDynamoException,
                                            reason=KNOWN_BREAKS[c[1]]))
    for c in CASES if c[1] in KNOWN_BREAKS and c[5]], ids=lambda c: c[0])
def test_fullgraph_other_plugins(case):
    _, name, options, T, mode, _ = case
    layer = build(name, options, mode)
    compare(layer, torch.randn(1, T, D, generator=torch.Generator().manual_seed(1)), mode, fullgraph=True)


def test_every_registered_mixer_has_a_case():
    assert set(registry.names("mixer")) <= {c[1] for c in CASES}


def test_language_model_compiled_by_the_training_module(monkeypatch):
    """``LMModule(compile=True)`` compiles each block (``nn.Module.compile``); each block compiles whole
    (``fullgraph``), and one training step's loss and gradients equal the eager model's. Blocks of the same kind
    share one compiled graph: two kinds, two graphs, and a second step compiles nothing."""
    from mixerzoo.training.module import LMModule

    compile_block = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, **kw: compile_block(self, backend="eager", fullgraph=True))
    tiny = dict(vocab_size=64, d_model=32, n_layers=3, n_heads=2, layer_types=["attention", "swa"],
                mixers={"attention": {}, "swa": {"window": 8}})
    torch.manual_seed(0)
    eager = LMModule(**tiny)
    torch._dynamo.reset()
    counters.clear()
    compiled = LMModule(compile=True, **tiny)
    compiled.model.load_state_dict(eager.model.state_dict())
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in compiled.model.blocks)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    for step in range(2):
        losses, grads = [], []
        for module in (eager, compiled):
            module.zero_grad(set_to_none=True)
            loss = module._loss(batch)[0]
            loss.backward()
            losses.append(loss.detach())
            grads.append([p.grad for p in module.model.parameters()])
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        for a, b in zip(grads[1], grads[0]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # attention blocks, swa block
    assert breaks() == 0
    torch._dynamo.reset()
