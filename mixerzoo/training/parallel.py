"""Sharded training: FSDP2 (``torch.distributed.fsdp.fully_shard``) and tensor parallelism through Lightning's
``ModelParallelStrategy``.

Lightning's ``ModelParallelStrategy`` sets up the processes and a 2-D device mesh (``data_parallel`` x
``tensor_parallel``) and leaves the sharding to the LightningModule's ``configure_model``; :class:`FSDP2Strategy`
is that strategy with the defaults of data-parallel training (every process a data-parallel shard, tensor
parallelism off) and the FSDP2 options a recipe sets, and :func:`parallelize` is what ``configure_model`` applies:

1. tensor parallelism where the mesh has a ``tensor_parallel`` dimension above 1 (:func:`tensor_parallel_plan`:
   the SwiGLU/MLP channel mixers' projections, column- then row-wise);
2. ``fully_shard`` on every block (one all-gather and one reduce-scatter per block and step) and then on the
   whole model (the embedding, the final norm and the head), with a ``MixedPrecisionPolicy`` (parameters
   gathered in ``param_dtype``, gradients reduced in ``reduce_dtype``).

Chosen by name (``--trainer.strategy fsdp2``, or ``fsdp2_bf16`` to gather parameters in bfloat16) or by class path
with options in a recipe (``recipes/gpu/fsdp2.yaml``). Activation checkpointing (``model.activation_checkpointing``) and per-block ``torch.compile`` (``model.compile``)
are the module's own options and apply under FSDP2 unchanged. Checkpoints are distributed (DCP): a folder of
shards per checkpoint, which ``mixerzoo export`` and every loader read directly (:mod:`mixerzoo.hub.sharded`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from torch import nn

from ..errors import ConfigError

__all__ = ["FSDP2Strategy", "parallelize", "tensor_parallel_plan", "DTYPES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype(name: str | None, field: str) -> torch.dtype | None:
    if name is None:
        return None
    if name not in DTYPES:
        raise ConfigError(f"trainer.strategy.init_args.{field} must be one of {sorted(DTYPES)} or null, got {name!r}")
    return DTYPES[name]


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 through Lightning's ``ModelParallelStrategy``: each block and the model sharded with ``fully_shard``
    over the data-parallel processes (:func:`parallelize`), optionally with tensor parallelism inside a node.

    Args:
        data_parallel_size: processes that hold different shards and see different data; ``auto``: all of them
            divided by ``tensor_parallel_size``.
        tensor_parallel_size: processes that split each channel mixer's matmuls (1: off, the default).
        param_dtype: dtype parameters are gathered and computed in (``bfloat16`` for bf16 training; null: the
            parameters' own, float32). The sharded master copy and the optimizer states stay float32.
        reduce_dtype: dtype gradients are reduced in (``float32``).
        reshard_after_forward: free each block's gathered parameters after its forward and gather them again in
            backward (ZeRO-3; False keeps them, ZeRO-2: more memory, one all-gather less per block).
        save_distributed_checkpoint: each process writes its own shard (a DCP folder per checkpoint); False
            gathers the full state on rank 0 into one file.
        process_group_backend, timeout: as Lightning's (``gloo`` on CPU, ``nccl`` on CUDA by default).

    Raises:
        ConfigError: a dtype name that is not float32/bfloat16/float16.
    """

    def __init__(self, data_parallel_size: Literal["auto"] | int = "auto", tensor_parallel_size: int = 1,
                 param_dtype: str | None = None, reduce_dtype: str | None = "float32",
                 reshard_after_forward: bool = True, save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None, timeout: timedelta | None = timedelta(minutes=30)) -> None:
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.param_dtype = _dtype(param_dtype, "param_dtype")
        self.reduce_dtype = _dtype(reduce_dtype, "reduce_dtype")
        self.reshard_after_forward = reshard_after_forward

    def setup_environment(self) -> None:
        # Lightning's "auto" makes every process of a node a tensor-parallel rank; here data parallelism is the
        # default and tensor parallelism the option
        if self._data_parallel_size == "auto":
            world = self.num_nodes * self.num_processes
            if world % self._tensor_parallel_size:
                raise ConfigError(f"trainer.strategy tensor_parallel_size={self._tensor_parallel_size} does not "
                                  f"divide the {world} processes; choose a divisor of {world}")
            self._data_parallel_size = world // self._tensor_parallel_size
        super().setup_environment()

    def fsdp_options(self) -> dict[str, Any]:
        """The keyword arguments :func:`parallelize` takes from this strategy."""
        return {"param_dtype": self.param_dtype, "reduce_dtype": self.reduce_dtype,
                "reshard_after_forward": self.reshard_after_forward}


def tensor_parallel_plan(block: nn.Module) -> dict[str, Any]:
    """The ``parallelize_module`` plan of one block: the channel mixer's input projections (``gate_proj``,
    ``up_proj``) split by columns and its output projection (``down_proj``) by rows (Megatron's MLP split: one
    all-reduce per block), for every bundled channel mixer with projections (swiglu, relu2, rwkv7). Mixers are not split (their heads' state and kernels are per head; a plan per mechanism is
    future work): they run replicated on the tensor-parallel ranks. Empty when the block has no such projections."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    channel = getattr(block, "channel", None)
    if channel is None:
        return plan
    names = {name for name, m in channel.named_children() if isinstance(m, nn.Linear)}
    if {"up_proj", "down_proj"} <= names:
        plan.update({f"channel.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj") if n in names})
        plan["channel.down_proj"] = RowwiseParallel()
    return plan


def parallelize(model: nn.Module, mesh, param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = torch.float32, reshard_after_forward: bool = True) -> nn.Module:
    """Shard ``model`` (a :class:`mixerzoo.model.LanguageModel`) over ``mesh`` in place and return it.

    Args:
        mesh: a ``DeviceMesh`` with a ``data_parallel`` dimension (and optionally ``tensor_parallel``), as
            Lightning's ``ModelParallelStrategy`` makes it, or a 1-D mesh (data parallel only).
        param_dtype, reduce_dtype, reshard_after_forward: FSDP2's ``MixedPrecisionPolicy`` and resharding (see
            :class:`FSDP2Strategy`).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    names = mesh.mesh_dim_names or ()
    dp_mesh = mesh["data_parallel"] if "data_parallel" in names else mesh
    if "tensor_parallel" in names and mesh["tensor_parallel"].size() > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        for block in model.blocks:
            plan = tensor_parallel_plan(block)
            if plan:
                parallelize_module(block, mesh["tensor_parallel"], plan)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # the root (embedding, final norm, head) is used first and last in a step: kept gathered after its forward
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False)
    return model


# `--trainer.strategy fsdp2` (and `fsdp2_bf16`) by name, as Lightning's own strategies are named
if "fsdp2" not in StrategyRegistry:
    StrategyRegistry.register("fsdp2", FSDP2Strategy, description="FSDP2 (fully_shard per block), mixerzoo")
    StrategyRegistry.register("fsdp2_bf16", FSDP2Strategy, description="FSDP2 with bf16 parameters, mixerzoo",
                              param_dtype="bfloat16")
