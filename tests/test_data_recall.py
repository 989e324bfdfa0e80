"""MQAR (Zoology) generator and RecallDataModule: layout checked against an independent parse of each row."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from mixerzoo.data import LMDataModule, RecallDataModule, make_mqar
from mixerzoo.model.config import ConfigError


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _check_rows(x: torch.Tensor, y: torch.Tensor, vocab: int, k: int, q: int) -> None:
    """Parse every row from scratch and check the documented layout."""
    n, t = x.shape
    half = vocab // 2
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        keys, values = row_x[0 : 2 * k : 2], row_x[1 : 2 * k : 2]
        assert len(set(keys)) == k, "keys must be distinct within an example"
        assert len(set(values)) == k
        assert all(1 <= key < half for key in keys), "keys come from [1, V//2)"
        assert all(half <= v < vocab for v in values), "values come from [V//2, V)"
        table = dict(zip(keys, values))
        assert all(label == -100 for label in row_y[: 2 * k]), "no loss inside the kv section"
        answered = [p for p in range(t) if row_y[p] != -100]
        assert len(answered) == q
        queried = [row_x[p] for p in answered]
        assert len(set(queried)) == q, "queried keys are distinct"
        for p in answered:
            assert row_x[p] in table, "a query position holds a key of the kv section"
            assert row_y[p] == table[row_x[p]], "label = the value paired with that key"
            assert row_x[p + 1] == row_y[p], "the value follows its queried key"
        used = set(answered) | {p + 1 for p in answered}
        assert all(row_x[p] == 0 for p in range(2 * k, t) if p not in used), "filler 0 elsewhere"


@pytest.mark.parametrize("vocab,t,k,q", [(64, 64, 8, None), (256, 128, 16, 5), (8192, 256, 32, None), (8, 12, 3, 3)])
def test_mqar_labels_are_the_values_of_the_queried_keys(vocab, t, k, q):
    x, y = make_mqar(300, vocab, t, k, q, _gen(1))
    assert x.shape == y.shape == (300, t) and x.dtype == y.dtype == torch.long
    _check_rows(x, y, vocab, k, k if q is None else q)


def test_key_and_value_ranges_are_disjoint_and_covered():
    vocab = 8192  # large enough for the Floyd sampler
    x, y = make_mqar(400, vocab, 128, 32, None, _gen(2))
    keys, values = x[:, 0:64:2], x[:, 1:64:2]
    assert keys.min() >= 1 and keys.max() < vocab // 2
    assert values.min() >= vocab // 2 and values.max() < vocab
    assert set(keys.flatten().tolist()).isdisjoint(values.flatten().tolist())
    # the whole key half is used, not a corner of it (12800 draws from 4095 ids)
    assert keys.min() < 20 and keys.max() > vocab // 2 - 20
    assert set(y[y != -100].tolist()) <= set(values.flatten().tolist())


def test_query_placements_are_uniform():
    # T=12, K=2, Q=2: the query region has R=8 positions; two non-overlapping (key, value) pairs can sit
    # at C(R - Q, Q) = C(6, 2) = 15 placements, each with probability 1/15.
    n = 15000
    x, y = make_mqar(n, 16, 12, 2, 2, _gen(3))
    placements = Counter(tuple((row != -100).nonzero().flatten().tolist()) for row in y)
    expected = {(a, b) for a, b in itertools.combinations(range(4, 11), 2) if b >= a + 2}
    assert len(expected) == 15
    assert set(placements) == expected
    assert all(abs(c - n / 15) < 5 * (n / 15) ** 0.5 for c in placements.values()), placements


def test_mqar_is_deterministic_per_seed():
    a = make_mqar(50, 64, 64, 8, None, _gen(7))
    b = make_mqar(50, 64, 64, 8, None, _gen(7))
    c = make_mqar(50, 64, 64, 8, None, _gen(8))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_recall_datamodule_batches_and_attributes():
    dm = RecallDataModule(vocab_size=64, seq_len=32, num_kv_pairs=4, train_examples=200, val_examples=40,
                          batch_size=16, seed=3)
    assert isinstance(dm, LMDataModule)
    assert dm.vocab_size == 64 and dm.seq_len == 32 and dm.eos_id is None and dm.tokenizer is None
    assert dm.batch_size == 16
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == batch["labels"].shape == (16, 32)
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
    train, val = dm.dataset("train"), dm.dataset("val")
    assert len(train) == 200 and len(val) == 40
    _check_rows(train.input_ids, train.labels, 64, 4, 4)
    _check_rows(val.input_ids, val.labels, 64, 4, 4)
    # train and val come from different seeds
    rows = {tuple(r) for r in train.input_ids.tolist()}
    assert not any(tuple(r) in rows for r in val.input_ids.tolist())
    # the val loader keeps order; the train loader shuffles reproducibly
    first_val = next(iter(dm.val_dataloader()))["input_ids"]
    assert torch.equal(first_val, val.input_ids[:16])
    order1 = torch.cat([b["input_ids"] for b in dm.train_dataloader()])
    order2 = torch.cat([b["input_ids"] for b in dm.train_dataloader()])
    assert torch.equal(order1, order2) and not torch.equal(order1, train.input_ids)
    # an epoch visits every example at most once; the incomplete last batch is dropped
    idx = list(dm.train_dataloader().sampler)
    assert len(idx) == 192 and len(set(idx)) == 192 and all(0 <= i < 200 for i in idx)
    assert torch.equal(order1, train.input_ids[idx])
    # predict/test reuse val
    assert torch.equal(next(iter(dm.test_dataloader()))["labels"], val.labels[:16])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"seq_len": 64, "num_kv_pairs": 17}, r"data\.num_kv_pairs=17 .*at most 16"),
        ({"seq_len": 64, "num_kv_pairs": 29, "num_queries": 4}, r"data\.num_kv_pairs=29 .*at most 28"),
        ({"vocab_size": 16, "seq_len": 128, "num_kv_pairs": 8}, r"data\.num_kv_pairs=8 .*at most 7.*ids 1\.\.7"),
        ({"num_kv_pairs": 4, "num_queries": 5}, r"data\.num_queries=5 exceeds"),
        ({"seq_len": 1}, r"data\.seq_len"),
        ({"vocab_size": 3}, r"data\.vocab_size"),
        ({"num_kv_pairs": 0}, r"data\.num_kv_pairs"),
        ({"train_examples": 0}, r"data\.train_examples"),
        ({"batch_size": 0}, r"data\.batch_size"),
    ],
)
def test_recall_bad_config_raises_clear_error(kwargs, match):
    with pytest.raises(ConfigError, match=match) as info:
        RecallDataModule(**kwargs)
    assert isinstance(info.value, ValueError)


def test_recall_datamodule_from_yaml_config():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LMDataModule, "data")
    cfg = parser.parse_object({"data": {"class_path": "mixerzoo.data.RecallDataModule",
                                        "init_args": {"vocab_size": 128, "seq_len": 64, "num_kv_pairs": 8,
                                                      "train_examples": 10, "val_examples": 5}}})
    dm = parser.instantiate(cfg).data
    assert isinstance(dm, RecallDataModule) and dm.num_kv_pairs == 8 and dm.num_queries is None


# --------------------------------------------------------------------------------------------------------------
# Zoology's MQAR (format: zoology)
# --------------------------------------------------------------------------------------------------------------
from mixerzoo.data.recall import make_mqar_zoology, power_law_gap_probs  # noqa: E402


def test_zoology_layout_matches_the_paper():
    V, T, K = 64, 96, 8
    x, y = make_mqar_zoology(500, V, T, K, random_non_queries=False, generator=torch.Generator().manual_seed(0))
    keys, values = x[:, 0:2 * K:2], x[:, 1:2 * K:2]
    assert bool((keys >= 1).all() and (keys < V // 2).all() and (values >= V // 2).all() and (values < V).all())
    assert all(len(set(r.tolist())) == K for r in keys), "no key repeated in an example"
    assert all(len(set(r.tolist())) == K for r in values)
    for row in range(x.shape[0]):
        labelled = (y[row] != -100).nonzero().flatten()
        assert len(labelled) == K and bool((labelled >= 2 * K).all()) and bool((labelled % 2 == 0).all())
        kv = dict(zip(keys[row].tolist(), values[row].tolist()))
        queried = x[row, labelled].tolist()
        assert sorted(queried) == sorted(kv), "every key is queried exactly once"
        assert y[row, labelled].tolist() == [kv[k] for k in queried], "the label of a query key is its value"
        assert x[row, labelled + 1].tolist() == [0] * K, "the value is not echoed after its key"
        others = torch.ones(T, dtype=torch.bool)
        others[: 2 * K] = False
        others[labelled] = False
        assert bool((x[row, others] == 0).all())


def test_zoology_gaps_follow_the_power_law():
    """One query per example: its slot is drawn from p_i ∝ a i^(a-1); the empirical frequencies of the first
    slots match within 4 standard errors, and with many queries short gaps still dominate."""
    n, V, T = 20000, 16, 2 + 2 * 64  # one kv pair, 64 slots
    x, y = make_mqar_zoology(n, V, T, 1, power_a=0.01, random_non_queries=False,
                             generator=torch.Generator().manual_seed(1))
    slot = ((y != -100).nonzero()[:, 1] - 2) // 2
    freq = torch.bincount(slot, minlength=64).double() / n
    a = 0.01  # the paper's law, written here rather than taken from the generator: p_i ∝ a * i^(a - 1)
    p = torch.tensor([a * i ** (a - 1) for i in range(1, 65)], dtype=torch.float64)
    p = p / p.sum()
    assert torch.allclose(power_law_gap_probs(64, a), p)
    for i in range(8):
        se = (p[i] * (1 - p[i]) / n).sqrt()
        assert abs(freq[i] - p[i]) < 4 * se + 1e-3, (i, float(freq[i]), float(p[i]))
    assert p[0] > 5 * p[-1]  # the power law really favours short gaps
    x, y = make_mqar_zoology(2000, 64, 8 * 2 + 2 * 64, 8, generator=torch.Generator().manual_seed(2))
    slots = ((y != -100).nonzero()[:, 1] - 16) // 2
    counts = torch.bincount(slots, minlength=64)
    assert counts[:8].sum() > counts[-8:].sum() * 3


def test_zoology_random_non_queries_and_jrt_passes():
    V, T, K = 64, 96, 6
    x, y = make_mqar_zoology(300, V, T, K, num_passes=2, generator=torch.Generator().manual_seed(3))
    assert torch.equal(x[:, : 2 * K], x[:, 2 * K: 4 * K]), "num_passes repeats the kv section"
    query = y != -100
    noise = x[:, 4 * K:][~query[:, 4 * K:]]
    assert noise.float().mean().item() == pytest.approx((V - 1) / 2, rel=0.1), "filler is uniform random tokens"
    assert (noise == 0).float().mean().item() < 0.05


def test_zoology_bad_sizes_name_the_field():
    with pytest.raises(ConfigError, match="num_kv_pairs=40 is too many for vocab_size=64"):
        make_mqar_zoology(1, 64, 512, 40)
    with pytest.raises(ConfigError, match="num_kv_pairs=16 is too many for seq_len=60"):
        make_mqar_zoology(1, 256, 60, 16)  # 32 kv tokens leave 14 two-token query slots for 16 queries
    make_mqar_zoology(1, 256, 64, 16)  # 16 slots: fits exactly
    with pytest.raises(ConfigError, match=r"data\.num_queries must be null with format: zoology"):
        RecallDataModule(format="zoology", num_queries=4)
    with pytest.raises(ConfigError, match=r"data\.format='zoo'"):
        RecallDataModule(format="zoo")
    with pytest.raises(ConfigError, match=r"data\.num_kv_pairs=16 is too many for seq_len=40"):
        RecallDataModule(format="zoology", seq_len=40, num_kv_pairs=16)


def test_zoology_datamodule_batches():
    dm = RecallDataModule(format="zoology", vocab_size=64, seq_len=64, num_kv_pairs=8, train_examples=32,
                          val_examples=16, batch_size=8)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (8, 64) and int((batch["labels"] != -100).sum()) == 8 * 8


def test_kv_pairs_mixture_splits_evenly_and_shuffles():
    """A list of kv-pair counts (Zoology trains one model on several): each example holds one count's pairs,
    the counts share the examples evenly, and they are interleaved, not in blocks."""
    dm = RecallDataModule(format="zoology", vocab_size=128, seq_len=64, num_kv_pairs=[4, 8, 16], train_examples=300,
                          val_examples=30, batch_size=10)
    dm.setup()
    labels = dm._datasets["train"].labels
    per_row = (labels != -100).sum(1)  # every key is queried once: labels per row = that row's kv pairs
    assert sorted(per_row.unique().tolist()) == [4, 8, 16]
    assert [(per_row == k).sum().item() for k in (4, 8, 16)] == [100, 100, 100]
    assert len(set(per_row[:20].tolist())) > 1, "the mixture is shuffled, not one count after the other"
    val = (dm._datasets["val"].labels != -100).sum(1)
    assert [(val == k).sum().item() for k in (4, 8, 16)] == [10, 10, 10]
    mixed = RecallDataModule(vocab_size=128, seq_len=64, num_kv_pairs=[2, 4], num_queries=2, train_examples=7,
                             val_examples=2)
    mixed.setup()
    assert ((mixed._datasets["train"].labels != -100).sum(1) == 2).all() and len(mixed._datasets["train"]) == 7


@pytest.mark.parametrize("kv, match", [
    ([], r"data\.num_kv_pairs is an empty list"),
    ([4, 4], r"data\.num_kv_pairs=\[4, 4\] repeats a count"),
    ([4, 0], r"data\.num_kv_pairs must be an integer >= 1"),
    ([4, 20], r"data\.num_kv_pairs=20 is too many for seq_len=64"),
])
def test_kv_pairs_mixture_bad_input_names_the_field(kv, match):
    with pytest.raises(ConfigError, match=match):
        RecallDataModule(format="zoology", vocab_size=128, seq_len=64, num_kv_pairs=kv)


def _query_order(x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    """``(n, Q)``: for each query, in the order the query section asks them, the index of its key in the kv
    section (0 = the first pair written)."""
    n = x.shape[0]
    keys = x[:, 0: 2 * k: 2]
    pos = (y != -100).nonzero()[:, 1].view(n, -1)  # row-major: each row's query positions in increasing order
    asked = x.gather(1, pos)
    return (asked[:, :, None] == keys[:, None, :]).long().argmax(-1)


def test_mqar_queries_come_in_uniformly_random_order():
    """Every order of the queried pairs is equally likely, independent of the order they were written in: with
    K = Q = 4 each of the 24 orders within 5 standard deviations of n/24 (queries always in key-value order put
    every row in one of them); with K = 5, Q = 2 each of the 20 ordered pairs of distinct pairs the same."""
    n = 12000
    x, y = make_mqar(n, 64, 32, 4, 4, _gen(11))
    counts = Counter(tuple(r) for r in _query_order(x, y, 4).tolist())
    assert set(counts) == set(itertools.permutations(range(4)))
    expected, sd = n / 24, (n / 24 * (1 - 1 / 24)) ** 0.5
    assert all(abs(c - expected) < 5 * sd for c in counts.values()), counts
    x, y = make_mqar(n, 64, 32, 5, 2, _gen(12))
    counts = Counter(tuple(r) for r in _query_order(x, y, 5).tolist())
    assert set(counts) == set(itertools.permutations(range(5), 2))
    expected, sd = n / 20, (n / 20 * (1 - 1 / 20)) ** 0.5
    assert all(abs(c - expected) < 5 * sd for c in counts.values()), counts


def test_zoology_query_order_follows_sequential_draws():
    """Zoology draws the query slots one key after another, in kv order, without replacement from the power law
    (``np.random.choice(..., replace=False, p=p)``), and writes each key at its slot: the first key written is
    asked first with probability P = sum_i p_i * sum_{j > i} p_j / (1 - p_i), computed here from the law (0.54
    for 16 slots, a = 0.01). Sorting the slots would make it 1, reversing them 0."""
    n, k, slots, a = 40000, 2, 16, 0.01
    x, y = make_mqar_zoology(n, 16, 2 * k + 2 * slots, k, power_a=a, random_non_queries=False,
                             generator=_gen(4))
    first_asked_first = (_query_order(x, y, k)[:, 0] == 0).double().mean().item()
    p = [a * i ** (a - 1) for i in range(1, slots + 1)]
    p = [v / sum(p) for v in p]
    expected = sum(p[i] * sum(p[i + 1:]) / (1 - p[i]) for i in range(slots))
    assert 0.5 < expected < 0.6
    assert abs(first_asked_first - expected) < 5 * (expected * (1 - expected) / n) ** 0.5, (first_asked_first,
                                                                                           expected)
