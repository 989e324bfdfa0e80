"""The causal-LM LightningModule. Its init arguments are the backbone's fields (``LMConfig``) plus the
optimizer's, so recipes and the command line set them directly (``--model.layer_types '[attention,swa]'``).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import typing
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from ..model import LanguageModel, LMConfig
from ..model.lm import check_mixer_outputs, layers_without_cu_seqlens
from ..errors import UserError
from ..model.config import ConfigError, check_mixer_options
from .checkpoints import collect_rng_states, set_rng_states
from .distill import (check_distill_options, converted_layers, distillation_loss, freeze_loaded, freeze_unconverted,
                      load_teacher)
from .optim import build_optimizer, lr_lambda

__all__ = ["LMModule", "NonFiniteLossError"]

IGNORE_INDEX = -100
EXAMPLE_SEQ_LEN = 64  # tokens of the model summary's example input when the datamodule gives no seq_len


def explicit_fields(given: Any) -> dict[str, Any]:
    """The LMModule arguments in ``given`` (a mapping) that differ from their defaults: what the user set. Used
    where values from elsewhere (a checkpoint's hyper-parameters, an ``init_from`` source) fill the rest."""
    defaults = {k: p.default for k, p in inspect.signature(LMModule.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    return {k: v for k, v in given.items() if k in defaults and v != defaults[k]}


def merged_fields(config: LMConfig, given: Any) -> dict[str, Any]:
    """The backbone fields of a saved model (``config``: an ``init_from`` source's, a ``--ckpt_path`` checkpoint's)
    with what the user gave (``given``: LMModule arguments): a field that differs from LMModule's default replaces
    the saved one, and ``mixers`` given are merged into the saved ones key by key
    (:func:`mixerzoo.hub.source.with_mixers`, the merge ``evaluate --mixers`` and ``generate`` use), so
    ``{attention: {mixer: tova, multi_state: 256}}`` swaps a layer's mixer and keeps its other options. Ordered as
    LMConfig's fields.

    Raises:
        ConfigError: options for a layer name the model does not have, or an inherited option the new mixer does
            not take (see :func:`~mixerzoo.hub.source.with_mixers`).
    """
    from ..hub.source import with_mixers

    fields = config.to_dict()
    explicit = explicit_fields(given)
    for key, value in explicit.items():
        if key not in ("mixers", "layer_types") and key in fields and value is not None:
            fields[key] = value
    layer_types = list(explicit["layer_types"]) if explicit.get("layer_types") else None
    if given.get("mixers") or layer_types:
        converted = with_mixers(config, given.get("mixers"), layer_types)
        fields["mixers"], fields["layer_types"] = converted.mixers, converted.layer_types
    return {k: fields[k] for k in LMConfig.__dataclass_fields__}


def _fields_from(source: str, given: dict[str, Any]) -> dict[str, Any]:
    """Backbone fields for ``init_from``: the source's, merged with ``given`` (:func:`merged_fields`)."""
    from ..hub.source import read_lm_config

    return merged_fields(read_lm_config(source), given)


def _load_init_weights(model: LanguageModel, source: str) -> tuple[dict, tuple]:
    """Load ``source``'s weights into ``model`` where they fit and print what was loaded, new and unused. Returns
    the report and the opened source ``(TrainedModel, kind)`` (for a teacher or a freeze that reuse it)."""
    from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

    from ..hub.checkpoint import load_matching_weights
    from ..hub.source import open_source

    opened = open_source(source)
    trained = opened[0]
    report = load_matching_weights(model, trained.state_dict)
    n_new = sum(dict(model.named_parameters()).get(k, torch.empty(0)).numel() for k in report["new"])
    rank_zero_info(f"model.init_from {source}: loaded {len(report['loaded'])} tensors; {len(report['new'])} new "
                   f"(initialised, {n_new:,} parameters){': ' + ', '.join(report['new'][:8]) if report['new'] else ''}"
                   f"{' ...' if len(report['new']) > 8 else ''}")
    if report["unused"]:
        rank_zero_warn(f"model.init_from {source}: {len(report['unused'])} weights of the source have no place in this "
                       f"model and were not loaded: {', '.join(report['unused'][:8])}"
                       f"{' ...' if len(report['unused']) > 8 else ''}")
    return report, opened


class NonFiniteLossError(UserError, RuntimeError):
    """Raised after ``max_bad_steps`` consecutive steps with a non-finite loss, when a run ends in such steps, or
    when the validation loss is not finite (before a checkpoint named after it is written); the advice names the
    checkpoint to resume from only when one was written."""


def _resume_advice(trainer) -> str:
    """The fix for a run stopped by non-finite losses: resume from the newest checkpoint this run wrote (skipped
    steps leave the weights as they were), or start again when it wrote none."""
    written = []
    for cb in getattr(trainer, "checkpoint_callbacks", None) or []:
        for path in (getattr(cb, "last_model_path", ""), getattr(cb, "best_model_path", "")):
            if path and os.path.isfile(path):
                written.append(path)
    fix = "lower model.lr, raise model.warmup_steps or use fp32/bf16 instead of fp16"
    if not written:
        return f"no checkpoint was written; {fix} and start again"
    newest = max(written, key=os.path.getmtime)
    return f"{newest} holds the weights before these steps; {fix}, then resume with --ckpt_path {newest}"


class LMModule(L.LightningModule):
    """Causal language modelling over a hybrid stack of mixers.

    Its first arguments are exactly :class:`mixerzoo.model.LMConfig`'s fields, with LMConfig's types, defaults and
    descriptions: ``__init__`` is generated from the dataclass (see :func:`_generate_init`), so a backbone field
    is declared once. Two defaults differ, as a recipe needs: ``vocab_size`` None takes the datamodule tokenizer's
    size at setup (saved in the checkpoint) and ``mixers`` None gives every layer name its mixer's defaults.

    Args:
{backbone_args}
        lr: Peak learning rate of AdamW.
        weight_decay: AdamW weight decay (not applied to norms, biases, embeddings and scalars).
        betas: AdamW betas.
        warmup_steps: Linear warmup steps from 0 to ``lr``.
        lr_schedule: After warmup: ``cosine``, ``linear`` (both down to ``min_lr_ratio * lr``) or ``constant``.
        min_lr_ratio: Final learning rate as a fraction of ``lr`` (0: decay to zero).
        compile: ``torch.compile`` each block (in place, parameter names unchanged).
        activation_checkpointing: Recompute each block's forward in backward (``torch.utils.checkpoint``,
            non-reentrant; :attr:`mixerzoo.model.LanguageModel.activation_checkpointing`): a step keeps each block's
            input instead of its saved tensors, for about one more forward pass of time. The same losses and
            gradients.
        max_bad_steps: A step with a non-finite loss is skipped and counted; this many in a row stop the run.
        init_from: Start from the weights of another model (any source :func:`mixerzoo.hub.load_model` opens:
            a ``mixerzoo import`` folder, an export, a checkpoint, a ``.gguf``). Its backbone fields are used
            wherever this module's are left at their defaults; ``mixers`` given here are merged into its layers'
            options key by key, so ``{attention: {mixer: tova}}`` or ``{attention: {mixer: kvm}}`` changes the
            layers and keeps the rest. Every weight whose name and shape fit is loaded; the parameters it lacks
            (a new mixer's own) keep their initialisation, and both lists are printed at the start of training
            (``init_report``). Ignored when resuming (``--ckpt_path``): the checkpoint has the weights.
        freeze: ``none`` (train everything); ``unconverted``: with ``init_from``, train only the mixers of the
            layers whose mixer or options differ from the source's (the converted ones); embeddings, norms,
            channel mixers and unchanged layers keep the source's weights; ``new``: train only the parameters
            the source lacked (a converted KVM layer's ``LN_s``, temperatures and merge gate), every loaded weight
            stays the teacher's (the first stage of a conversion: fit the new pieces around a fixed model).
        distill_from: A frozen teacher (any source, usually the same as ``init_from``) for a distillation loss:
            ``(1 - distill_weight) * LM loss + distill_weight * T^2 KL(teacher || student)`` at temperature
            ``distill_temperature`` over the labelled positions (:mod:`mixerzoo.training.distill`). The teacher
            runs under ``no_grad`` on each batch; its logits are never stored. Needs the student's tokenizer.
        distill_weight: Weight ``w`` of the distillation term in ``[0, 1]`` (null: 0.5 with a teacher; setting it
            without ``distill_from`` is an error).
        distill_temperature: Softmax temperature ``T`` of both distributions in the distillation term.
        loss_chunk_tokens: Tokens per chunk of the LM loss, which is computed from the final hidden states a chunk
            at a time, its gradient included, so the ``(B, T, vocab)`` logits are never held
            (:func:`mixerzoo.model.loss.linear_cross_entropy`); null: as many as 8 MiB of float32 logits take on a
            CPU, 256 MiB on a GPU.

    Logged: ``train/loss``, ``train/acc``, ``val/loss``, ``val/ppl`` (exp of the token-weighted mean loss),
    ``val/acc`` (next-token accuracy over labelled positions); with a teacher also ``train/lm_loss`` and
    ``train/distill_loss`` (``train/loss`` is then their weighted sum; ``val/*`` stay the plain LM loss).

    Raises:
        ConfigError: before training, for a bad backbone field, a layer name without options, an option a
            mixer does not take, a tokenizer larger than ``vocab_size``, or a ``seq_len`` too short.
    """

    def _configure(self) -> None:
        """The body of the generated ``__init__``, run after the hyper-parameters are saved: resolve
        ``init_from``, default the mixers, check every field, and build the model when the vocabulary is known."""
        hp = self.hparams
        if hp.get("init_from") is not None:
            resolved = _fields_from(hp.init_from, {k: hp[k] for k in LMConfig.__dataclass_fields__})
            hp.update(resolved)  # LightningCLI hands save_hyperparameters the given values: record the resolved
            if getattr(self, "_hparams_initial", None) is not None:
                self._hparams_initial.update(resolved)
        hp["layer_types"] = list(hp.layer_types)
        if hp.mixers is None:
            hp["mixers"] = {name: {} for name in hp.layer_types}
        if hp.lr <= 0:
            raise ConfigError(f"model.lr must be > 0, got {hp.lr}")
        if isinstance(hp.max_bad_steps, bool) or not isinstance(hp.max_bad_steps, int) or hp.max_bad_steps < 1:
            raise ConfigError(f"model.max_bad_steps must be an integer >= 1 (consecutive non-finite steps that stop "
                              f"the run), got {hp.max_bad_steps!r}")
        chunk = hp.get("loss_chunk_tokens")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ConfigError(f"model.loss_chunk_tokens must be an integer >= 1 (tokens per chunk of the loss) or "
                              f"null (chosen from the vocabulary and the device), got {chunk!r}")
        lr_lambda(0, hp.warmup_steps, 1, hp.lr_schedule, hp.min_lr_ratio)  # validates lr_schedule
        self._distill_weight = check_distill_options(hp.get("distill_from"), hp.get("distill_weight"),
                                                     hp.get("distill_temperature", 1.0), hp.get("freeze", "none"),
                                                     hp.get("init_from"))
        self._teacher: list[LanguageModel] = []  # a list, so that the teacher is no submodule (not saved, not trained)
        self._validate_backbone()
        self.model: LanguageModel | None = None
        self._bad_steps = 0
        self._rng_to_restore: dict | None = None
        if hp.vocab_size is not None:
            self.configure_model()
        self.val_loss = MeanMetric()

    # -- model construction -----------------------------------------------------------------------------
    def lm_config(self, vocab_size: int | None = None) -> LMConfig:
        """The :class:`LMConfig` described by this module's hyper-parameters."""
        fields = {k: self.hparams[k] for k in LMConfig.__dataclass_fields__ if k != "vocab_size"}
        return LMConfig(vocab_size=vocab_size or self.hparams.vocab_size, **fields)

    def _validate_backbone(self) -> None:
        """Check names and options without allocating weights, so mistakes surface before data is prepared."""
        config = self.lm_config(vocab_size=self.hparams.vocab_size or 1)
        for spec in config.layer_specs():
            check_mixer_options(spec)

    def configure_model(self) -> None:
        """Build the LM once the vocabulary is known (from ``vocab_size`` or the datamodule's tokenizer), and under
        a model-parallel strategy (:class:`~mixerzoo.training.parallel.FSDP2Strategy`) shard it over the device
        mesh the strategy made (:func:`~mixerzoo.training.parallel.parallelize`).

        Raises:
            ConfigError: the datamodule's tokenizer has more tokens than ``model.vocab_size``.
        """
        dm = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        data_vocab, vocab = getattr(dm, "vocab_size", None), self.hparams.vocab_size
        # A model built in __init__ (vocab_size given) meets the datamodule here, before its first batch: a
        # token id past the embedding would be an IndexError deep inside the forward.
        if vocab is not None and data_vocab is not None and data_vocab > vocab:
            raise ConfigError(f"the tokenizer has {data_vocab} tokens but model.vocab_size={vocab}; raise "
                              f"model.vocab_size to at least {data_vocab} (or leave it unset to take the "
                              f"tokenizer's)")
        if self.model is None:
            self._build_model(dm, data_vocab)
        mesh = getattr(self, "_device_mesh", None)
        if mesh is not None and not getattr(self, "_sharded", False):
            from .parallel import parallelize

            options = getattr(self.trainer.strategy, "fsdp_options", dict)()
            parallelize(self.model, mesh, **options)
            self._sharded = True

    def _build_model(self, dm, data_vocab: int | None) -> None:
        """The LM of these hyper-parameters (``data_vocab``: the datamodule ``dm``'s vocabulary, used where
        ``vocab_size`` is unset), its ``init_from`` weights, freeze, teacher and checks."""
        vocab = self.hparams.vocab_size
        if vocab is None:
            if data_vocab is None:
                raise ConfigError("model.vocab_size is not set and the datamodule has no vocab_size; set "
                                  "--model.vocab_size or use a mixerzoo datamodule")
            vocab = data_vocab
        self.hparams.vocab_size = vocab
        # Lightning logs (and checks against the datamodule's) the *initial* hparams: record the resolved value.
        if getattr(self, "_hparams_initial", None) is not None:
            self._hparams_initial["vocab_size"] = vocab
        self.model = LanguageModel(self.lm_config(vocab))
        self.model.activation_checkpointing = bool(self.hparams.get("activation_checkpointing", False))
        self.init_report = None
        resuming = self._trainer is not None and getattr(self._trainer, "ckpt_path", None)
        opened = None  # the init_from source, opened once for the weights, the freeze and a same-source teacher
        if self.hparams.get("init_from") and not resuming:
            self.init_report, opened = _load_init_weights(self.model, self.hparams.init_from)
        freeze = self.hparams.get("freeze", "none")
        if freeze == "unconverted":
            self._freeze_unconverted(None if opened is None else opened[0].config)
        elif freeze == "new":
            opened = self._freeze_new(opened)
        if self._distill_weight > 0 and not self._teacher:
            same = opened if self.hparams.distill_from == self.hparams.get("init_from") else None
            self._teacher.append(load_teacher(self.hparams.distill_from, self.model.config.vocab_size, same))
        seq_len = getattr(dm, "seq_len", None)
        if seq_len is not None:
            self.model.check_seq_len(seq_len)
        missing = layers_without_cu_seqlens(self.model) if getattr(dm, "document_mask", False) else []
        if missing:
            raise ConfigError(f"data.document_mask: {missing[0]} does not take cu_seqlens, so packed documents would "
                              f"leak into each other; set data.document_mask: false or use a mixer that keeps "
                              f"documents apart (forward(x, state=None, cu_seqlens=None), mixerzoo.protocol)")
        if not self.hparams.compile:  # a compiled block would recompile when the hook removes itself
            check_mixer_outputs(self.model)
        if self.hparams.compile:
            for block in self.model.blocks:
                block.compile()
        self.acc = MulticlassAccuracy(num_classes=self.model.config.padded_vocab_size, average="micro",
                                      ignore_index=IGNORE_INDEX).to(self.device)
        # synced at every step, so that under ddp the logged train/acc is over the global batch, like train/loss
        self.train_acc = MulticlassAccuracy(num_classes=self.model.config.padded_vocab_size, average="micro",
                                            ignore_index=IGNORE_INDEX, dist_sync_on_step=True).to(self.device)

    def _freeze_unconverted(self, source_config: LMConfig | None) -> None:
        """``freeze: unconverted``: only the mixers of layers that differ from the init_from source train
        (``source_config``: its config when already open, else it is read)."""
        from lightning.pytorch.utilities import rank_zero_info

        from ..hub.source import read_lm_config

        converted = converted_layers(self.model.config, source_config or read_lm_config(self.hparams.init_from))
        counts = freeze_unconverted(self.model, converted)
        rank_zero_info(f"model.freeze=unconverted: training the mixers of layers {converted} "
                       f"({counts['trainable']:,} parameters); {counts['frozen']:,} frozen")

    def _freeze_new(self, opened: tuple | None) -> tuple:
        """``freeze: new``: only the parameters the init_from source lacks train. On resume nothing was loaded
        from the source, so it is opened and matched by name and shape (without loading) to find them; returns the
        opened source for a same-source teacher."""
        from lightning.pytorch.utilities import rank_zero_info

        from ..hub.checkpoint import match_weights
        from ..hub.source import open_source

        if self.init_report is not None:
            new = self.init_report["new"]
        else:
            opened = opened or open_source(self.hparams.init_from)
            new = match_weights(self.model, opened[0].state_dict)[1]["new"]
        counts = freeze_loaded(self.model, new)
        rank_zero_info(f"model.freeze=new: training the {counts['trainable']:,} parameters model.init_from lacks; "
                       f"{counts['frozen']:,} frozen")
        return opened

    @property
    def example_input_array(self) -> torch.Tensor | None:
        """One training sequence of token ids, ``(1, seq_len)`` (the datamodule's ``seq_len``, else
        ``EXAMPLE_SEQ_LEN``), once the model is built. Lightning's model summary runs it through the model (no
        grad) under torch's FLOP counter, so its FLOPs column and "Total FLOPs" give a forward pass over one
        sequence instead of 0. None before the model is built and with ``compile`` (the summary's no-grad
        pass would compile every block once more)."""
        if getattr(self, "model", None) is None or self.hparams.get("compile"):
            return None
        dm = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        seq_len = getattr(dm, "seq_len", None) or EXAMPLE_SEQ_LEN
        return torch.zeros(1, seq_len, dtype=torch.long, device=self.device)

    @example_input_array.setter
    def example_input_array(self, value) -> None:  # Lightning's __init__ assigns None; the property decides
        pass

    # -- steps --------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, states: list | None = None):
        return self.model(input_ids, states)

    @staticmethod
    def logits_of(model: LanguageModel, batch: dict) -> torch.Tensor:
        """``model``'s logits ``(B, T, V)`` for ``batch["input_ids"] (B, T)``; a batch with ``cu_seqlens``
        (``data.document_mask``) runs as one packed sequence ``(1, B * T)`` whose documents stay apart."""
        ids = batch["input_ids"]
        if batch.get("cu_seqlens") is None:
            return model(ids)[0]
        return model(ids.reshape(1, -1), cu_seqlens=batch["cu_seqlens"])[0].view(*ids.shape, -1)

    def _loss(self, batch: dict, logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The mean LM loss over the labelled tokens, the argmax predictions and the labels. Without ``logits`` (the
        distillation loss needs them whole) the loss is computed from the final hidden states in chunks of
        tokens (:func:`~mixerzoo.model.loss.linear_cross_entropy`): the ``(B, T, V)`` logits are never held. A batch
        with ``cu_seqlens`` (``data.document_mask``) runs as one packed sequence ``(1, B * T)``."""
        labels = batch["labels"]
        if logits is None:
            ids, cu = batch["input_ids"], batch.get("cu_seqlens")
            if cu is not None:
                ids, labels = ids.reshape(1, -1), labels.reshape(1, -1)
            loss, preds = self.model(ids, cu_seqlens=cu, labels=labels,
                                     loss_chunk_tokens=self.hparams.get("loss_chunk_tokens"))
            return loss, preds.view_as(batch["labels"]), batch["labels"]
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
        return loss, logits.detach().argmax(-1), labels

    def _distilled_loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(1 - w) * LM loss + w * distillation loss`` against the frozen teacher (logged separately)."""
        teacher = self._teacher[0]
        if next(teacher.parameters()).device != self.device:
            teacher.to(self.device)
        logits = self.logits_of(self.model, batch)
        with torch.no_grad():
            teacher_logits = self.logits_of(teacher, batch)
        lm, preds, labels = self._loss(batch, logits)
        kd = distillation_loss(logits, teacher_logits, labels, self.hparams.distill_temperature,
                               self.model.config.vocab_size)
        w = self._distill_weight
        self.log("train/lm_loss", lm, sync_dist=True)
        self.log("train/distill_loss", kd, sync_dist=True)
        return (1 - w) * lm + w * kd, preds, labels

    def training_step(self, batch: dict, batch_idx: int):
        loss, preds, labels = self._distilled_loss(batch) if self._teacher else self._loss(batch)
        if not torch.isfinite(loss):
            self._bad_steps += 1
            self.log("train/skipped_steps", float(self._bad_steps))
            if self._bad_steps >= self.hparams.max_bad_steps:
                raise NonFiniteLossError(
                    f"{self._bad_steps} consecutive steps had a non-finite loss (last {loss.item()}) up to step "
                    f"{self.global_step + 1}; stopping: {_resume_advice(self.trainer)}")
            return None  # Lightning skips the backward and optimizer step
        self._bad_steps = 0
        self.train_acc(preds.flatten(), labels.flatten())
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)  # the mean over processes under ddp
        self.log("train/acc", self.train_acc, prog_bar=False)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss, preds, labels = self._loss(batch)
        n = (labels != IGNORE_INDEX).sum()
        self.val_loss.update(loss, weight=n)
        self.acc.update(preds.flatten(), labels.flatten())

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        if not torch.isfinite(loss) and self._trainer is not None and self.trainer.state.fn == "fit":
            # raised before the checkpoint callback would save a "val_lossnan" checkpoint
            self.val_loss.reset()
            self.acc.reset()
            when = "before training (sanity check)" if self.trainer.sanity_checking else \
                f"at step {self.global_step}"
            raise NonFiniteLossError(f"the validation loss is {loss.item()} {when}: the model's output is not "
                                     f"finite; stopping: {_resume_advice(self.trainer)}")
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/ppl", torch.exp(loss.clamp(max=30)))
        self.log("val/acc", self.acc.compute(), prog_bar=True)
        self.val_loss.reset()
        self.acc.reset()

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def on_test_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.log("test/loss", loss)
        self.log("test/ppl", torch.exp(loss.clamp(max=30)))
        self.log("test/acc", self.acc.compute())
        self.val_loss.reset()
        self.acc.reset()

    def predict_step(self, batch: dict, batch_idx: int) -> dict:
        """Per-sequence mean loss and the greedy next-token predictions ``(B, T)``."""
        logits = self.logits_of(self.model, batch)
        per_tok = F.cross_entropy(logits.transpose(1, 2).float(), batch["labels"], ignore_index=IGNORE_INDEX,
                                  reduction="none")
        mask = batch["labels"] != IGNORE_INDEX
        return {"loss": (per_tok * mask).sum(1) / mask.sum(1).clamp(min=1), "predictions": logits.argmax(-1)}

    # -- optimisation -------------------------------------------------------------------------------------
    def configure_optimizers(self):
        hp = self.hparams
        opt = build_optimizer(self.model, hp.lr, hp.weight_decay, tuple(hp.betas))
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: lr_lambda(step, hp.warmup_steps, total, hp.lr_schedule, hp.min_lr_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # -- checkpoints ----------------------------------------------------------------------------------------
    def on_train_end(self) -> None:
        # Lightning's checkpoint callbacks have run (last.ckpt holds the weights before the skipped steps): a run
        # whose last steps were all skipped did not do what was asked, so it does not end as a success.
        if self._bad_steps:
            raise NonFiniteLossError(
                f"the run ended after {self._bad_steps} consecutive steps with a non-finite loss (skipped; "
                f"model.max_bad_steps={self.hparams.max_bad_steps} would have stopped it): "
                f"{_resume_advice(self.trainer)}")

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Add ``checkpoint["rng_states"]`` (:func:`~mixerzoo.training.checkpoints.collect_rng_states` of the
        process that writes it, rank 0) and the count of consecutive non-finite steps, so a resumed run draws
        the same random numbers and keeps counting bad steps as the interrupted one would have; and
        ``checkpoint["mixerzoo_plugins"]``, the distribution and version of every mixer, positional encoding and
        schedule the model uses (as an export records them), so that a loader lacking one names what to install."""
        from ..hub.plugins import plugin_metadata

        checkpoint["rng_states"] = collect_rng_states()
        checkpoint["mixerzoo_bad_steps"] = self._bad_steps
        config = self.model.config if self.model is not None else self.lm_config(self.hparams.vocab_size or 1)
        checkpoint["mixerzoo_plugins"] = plugin_metadata(config)

    def on_train_start(self) -> None:
        """Restore the random generators saved in the checkpoint being resumed, just before the first step
        (after Lightning's setup, which may draw random numbers of its own)."""
        if self._rng_to_restore is not None:
            set_rng_states(self._rng_to_restore)
            self._rng_to_restore = None

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Refuse a checkpoint whose weights do not fit this model, naming the mismatch, before loading; keep its
        random generator states for :meth:`on_train_start`."""
        self._rng_to_restore = checkpoint.get("rng_states")
        self._bad_steps = int(checkpoint.get("mixerzoo_bad_steps", 0))
        if self.model is None or "state_dict" not in checkpoint:  # a sharded (DCP) checkpoint loads into the shards
            return
        ours = self.state_dict()
        theirs = checkpoint.get("state_dict", {})
        missing = [k for k in ours if k not in theirs]
        unexpected = [k for k in theirs if k not in ours]
        shapes = [f"{k}: checkpoint {tuple(theirs[k].shape)} vs model {tuple(v.shape)}"
                  for k, v in ours.items() if k in theirs and hasattr(theirs[k], "shape") and theirs[k].shape != v.shape]
        if missing or unexpected or shapes:
            detail = "; ".join(([f"missing {missing[:3]}"] if missing else []) +
                               ([f"unexpected {unexpected[:3]}"] if unexpected else []) + shapes[:3])
            raise ConfigError(f"the checkpoint does not fit this model configuration ({detail}). Use the config "
                              f"it was trained with (config.yaml next to its logs) or drop --ckpt_path to start "
                              f"fresh.")


def _module_options(lr: float = 1e-3, weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95),
                    warmup_steps: int = 100, lr_schedule: str = "cosine", min_lr_ratio: float = 0.1,
                    compile: bool = False, activation_checkpointing: bool = False, max_bad_steps: int = 10,
                    init_from: str | None = None, freeze: str = "none", distill_from: str | None = None,
                    distill_weight: float | None = None, distill_temperature: float = 1.0,
                    loss_chunk_tokens: int | None = None) -> None:
    """LMModule's own arguments (after LMConfig's fields); only its signature is used."""


# Where a recipe needs another default than LMConfig: (type, default)
_RECIPE_DEFAULTS = {"vocab_size": (int | None, None), "mixers": (dict[str, dict[str, Any]] | None, None)}


def _generate_init(cls: type) -> type:
    """Give ``cls`` an ``__init__(self, <LMConfig fields>, <_module_options>)`` with real names, types and
    defaults, generated as ``dataclasses`` generates its own: LightningCLI/jsonargparse read the signature (so
    ``--model.d_model`` exists, typed and documented), Lightning's ``save_hyperparameters`` reads the arguments
    from the frame, and nothing about a backbone field is written twice. The body saves the hyper-parameters
    and calls ``_configure``."""
    hints = typing.get_type_hints(LMConfig)
    params, defaults, annotations = [], {}, {}
    for f in dataclasses.fields(LMConfig):
        if f.name in _RECIPE_DEFAULTS:
            kind, default = _RECIPE_DEFAULTS[f.name]
        else:
            kind, default = hints[f.name], f.default if f.default is not dataclasses.MISSING else f.default_factory()
        params.append(f.name)
        defaults[f.name], annotations[f.name] = default, kind
    own = inspect.signature(_module_options).parameters
    own_hints = typing.get_type_hints(_module_options)
    for name, p in own.items():
        params.append(name)
        defaults[name], annotations[name] = p.default, own_hints[name]
    source = (f"def __init__(self, {', '.join(f'{n}=_defaults[{n!r}]' for n in params)}):\n"
              f"    __class__ = _cls  # Lightning's save_hyperparameters finds the arguments through it\n"
              f"    super(_cls, self).__init__()\n"
              f"    self.save_hyperparameters(frame=_currentframe())\n"
              f"    self._configure()\n")
    namespace = {"_defaults": defaults, "_cls": cls, "_currentframe": inspect.currentframe}
    exec(compile(source, f"<generated {cls.__qualname__}.__init__>", "exec"), namespace)  # noqa: S102
    init = namespace["__init__"]
    init.__annotations__ = {**annotations, "return": None}
    init.__qualname__, init.__module__ = f"{cls.__qualname__}.__init__", cls.__module__
    cls.__init__ = init
    backbone = _args_section(LMConfig.__doc__)
    cls.__doc__ = cls.__doc__.replace("{backbone_args}", backbone)
    return cls


def _args_section(doc: str) -> str:
    """The entries of a docstring's ``Args:`` section, indented for another class's ``Args:`` section."""
    lines = inspect.cleandoc(doc).splitlines()
    start = lines.index("Args:") + 1
    out = []
    for line in lines[start:]:
        if line.strip() and not line.startswith(" "):
            break
        out.append("    " + line if line.strip() else "")
    return "\n".join(out).rstrip()


_generate_init(LMModule)
