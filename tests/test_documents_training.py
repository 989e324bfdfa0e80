"""Packed documents in training: the offsets of a batch, the data option, the LM module and a short fit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mixerzoo.cli import main
from mixerzoo.data.packing import PackedCollate, document_offsets
from mixerzoo.mixers.attention import Attention
from mixerzoo.model import LanguageModel
from mixerzoo.model.config import ConfigError
from mixerzoo.training import LMModule

EOT = 9


def test_document_offsets_start_at_windows_and_end_of_text_tokens():
    windows = torch.tensor([[1, 2, EOT, 3, 4], [EOT, 5, 6, EOT, 7], [8, 8, 8, 8, EOT]])
    cu = document_offsets(windows, EOT)
    assert cu.dtype == torch.int32 and cu.device.type == "cpu"
    assert cu.tolist() == [0, 2, 5, 8, 10, 14, 15]  # EOT starts the document it precedes
    assert document_offsets(windows, None).tolist() == [0, 5, 10, 15]
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        document_offsets(torch.tensor([1, 2]), EOT)


def _lm(channel="relu2"):
    torch.manual_seed(0)
    return LanguageModel(dict(vocab_size=16, d_model=32, n_layers=3, n_heads=2, layer_types=["a", "s", "b"],
                              mixers={"a": {"mixer": "attention", "token_shift": True, "value_residual": True},
                                      "s": {"mixer": "swa", "window": 4, "sink_len": 1},
                                      "b": {"mixer": "bswa", "chunk_len": 4}},
                              channel_mixer=channel, channel_token_shift=channel == "relu2")).double()


@pytest.mark.parametrize("channel", ["relu2", "rwkv7", "swiglu"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_lm_logits_equal_each_document_alone(channel, checkpointing):
    """Every layer gets cu_seqlens (value residual, grouped paths, activation checkpointing) and the channel token
    shift restarts at each document (RWKV-7's from zero), so the packed logits are each document's own."""
    model = _lm(channel)
    model.activation_checkpointing = checkpointing
    model.train(checkpointing)
    ids = torch.randint(0, 16, (1, 30))
    cu = torch.tensor([0, 1, 9, 20, 30])
    logits, _ = model(ids, cu_seqlens=cu)
    ref = torch.cat([model(ids[:, a:b])[0] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1)
    torch.testing.assert_close(logits, ref, rtol=1e-10, atol=1e-10)


def test_lm_refuses_a_mixer_without_cu_seqlens(monkeypatch):
    model = _lm()
    monkeypatch.setattr(Attention, "forward", lambda self, x, state=None, shared=None: (x, None))
    with pytest.raises(ConfigError, match=r"layer 0 \(a: mixer 'attention'.*does not take cu_seqlens"):
        model(torch.zeros(1, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 4]))


def test_module_loss_with_cu_seqlens_is_the_loss_of_each_document_alone():
    """B windows train as one packed sequence: the loss is the mean over every position of each document's own
    next-token loss (the EOT predicted at the end of its document, the first token from the EOT alone)."""
    module = LMModule(vocab_size=16, d_model=32, n_layers=2, n_heads=2, layer_types=["attention", "swa"],
                      mixers={"attention": {}, "swa": {"window": 4}})
    torch.manual_seed(1)
    seq = torch.randint(0, EOT, (2, 13))
    seq[0, 5] = seq[1, 9] = EOT
    batch = PackedCollate(EOT)([{"input_ids": s[:-1], "labels": s[1:]} for s in seq])
    assert batch["cu_seqlens"].tolist() == [0, 5, 12, 21, 24]
    loss, _, _ = module._loss(batch)
    flat = batch["input_ids"].reshape(1, -1)
    cu = batch["cu_seqlens"].tolist()
    logits = torch.cat([module.model(flat[:, a:b])[0] for a, b in zip(cu, cu[1:])], dim=1)
    want = F.cross_entropy(logits[0], batch["labels"].reshape(-1))
    torch.testing.assert_close(loss, want)



def test_the_data_module_moves_tokens_and_keeps_cu_seqlens_on_the_host():
    from mixerzoo.data.base import LMDataModule

    batch = PackedCollate(EOT)([{"input_ids": torch.tensor([1, EOT, 2]), "labels": torch.tensor([EOT, 2, 3])}])
    moved = LMDataModule(seq_len=3, batch_size=1).transfer_batch_to_device(batch, torch.device("meta"), 0)
    assert moved["input_ids"].device.type == "meta" and moved["cu_seqlens"].device.type == "cpu"


RECIPE = """
model: {{d_model: 32, n_layers: 2, n_heads: 2, layer_types: [swa, attention], warmup_steps: 1,
        mixers: {{swa: {{window: 8}}, attention: {{token_shift: true}}}}}}
data:
  class_path: mixerzoo.data.TextDataModule
  init_args: {{paths: {data}/tinyshakespeare/input.txt, sample_by: paragraph, bpe_vocab_size: 300,
              seq_len: 32, batch_size: 8, max_tokens: 4000, document_mask: {mask}}}
trainer: {{max_steps: 3, enable_progress_bar: false, limit_val_batches: 2, val_check_interval: 3, log_every_n_steps: 1}}
"""


def test_fit_on_text_with_document_mask(in_tmp, shared_data):
    """The text recipes' path with data.document_mask: true trains and validates (every batch packed)."""
    (in_tmp / "t.yaml").write_text(RECIPE.format(data=shared_data, mask="true"))
    assert main(["fit", "--config", "t.yaml"]) == 0
    metrics = next(in_tmp.glob("runs/mixerzoo/version_*/metrics.csv")).read_text()
    assert "val/loss" in metrics and "train/loss" in metrics


def test_document_mask_refuses_a_mixer_without_cu_seqlens_at_setup(in_tmp, shared_data, monkeypatch, capsys):
    monkeypatch.setattr(Attention, "forward", lambda self, x, state=None, shared=None: (x, None))
    (in_tmp / "t.yaml").write_text(RECIPE.format(data=shared_data, mask="true"))
    with pytest.raises(SystemExit) as e:
        main(["fit", "--config", "t.yaml"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any("data.document_mask: layer 0 (swa: mixer 'swa'" in line and "cu_seqlens" in line for line in err)
