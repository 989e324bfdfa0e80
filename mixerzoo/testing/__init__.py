"""The conformance kit: the Mixer protocol as checks, reusable from any plugin's own tests.

``run_conformance`` runs every check on a fresh mixer and raises :class:`ConformanceError` naming the first that
fails (its ``check``), where and by how much::

    from mixerzoo.testing import run_conformance
    def test_my_mixer():
        run_conformance(lambda: MyMixer(d_model=32, n_heads=2), d_model=32, seq_len=48, splits=(1, 17, 32))

The pieces: :mod:`.checks` (each check, its tolerances and the bf16 error model in its docstring), :mod:`.documents`
(packed documents against each alone), :mod:`.conformance` (``run_conformance``: all of them in order),
:mod:`.cuda_autocast` (CUDA autocast's dtype rules emulated on the CPU), :mod:`.operators` (counting the ATen
operators a fast path runs), :mod:`mixerzoo.decisions` (discrete choices recorded and replayed across precisions).
The pytest fixture ``mixer_conformance`` (:mod:`mixerzoo.pytest_plugin`) wraps ``run_conformance``.
"""

from .. import decisions
from .checks import (AUTOCAST_BF16_ATOL, AUTOCAST_BF16_RTOL, BF16_ROUNDINGS, BF16_UNIT_ROUNDOFF,
                     BF16_WEIGHTS_ROUNDINGS, FP32_ATOL, FP32_RTOL, LONG_POSITION, ConformanceError,
                     bf16_tolerance, check_activation_checkpointing, check_autocast_bf16, check_bf16_weights,
                     check_causality, check_continuation, check_cuda_autocast_emulated, check_cuda_bf16,
                     check_decode, check_float64, check_gradients, check_recomputation, check_state,
                     decode_stepwise)
from .conformance import ConformanceReport, run_conformance
from .documents import check_documents
from .operators import OperatorCalls

__all__ = ["ConformanceError", "ConformanceReport", "run_conformance", "check_causality", "check_continuation",
           "check_decode", "check_state", "check_gradients", "check_activation_checkpointing", "check_recomputation",
           "check_autocast_bf16", "check_cuda_autocast_emulated", "check_float64", "check_bf16_weights",
           "check_cuda_bf16", "decode_stepwise", "OperatorCalls", "bf16_tolerance",
           "FP32_ATOL", "FP32_RTOL", "AUTOCAST_BF16_ATOL", "AUTOCAST_BF16_RTOL", "BF16_UNIT_ROUNDOFF",
           "BF16_ROUNDINGS", "BF16_WEIGHTS_ROUNDINGS", "LONG_POSITION", "decisions", "check_documents"]
