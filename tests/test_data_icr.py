"""In-context recall tasks: the layout is checked against an independent parse of the token stream."""

import pytest
import torch

from mixerzoo.data import LMDataModule
from mixerzoo.data.icr import (ARROW, PAD, QUERY, SEP, ICRDataModule, basic_icr, icr_batch, ICRSpec,
                               positional_icr, value_token_accuracy)


def parse(ids, key_len, value_len):
    """Split a sample by its special tokens: ([(key, value), ...] context, [(key, value), ...] queries, pad)."""
    ids = ids.tolist()
    pad = 0
    while ids[pad] == PAD:
        pad += 1
    assert ids.count(QUERY) == 1, "exactly one query marker"
    q = ids.index(QUERY)

    def pairs(tokens):
        out = []
        assert tokens[-1] == SEP, "every pair ends with the separator"
        for chunk in _split(tokens[:-1], SEP):
            assert chunk.count(ARROW) == 1
            a = chunk.index(ARROW)
            key, value = tuple(chunk[:a]), tuple(chunk[a + 1:])
            assert len(key) == key_len and len(value) == value_len
            assert all(t > QUERY for t in key + value), "content tokens are not special ids"
            out.append((key, value))
        return out

    return pairs(ids[pad:q]), pairs(ids[q + 1:]), pad


def _split(tokens, sep):
    part = []
    for t in tokens:
        if t == sep:
            yield part
            part = []
        else:
            part.append(t)
    yield part


def expected_labels(ids, key_len, value_len):
    """Targets written from the parse: after each query arrow, the next value_len tokens, shifted by one."""
    ids = ids.tolist()
    labels = [-100] * len(ids)
    q = ids.index(QUERY)
    for t in range(q + 1, len(ids)):
        if ids[t] == ARROW:
            for j in range(value_len):
                labels[t + j] = ids[t + 1 + j]
    return torch.tensor(labels)


@pytest.mark.parametrize("seq_len", [217, 300, 1024])
def test_basic_icr_layout(seq_len):
    g = torch.Generator().manual_seed(seq_len)
    ids, labels = basic_icr(seq_len, generator=g)
    assert ids.shape == labels.shape == (seq_len,) and ids.dtype == labels.dtype == torch.long
    assert int(ids.max()) < 10_000
    context, queries, pad = parse(ids, 8, 8)
    assert pad < 18 and len(context) == (seq_len - 1 - 6 * 18) // 18     # as many pairs as fit
    keys, values = [k for k, _ in context], [v for _, v in context]
    assert len(set(keys)) == len(keys) and len(set(values)) == len(values)
    assert len(queries) == 6 and len(set(queries)) == 6                 # six distinct pairs asked
    lookup = dict(context)
    assert all(lookup[k] == v for k, v in queries)                      # answers are the context values
    assert torch.equal(labels, expected_labels(ids, 8, 8))
    assert int((labels != -100).sum()) == 6 * 8


@pytest.mark.parametrize("seq_len,n_copies", [(1024, 4), (700, 2)])
def test_positional_icr_layout(seq_len, n_copies):
    g = torch.Generator().manual_seed(seq_len)
    ids, labels = positional_icr(seq_len, n_copies=n_copies, generator=g)
    assert ids.shape == (seq_len,)
    context, queries, pad = parse(ids, 8, 8)
    occurrences = {}
    for k, v in context:
        occurrences.setdefault(k, []).append(v)
    assert all(len(vs) == n_copies and len(set(vs)) == n_copies for vs in occurrences.values())
    assert len({v for _, v in context}) == len(context)                 # every context value distinct
    assert len(context) % n_copies == 0 and pad < 18 * n_copies + 18
    assert len({k for k, _ in queries}) == 1 and len(queries) == n_copies   # one key, n_copies times
    key = queries[0][0]
    assert [v for _, v in queries] == occurrences[key]                  # values in order of appearance
    assert torch.equal(labels, expected_labels(ids, 8, 8))


def test_small_options_and_too_short_context():
    ids, labels = basic_icr(120, vocab_size=12, key_len=2, value_len=3, n_queries=2,
                            generator=torch.Generator().manual_seed(0))
    context, queries, _ = parse(ids, 2, 3)
    assert len(queries) == 2 and all(dict(context)[k] == v for k, v in queries)
    with pytest.raises(ValueError, match="seq_len >= 217"):
        basic_icr(216)
    with pytest.raises(ValueError, match="distinct"):
        basic_icr(2000, vocab_size=6, key_len=1)
    with pytest.raises(ValueError, match="task"):
        ICRSpec("needle")


def test_samples_are_deterministic_and_distinct():
    spec = ICRSpec("basic")
    a = icr_batch(spec, 3, 400, seed=1)
    b = icr_batch(spec, 3, 400, seed=1)
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert not torch.equal(a["input_ids"][0], a["input_ids"][1])
    assert not torch.equal(a["input_ids"], icr_batch(spec, 3, 400, seed=2)["input_ids"])


def test_value_token_accuracy():
    labels = torch.tensor([[-100, 5, 6, -100]])
    logits = torch.zeros(1, 4, 10)
    logits[0, 1, 5] = logits[0, 2, 7] = 1.0                              # one of the two answers right
    assert value_token_accuracy(logits, labels).item() == 0.5


def test_datamodule_batches_and_lengths():
    dm = ICRDataModule(task="positional", seq_len=400, batch_size=4, n_train=8, n_val=4, seed=3)
    assert isinstance(dm, LMDataModule)
    assert (dm.vocab_size, dm.seq_len, dm.batch_size, dm.eos_id, dm.tokenizer) == (10_000, 400, 4, None, None)
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 400)
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
    val = next(iter(dm.val_dataloader()))["input_ids"]
    assert not torch.equal(val, batch["input_ids"])                     # validation is a different stream
    for row in val:
        parse(row, 8, 8)
    long = next(iter(dm.eval_dataloader(1600)))["input_ids"]
    assert long.shape == (4, 1600)
    parse(long[0], 8, 8)
    with pytest.raises(ValueError, match="data.n_train"):
        ICRDataModule(n_train=0)
