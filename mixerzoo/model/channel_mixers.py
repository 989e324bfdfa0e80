"""Channel mixers (the per-token MLP sublayer): SwiGLU, ReLU² (optionally with token shift) and RWKV-7's.

Like mixers they map ``(x (B, T, d_model), state) -> (y, state)``; the state is only used by token shift
(the previous token's input) and is ``None`` otherwise. A mixer with token shift (``token_shift`` True) also takes
``reset (T,)`` (bool, True where a packed document starts): the shift starts afresh there, as at a sequence
start; the others are per token and need nothing for packed documents.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..mixers.qkv import token_shift

__all__ = ["SwiGLU", "ReLUSquared", "RWKV7ChannelMix", "CHANNEL_MIXERS", "build_channel_mixer", "default_d_ff"]


def default_d_ff(kind: str, d_model: int) -> int:
    """Hidden width: SwiGLU ``8/3 d_model`` rounded up to a multiple of 64 (Llama); ReLU² ``4 d_model``; RWKV-7
    ``4 d_model`` rounded down to a multiple of 32 (as the GPTAlpha-2 backbone sizes it)."""
    if kind == "swiglu":
        return (int(8 * d_model / 3) + 63) // 64 * 64
    if kind == "rwkv7":
        return 4 * d_model // 32 * 32
    return 4 * d_model


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` (Shazeer 2020)."""

    def __init__(self, d_model: int, d_ff: int, token_shift: bool = False) -> None:
        super().__init__()
        if token_shift:
            raise ValueError("model.channel_token_shift is only available with channel_mixer: relu2")
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor, state=None):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)), None


class ReLUSquared(nn.Module):
    """``down(relu(up(x'))^2)`` (So et al. 2021), with optional token shift ``x' = x + mu (x_{t-1} - x)``
    (learned per-channel ``mu``, init 0.5) as in the KVM paper's backbone (appendix B)."""

    def __init__(self, d_model: int, d_ff: int, token_shift: bool = False) -> None:
        super().__init__()
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)
        self.token_shift = token_shift
        if token_shift:
            self.shift_mu = nn.Parameter(torch.full((d_model,), 0.5))

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None, reset: torch.Tensor | None = None):
        new_state = None
        if self.token_shift:
            x, new_state = token_shift(x, self.shift_mu, state, reset)
        return self.down_proj(F.relu(self.up_proj(x)).square()), new_state


class RWKV7ChannelMix(nn.Module):
    """RWKV-7's channel mix (Peng et al. 2025, RWKV-7 "Goose", section 4, "ReLU² MLP" with token shift), the
    GPTAlpha-2 backbone's MLP: ``down(relu(up(x'))^2)`` with ``x'_t = x_t + mu (x_{t-1} - x_t)`` and, unlike
    :class:`ReLUSquared`'s token shift, ``x_{-1} = 0`` at sequence start (RWKV's zero-padded time shift), so the
    first token is scaled by ``1 - mu``. Learned per-channel ``mu`` (``shift_mu``, init 0.5).

    ``x (B, T, d_model) -> (y (B, T, d_model), state)``; the state is the last input token ``(B, d_model)``."""

    token_shift = True

    def __init__(self, d_model: int, d_ff: int, token_shift: bool = True) -> None:
        super().__init__()
        if not token_shift:
            raise ValueError("model.channel_mixer: rwkv7 always shifts tokens; use channel_mixer: relu2 without it")
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)
        self.shift_mu = nn.Parameter(torch.full((d_model,), 0.5))

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None, reset: torch.Tensor | None = None):
        prev = torch.zeros_like(x[:, 0]) if state is None else state
        x, new_state = token_shift(x, self.shift_mu, prev, reset, zero_start=True)
        return self.down_proj(F.relu(self.up_proj(x)).square()), new_state


class NoChannelMixer(nn.Module):
    """No MLP sublayer (mixer-only blocks, as in some recall studies)."""

    def __init__(self, d_model: int, d_ff: int, token_shift: bool = False) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor, state=None):
        return torch.zeros_like(x), None


CHANNEL_MIXERS = {"swiglu": SwiGLU, "relu2": ReLUSquared, "rwkv7": RWKV7ChannelMix, "none": NoChannelMixer}


def build_channel_mixer(kind: str, d_model: int, d_ff: int | None, token_shift: bool = False) -> nn.Module:
    """Build a channel mixer by name (``rwkv7`` always shifts tokens, whatever ``token_shift`` says).

    Raises:
        ValueError: unknown name (lists the known ones), or token shift with SwiGLU.
    """
    if kind not in CHANNEL_MIXERS:
        raise ValueError(f"model.channel_mixer={kind!r} is not known; use one of {sorted(CHANNEL_MIXERS)}")
    return CHANNEL_MIXERS[kind](d_model, d_ff or default_d_ff(kind, d_model), token_shift or kind == "rwkv7")
