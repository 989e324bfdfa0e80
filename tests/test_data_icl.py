"""Long in-context learning task (OVQ paper sec. 4.1, appendix 8.5): generator layout, the functions it draws,
occurrence ranks, the data module and the sweep (checked with an independent solver)."""

import itertools

import pytest
import torch
from torch import nn

from mixerzoo.data import ICLDataModule, LMDataModule
from mixerzoo.data.icl import PAD, SEP, ICLSpec, accuracy_by_occurrence, icl_batch, icl_sample

SPEC = ICLSpec(vocab_size=300, io_len=4, n_functions=5, n_function_ids=16)


def examples(ids: torch.Tensor, spec: ICLSpec):
    """Split a sample into (x, function token, y) triples, checking separators and padding."""
    E, D = spec.example_len, spec.io_len
    pad = ids.numel() % E
    assert (ids[:pad] == PAD).all()
    rows = ids[pad:].view(-1, E)
    assert (rows[:, -1] == SEP).all()
    off = spec.value_offset
    return [(r[:D] - off, int(r[D]), r[D + 1:2 * D + 1] - off) for r in rows]


def test_every_function_is_b_plus_a_times_a_permutation():
    """All examples tagged with one id are explained by a single (a, b, P) with 0 < a, b < 6 (checked by brute
    force over a, b and the permutations), different ids by different functions."""
    g = torch.Generator().manual_seed(3)
    ids, labels, occ = icl_sample(SPEC, 400, g)
    by_fn: dict[int, list] = {}
    for x, f, y in examples(ids, SPEC):
        assert 2 <= f < 2 + SPEC.n_function_ids
        assert x.min() >= 0 and x.max() <= SPEC.x_max
        by_fn.setdefault(f, []).append((x, y))
    assert len(by_fn) == SPEC.n_functions
    for f, pairs in by_fn.items():
        fits = [(a, b, p) for a, b in itertools.product(range(1, 6), repeat=2)
                for p in itertools.permutations(range(SPEC.io_len))
                if all(torch.equal(y, b + a * x[list(p)]) for x, y in pairs)]
        assert fits, f"no (a, b, P) explains function {f}"


def test_labels_are_the_shifted_outputs_and_occurrences_count_per_function():
    ids, labels, occ = icl_sample(SPEC, 130, torch.Generator().manual_seed(1))
    D, E = SPEC.io_len, SPEC.example_len
    lab = (labels != -100).nonzero().flatten()
    assert torch.equal(labels[lab], ids[lab + 1])                          # labels[t] is the token after t
    assert lab.numel() == D * (130 // E)
    pad = 130 % E
    rows = ids[pad:].view(-1, E)
    assert torch.equal(ids[lab[::D]], rows[:, D])                           # the function id predicts y[0]
    seen: dict[int, int] = {}
    for i, f in enumerate(rows[:, D].tolist()):
        seen[f] = seen.get(f, 0) + 1
        assert (occ[pad + i * E + D:pad + i * E + 2 * D] == seen[f]).all()
    assert (occ[labels == -100] == 0).all()


def test_accuracy_by_occurrence_by_hand():
    hits = torch.tensor([[True, False, True, True, False]])
    occ = torch.tensor([[1, 1, 0, 2, 5]])
    correct, total = accuracy_by_occurrence(hits, occ, max_occurrence=3)
    assert correct.tolist() == [1, 1, 0] and total.tolist() == [2, 1, 1]   # rank 5 pooled into rank 3


def test_bad_options_name_the_field():
    with pytest.raises(ValueError, match="n_function_ids"):
        ICLSpec(n_functions=20, n_function_ids=16)
    with pytest.raises(ValueError, match="vocab_size"):
        ICLSpec(vocab_size=140)
    with pytest.raises(ValueError, match="io_len"):
        ICLSpec(io_len=0)
    with pytest.raises(ValueError, match="seq_len"):
        ICLDataModule(seq_len=20)
    with pytest.raises(ValueError, match="data.n_val"):
        ICLDataModule(n_val=0)


def test_datamodule_batches_are_deterministic_and_streams_differ():
    dm = ICLDataModule(seq_len=130, batch_size=3, vocab_size=300, io_len=4, n_functions=5, n_function_ids=16,
                       n_train=6, n_val=3, seed=2)
    assert isinstance(dm, LMDataModule) and dm.vocab_size == 300
    train = next(iter(dm.train_dataloader()))
    assert set(train) == {"input_ids", "labels"} and train["input_ids"].shape == (3, 130)
    again = icl_batch(dm.spec, 6, 130, seed=2, split=0)["input_ids"]          # the epoch's samples, shuffled
    assert all(any(torch.equal(row, other) for other in again) for row in train["input_ids"])
    val = next(iter(dm.val_dataloader()))["input_ids"]
    assert not torch.equal(val, train["input_ids"])
    assert next(iter(dm.eval_dataloader(520)))["input_ids"].shape == (3, 520)


class Solver(nn.Module):
    """An independent ICL learner: for each output token, the values predicted by every (a, b, input position)
    consistent with all earlier examples of the same function; it answers only when they agree (else PAD)."""

    def __init__(self, spec: ICLSpec) -> None:
        super().__init__()
        self.spec = spec
        self.config = type("Config", (), {"vocab_size": spec.vocab_size})()

    def forward(self, ids, states=None):
        B, T = ids.shape
        spec, D, off = self.spec, self.spec.io_len, self.spec.value_offset
        logits = torch.zeros(B, T, spec.vocab_size)
        logits[..., PAD] = 0.5
        for b in range(B):
            history: dict[int, list] = {}
            for x, f, y in examples(ids[b], spec):
                pad = T % spec.example_len
                start = pad + (len(sum(history.values(), [])) * spec.example_len)
                for j in range(D):
                    guesses = {bb + a * int(x[i]) for a, bb, i in itertools.product(range(1, 6), range(1, 6), range(D))
                               if history.get(f) and all(int(yy[j]) == bb + a * int(xx[i]) for xx, yy in history[f])}
                    if len(guesses) == 1:
                        logits[b, start + D + j, guesses.pop() + off] = 1.0
                history.setdefault(f, []).append((x, y))
        return logits, states


def test_sweep_by_occurrence_with_an_independent_solver():
    from mixerzoo.evaluation.models import EvalModel
    from mixerzoo.evaluation.recall import icl_sweep

    em = EvalModel("solver", Solver(SPEC), None)
    opts = {"vocab_size": 300, "io_len": 4, "n_function_ids": 16, "trained_functions": None}
    r = icl_sweep(em, 260, [1, 5], samples=4, batch_size=2, max_occurrence=4, chunk=1024, options=opts)
    one, five = r["functions"]["1"], r["functions"]["5"]
    assert one["by_occurrence"][0] == 0.0 and five["by_occurrence"][0] == 0.0   # a first example can't be inferred
    assert one["by_occurrence"][3] > 0.9 and five["by_occurrence"][3] > 0.8     # later ones can
    assert sum(one["outputs_by_occurrence"]) == 4 * (260 // SPEC.example_len) * SPEC.io_len
    assert one["accuracy"] > five["accuracy"]                                 # more functions, fewer repeats each
    too_many = icl_sweep(em, 260, [17], samples=2, options=opts)
    assert "n_function_ids" in too_many["functions"]["17"]["na"]
