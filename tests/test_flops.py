"""Analytic training FLOPs (mixerzoo.flops) and the MFU the throughput logger derives from them."""

from __future__ import annotations

import torch

from mixerzoo import registry
from mixerzoo.flops import attention_flops, flop_parameters, training_flops_per_token
from mixerzoo.model import LanguageModel, LMConfig
from mixerzoo.training.callbacks import ThroughputLogger, peak_flops


def _lm(layer_types, mixers, tie=False):
    return LanguageModel(LMConfig(vocab_size=100, d_model=32, n_layers=len(layer_types), n_heads=2,
                                  layer_types=layer_types, mixers=mixers, tie_embeddings=tie))


def test_attention_lm_is_palms_count():
    """6 N + 12 n_layers d_model T, N without the embedding table (with a tied head: the table counted once)."""
    for tie in (False, True):
        lm = _lm(["attention", "attention"], {"attention": {}}, tie)
        n = sum(p.numel() for p in lm.parameters()) - (0 if tie else lm.embed.weight.numel())
        assert flop_parameters(lm) == n
        assert training_flops_per_token(lm, 64) == 6 * n + 12 * 2 * 32 * 64


def test_windowed_mixers_count_the_keys_they_read():
    swa = registry.get("swa")(32, n_heads=2, window=8, sink_len=2)
    bswa = registry.get("bswa")(32, n_heads=2, chunk_len=4, n_bswa_chunks=2)
    assert swa.flops(1000) == attention_flops(2, 16, 10) == 12 * 32 * 10
    assert swa.flops(5) == 12 * 32 * 5 and bswa.flops(1000) == 12 * 32 * 8


def test_every_bundled_mixer_has_a_count_that_grows_as_it_should():
    """Bounded-state mixers' counts stop growing with T; attention's grows linearly."""
    for name in registry.names("mixer"):
        mixer = registry.get(name)(64, n_heads=2)
        assert callable(getattr(mixer, "flops", None)), f"{name} has no flops(seq_len)"
        small, large = mixer.flops(1024), mixer.flops(65536)
        assert 0 < small <= large, name
        if name not in ("attention", "tova"):  # TOVA trains as full attention (its policy acts at inference)
            assert large < 64 * small, name  # sub-linear in T: a window or a bounded state


def test_unknown_mixer_gives_no_count():
    lm = _lm(["attention"], {"attention": {}})
    lm.blocks[0].mixer.flops = None
    assert training_flops_per_token(lm, 16) is None


def test_throughput_logger_logs_tflops_and_mfu():
    lm = _lm(["attention"], {"attention": {}})
    logged = {}

    class Module:
        model = lm
        device = torch.device("cpu")

        def log(self, name, value, **kwargs):
            logged[name] = value

    class Trainer:
        world_size = 1

    cb = ThroughputLogger(window=2)
    cb._peak = 1e12  # a device with a known peak (on a GPU: Lightning's table)
    batch = {"input_ids": torch.zeros(2, 16, dtype=torch.long)}
    for i in range(2):
        cb.on_train_batch_start(Trainer, Module(), batch, i)
        cb.on_train_batch_end(Trainer, Module(), None, batch, i)
    flops = training_flops_per_token(lm, 16) * 64
    assert logged["train/tokens_per_s"] > 0
    seconds = 64 / logged["train/tokens_per_s"]
    assert abs(logged["train/tflops_per_s"] - flops / seconds / 1e12) < 1e-9 * logged["train/tflops_per_s"] + 1e-12
    assert abs(logged["train/mfu"] - flops / seconds / 1e12) < 1e-6
    assert peak_flops(torch.device("cpu"), "bf16-mixed") is None
