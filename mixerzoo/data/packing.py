"""Packed documents in a batch: where each document starts, for mixers that keep them apart (``cu_seqlens``).

Text windows are cut from one token stream in which documents are joined with the end-of-text token (EOT). With
``data.document_mask`` a batch of ``B`` windows of ``T`` tokens is trained as one packed sequence of ``B * T``
tokens, ``(1, B * T)``, whose documents start at every window start and at every EOT token: the EOT starts the
document it precedes, acting as its beginning-of-sequence token. So the prediction of a document's first token is
made from the EOT alone, and the EOT itself is predicted at the end of the previous document (from that document,
as without masking). The offsets are computed on the host when a batch is collated, so the model reads them
without a device synchronisation (:mod:`mixerzoo.protocol`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import default_collate

__all__ = ["document_offsets", "PackedCollate"]


def document_offsets(windows: torch.Tensor, eot_id: int | None) -> torch.Tensor:
    """Offsets of the documents in a batch of windows packed along time.

    Args:
        windows: ``(B, T)`` token ids (the ``input_ids`` of a batch; any device, read on the host).
        eot_id: the end-of-text id that separates documents, or None (then every window is one document).

    Returns:
        ``cu_seqlens``, ``(N+1,)`` int32 on the CPU: ``0``, every window start ``b * T`` and every position of
        an EOT token in the flattened ``(B * T,)`` batch (each starts a document), and ``B * T``.

    Raises:
        ValueError: ``windows`` is not 2-D or is empty.
    """
    if windows.dim() != 2 or windows.numel() == 0:
        raise ValueError(f"windows must be (B, T) token ids with B, T >= 1, got shape {tuple(windows.shape)}")
    B, T = windows.shape
    flat = windows.detach().reshape(-1).cpu()
    starts = torch.zeros(B * T, dtype=torch.bool)
    starts[::T] = True
    if eot_id is not None:
        starts |= flat == eot_id
    return torch.cat([starts.nonzero().flatten(), torch.tensor([B * T])]).to(torch.int32)


class PackedCollate:
    """A ``DataLoader`` collate function: the default collate of ``{"input_ids", "labels"}`` items, plus
    ``"cu_seqlens"``, the :func:`document_offsets` of the batch's ``input_ids`` (a CPU tensor; the LM module keeps
    it on the CPU when the batch moves to the accelerator). Picklable, for worker processes."""

    def __init__(self, eot_id: int | None) -> None:
        self.eot_id = eot_id

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        batch = default_collate(items)
        batch["cu_seqlens"] = document_offsets(batch["input_ids"], self.eot_id)
        return batch
