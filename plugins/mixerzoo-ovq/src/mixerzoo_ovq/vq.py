"""VQ-attention with a static, learned key codebook: the "sw-vq" baseline of the OVQ paper (arXiv 2602.03922,
sec. 2.2-2.3, eq. 3-10, appendix 8.1), after Transformer-VQ (Lingle, 2023).

VQ-attention is softmax attention whose keys are replaced by their nearest codeword (eq. 3):
``o_t = softmax(q_t K_hat_{0:t}^T) V_{0:t}``. Because every key assigned to codeword ``i`` has the same
quantized key, past chunks collapse into per-codeword value means and counts (eq. 7-10):
``exp(q d_i + log c_i) mean_i(v)`` is the sum of their terms, so the chunked form below is *exactly* the
quadratic form, with a state of ``codebook_size`` value rows and counts per kv head, whatever the context.

It shares OVQ-attention's layer and forms (:class:`~mixerzoo_ovq.layer.OVQAttention`,
:mod:`~mixerzoo_ovq.chunk`, :mod:`~mixerzoo_ovq.recurrent`; ``Spec.static_codebook``): queries of chunk ``c``
attend over ``[codebook ; K_hat_c]`` with the log-count prior (codewords no key has reached yet have count 0,
prior ``-inf``); a complete chunk is merged by adding its values to their codewords' running means. What
differs from OVQ is only where ``D_k`` comes from: a parameter trained by backpropagation, never updated
online (the paper's point: this static dictionary models a sequence's keys poorly).

Deviations from the paper's sw-vq (appendix 8.1), stated: the codebook is trained by a straight-through
estimator (the quantized key's value is the codeword; the gradient reaches both the codeword and the key)
instead of space-filling DiVeQ with a dead-codeword penalty; codewords and keys are unit norm, as the paper's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixerzoo.decisions import decision
from mixerzoo.ops import max_last

from . import naive, ops
from .layer import _READS, OVQAttention, register_ovq_forms
from .state import VQState, state_log_counts

__all__ = ["VQState", "VQAttention", "quantize_keys"]


def quantize_keys(k: torch.Tensor, codebook: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest codeword of each unit-norm key (largest dot product = smallest distance on the sphere), eq. 3.

    Args:
        k: ``(B, H_kv, T, D)`` unit-norm keys.
        codebook: ``(H_kv, N, D)`` unit-norm codewords.

    Returns:
        ``k_hat (B, H_kv, T, D)``: the codeword in value, with a straight-through gradient to ``k`` and the
        codeword's own gradient; ``index (B, H_kv, T)`` long.
    """
    with torch.no_grad():
        index = max_last(torch.einsum("bhtd,hnd->bhtn", k, codebook.to(k.dtype)))[1]  # argmax, vectorised
        index = decision("vq.nearest", index)  # the conformance kit replays choices across precisions
    B, Hkv, T, D = k.shape
    picked = codebook.to(k.dtype)[None].expand(B, Hkv, -1, D).gather(2, index[..., None].expand(B, Hkv, T, D))
    return picked + (k - k.detach()), index


class VQAttention(OVQAttention):
    """VQ-attention (sw-vq baseline): softmax attention over keys quantized to a learned codebook (eq. 3).

    Args:
        d_model, n_heads, n_kv_heads, head_dim, chunk_len, beta_init, positional, token_shift, value_residual,
            bias, checkpoint_chunks, backend: as :class:`~mixerzoo_ovq.layer.OVQAttention` (the Triton backend needs no
            kernel here: a key's codeword does not depend on earlier chunks, so only the batched reads run).
        codebook_size: ``N`` codewords per kv head (paper's sw-vq: 1k-3k), fixed: the state is ``N`` value rows
            and counts from the first token on.

    State: :class:`VQState`, constant size (``N`` rows + ``< L`` buffered tokens).

    Raises:
        ValueError: a bad option (named); :meth:`set_max_size` with another size (a learned codebook cannot grow).
    """

    uses_schedule = False
    mixer_name = "vq"
    FORMS = register_ovq_forms("vq")

    def __init__(self, d_model: int, n_heads: int = 4, n_kv_heads: int | None = None, head_dim: int | None = None,
                 chunk_len: int = 128, codebook_size: int = 2048, beta_init: float = 1.0, positional: Any = "nope",
                 token_shift: bool = False, value_residual: bool = False, bias: bool = False,
                 checkpoint_chunks: int = 16, layer_idx: int = 0, backend: str = "auto") -> None:
        if not isinstance(codebook_size, int) or isinstance(codebook_size, bool) or codebook_size < 1:
            raise ValueError(f"vq codebook_size (N codewords per kv head) must be a positive integer, "
                             f"got {codebook_size!r}")
        super().__init__(d_model, n_heads, n_kv_heads, head_dim, chunk_len, codebook_size, "saturating",
                         beta_init=beta_init, positional=positional, token_shift=token_shift,
                         value_residual=value_residual, bias=bias, checkpoint_chunks=checkpoint_chunks,
                         layer_idx=layer_idx, backend=backend)
        self.codebook = nn.Parameter(F.normalize(torch.randn(self.qkv.n_kv_heads, codebook_size, self.qkv.head_dim),
                                                 dim=-1))

    def set_max_size(self, max_size: int) -> "VQAttention":
        """The codebook size is fixed; only the current size is accepted (returns ``self``).

        Raises:
            ValueError: any other size (the codebook is a trained parameter).
        """
        if hasattr(self, "codebook") and max_size != self.codebook.shape[1]:
            raise ValueError(f"vq codebook_size is a trained parameter ({self.codebook.shape[1]} codewords) and "
                             f"cannot change at evaluation time (got {max_size}); that is what OVQ's online "
                             f"dictionary adds")
        self._max_size = max_size
        return self

    def codes(self) -> torch.Tensor:
        """``(H_kv, N, D)`` unit-norm codewords."""
        return F.normalize(self.codebook, dim=-1)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries as OVQ's; keys unit norm, then quantized to their nearest codeword (:func:`quantize_keys`)."""
        q, k = super().normalize_qk(q, k)
        return q, quantize_keys(k, self.codes())[0]

    def empty_state(self, batch: int, device=None, dtype=torch.float32) -> VQState:
        """The state at the start of a sequence: no key absorbed yet, empty chunk, for inputs of ``dtype``."""
        Hkv, N, D = self.codebook.shape
        acc = ops.accumulation_dtype(dtype)
        z = torch.zeros(batch, Hkv, 0, D, device=device, dtype=acc)
        return VQState(dv=torch.zeros(batch, Hkv, N, D, device=device, dtype=acc),
                       counts=torch.zeros(batch, Hkv, N, device=device, dtype=acc), buf_k=z, buf_v=z, next_pos=0)

    def _carry(self, st: VQState, acc: torch.dtype) -> tuple:
        B = st.dv.shape[0]
        return (self.codes().to(acc)[None].expand(B, -1, -1, -1), st.dv.to(acc), st.counts.to(acc),
                state_log_counts(st).to(acc), st.buf_k, st.buf_v)

    def _state(self, carry: tuple, next_pos: int, shift) -> VQState:
        _, dv, counts, log_counts, buf_k, buf_v = carry
        return VQState(dv=dv, counts=counts, buf_k=buf_k, buf_v=buf_v, log_counts=log_counts, next_pos=next_pos,
                       shift=shift)

    def spec(self, form: str = "chunk") -> ops.Spec:
        """OVQ's options with ``static_codebook``: a finished chunk adds its values to their codewords' means and the
        codebook stays (:func:`mixerzoo_ovq.ops.merge`)."""
        return ops.Spec(self.chunk_len, static_codebook=True, read=_READS.get(form))

    def _reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """Eq. 3's quadratic form (:func:`mixerzoo_ovq.naive.vq_attention`, a key seen through its codeword by later
        chunks) and eq. 5-6's value means of the whole chunks (:func:`mixerzoo_ovq.naive.vq_merge`), from a
        sequence's start: ``o (B, H, T, D)`` and the carry after it (:meth:`_carry`'s tensors)."""
        q, k = OVQAttention.normalize_qk(self, q, k)
        k_hat, index = quantize_keys(k, self.codes())
        B, Hkv, T, D = k.shape
        L, acc = self.chunk_len, ops.accumulation_dtype(q.dtype)
        codes = self.codes().to(k.dtype)[None].expand(B, -1, -1, -1)
        o = naive.vq_attention(q, k_hat, v, L, codes.gather(2, index[..., None].expand(B, Hkv, T, D)))
        done = T // L * L
        empty = self.empty_state(B, k.device, acc)
        dv, counts = naive.vq_merge(empty.dv, empty.counts, index[..., :done], v[:, :, :done])
        return o, (codes.to(acc), dv, counts, counts.log(), k_hat[:, :, done:], v[:, :, done:])

    def dictionary_rows(self, seq_len: int) -> int:
        """The codebook's rows: every query reads all of them."""
        return self.codebook.shape[1]

    def extra_repr(self) -> str:
        return f"chunk_len={self.chunk_len}, codebook_size={self.codebook.shape[1]}"
