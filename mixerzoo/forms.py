"""One rule for choosing a mixer's form: each form declares what it supports, a layer picks with one call.

A mechanism has several *forms* of one computation (fla's names: ``naive``, ``chunk``, ``recurrent``, and
device kernels such as ``triton`` or fla's own). Which one a forward runs depends on the call (device, dtype,
whether autograd records, packed documents, one token with a state) and on the layer's options. Instead of an
if-chain per plugin, each form states what it can do in a :class:`Form`, a mechanism's forms are registered once
in a :class:`Forms` table (fla's ``ops/backends`` dispatch is the model: every backend says whether it is available
and verifies each call), and the layer calls :meth:`Forms.pick`::

    FORMS = register_forms("kvm", [
        Form("triton", devices={"cuda"}, cu_seqlens=True, available=triton_available, priority=20),
        Form("chunk", cu_seqlens=True, priority=10),
        Form("recurrent", grad=False, tokens=1, priority=30),
        Form("naive", priority=0, auto=False),
    ])
    form = FORMS.pick(Call.of(x, self, cu_seqlens=cu, state=state, options=self.options), backend=self.backend)

``backend: auto`` takes the available form of highest priority that accepts the call; ``backend: <name>`` forces
that form, and a forced form asked for what it cannot do is refused with one line naming the form and the reason.
Picking reads host values only (device type, dtype, flags, Python options): no tensor is read, so it never
synchronises with a device and ``torch.compile`` guards on it like any other Python condition.

``forms_of(mechanism)`` lists a mechanism's table (``mixerzoo plugins NAME`` prints it).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping

import torch

from .errors import ConfigError

__all__ = ["Call", "Form", "Forms", "register_forms", "forms_of", "registered_forms"]


@dataclasses.dataclass(frozen=True)
class Call:
    """What one forward asks of a form.

    Attributes:
        device: the input's device type (``"cpu"``, ``"cuda"``, ...).
        dtype: the dtype the computation runs in (the input's, or autocast's where autocast is on for the
            device).
        grad: whether autograd records the call (a gradient will be asked for).
        tokens: ``T``, the tokens of the call.
        packed: whether ``cu_seqlens`` was given (several documents packed along time).
        has_state: whether a state continues an earlier call.
        options: the layer's options that forms may refuse (e.g. ``{"soft_routing": True}``).
    """

    device: str
    dtype: torch.dtype
    grad: bool
    tokens: int
    packed: bool = False
    has_state: bool = False
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, x: torch.Tensor, module: torch.nn.Module | None = None, *, cu_seqlens: Any = None,
           state: Any = None, options: Mapping[str, Any] | None = None) -> "Call":
        """The call of a forward on ``x (B, T, d_model)``: ``grad`` when autograd is on and ``x`` or a parameter
        of ``module`` requires a gradient; ``dtype`` autocast's for ``x``'s device where it is enabled."""
        device = x.device.type
        dtype = x.dtype
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
        grad = torch.is_grad_enabled() and (x.requires_grad or (module is not None and any(
            p.requires_grad for p in module.parameters())))
        return cls(device=device, dtype=dtype, grad=grad, tokens=x.shape[1], packed=cu_seqlens is not None,
                   has_state=state is not None, options=dict(options or {}))


@dataclasses.dataclass(frozen=True)
class Form:
    """A form of a mechanism and what it supports.

    Args:
        name: the form's name, the value of the layer's ``backend`` option that forces it.
        devices: device types it runs on (None: any).
        dtypes: dtypes it computes in (None: any).
        grad: whether it gives gradients (False: inference only, e.g. a decode kernel without a backward).
        cu_seqlens: whether it keeps packed documents apart (``cu_seqlens``, :mod:`mixerzoo.protocol`).
        tokens: the only number of tokens it takes (1 for a decode step), or None for any.
        state: whether it continues a state (False: it starts every call from an empty state).
        available: whether it can run on this installation (e.g. Triton importable); called when picking.
        accepts: the check of everything else (option values, shapes): returns the reason it cannot serve the
            call, or None when it can.
        priority: ``backend: auto`` prefers higher values.
        auto: whether ``backend: auto`` may pick it (False for references such as ``naive``, forced only).
    """

    name: str
    devices: Iterable[str] | None = None
    dtypes: Iterable[torch.dtype] | None = None
    grad: bool = True
    cu_seqlens: bool = False
    tokens: int | None = None
    state: bool = True
    available: Callable[[], bool] | None = None
    accepts: Callable[[Call], str | None] | None = None
    priority: int = 0
    auto: bool = True

    def refusal(self, call: Call) -> str | None:
        """Why this form cannot serve ``call`` (one phrase), or None when it can."""
        if self.available is not None and not self.available():
            return "it is not available on this installation"
        if self.devices is not None and call.device not in set(self.devices):
            return f"it runs on {'/'.join(sorted(self.devices))} tensors, not {call.device}"
        if self.dtypes is not None and call.dtype not in set(self.dtypes):
            return f"it does not compute in {str(call.dtype).removeprefix('torch.')}"
        if call.grad and not self.grad:
            return "it gives no gradient (use it under torch.no_grad())"
        if call.packed and not self.cu_seqlens:
            return "it does not keep packed documents apart (cu_seqlens)"
        if self.tokens is not None and call.tokens != self.tokens:
            return f"it takes {self.tokens} token(s) per call, not {call.tokens}"
        if call.has_state and not self.state:
            return "it does not continue a state"
        return self.accepts(call) if self.accepts is not None else None


class Forms:
    """A mechanism's forms and the one rule that picks among them (:meth:`pick`)."""

    def __init__(self, mechanism: str, forms: Iterable[Form]) -> None:
        self.mechanism = mechanism
        self.forms = {f.name: f for f in forms}

    @property
    def names(self) -> tuple[str, ...]:
        """The forms' names, each a valid ``backend`` value besides ``auto``."""
        return tuple(self.forms)

    def check_backend(self, backend: str) -> str:
        """``backend`` if it is ``auto`` or a form's name.

        Raises:
            ConfigError: another value (the message lists the valid ones)."""
        if backend != "auto" and backend not in self.forms:
            raise ConfigError(f"{self.mechanism} backend must be one of {('auto', *self.names)}, got {backend!r}")
        return backend

    def pick(self, call: Call, backend: str = "auto") -> Form:
        """The form that runs ``call``: the forced ``backend``, or under ``auto`` the accepting form of highest
        priority.

        Raises:
            ConfigError: the forced form refuses the call, or no form accepts it (the message names each form's
                reason).
        """
        if backend != "auto":
            form = self.forms.get(self.check_backend(backend))
            reason = form.refusal(call)
            if reason is not None:
                raise ConfigError(f"{self.mechanism} backend {backend!r} cannot run this call: {reason}; use "
                                  f"backend: auto or another of {self.names}")
            return form
        reasons = []
        for form in sorted(self.forms.values(), key=lambda f: -f.priority):
            if not form.auto:
                continue
            reason = form.refusal(call)
            if reason is None:
                return form
            reasons.append(f"{form.name}: {reason}")
        raise ConfigError(f"no form of {self.mechanism} can run this call ({'; '.join(reasons)})")

    def table(self) -> list[dict[str, Any]]:
        """One row per form (name, devices, dtypes, grad, cu_seqlens, tokens, priority, auto), for listings."""
        return [{"form": f.name, "devices": "any" if f.devices is None else "/".join(sorted(f.devices)),
                 "dtypes": "any" if f.dtypes is None else "/".join(str(d).removeprefix("torch.") for d in f.dtypes),
                 "grad": f.grad, "cu_seqlens": f.cu_seqlens, "tokens": f.tokens or "any", "priority": f.priority,
                 "auto": f.auto} for f in self.forms.values()]


_REGISTRY: dict[str, Forms] = {}


def register_forms(mechanism: str, forms: Iterable[Form]) -> Forms:
    """Register (or replace) ``mechanism``'s table of forms and return it (a plugin does this at import)."""
    table = Forms(mechanism, forms)
    _REGISTRY[mechanism] = table
    return table


def forms_of(mechanism: str) -> Forms | None:
    """``mechanism``'s table, or None where it registered none (a mixer with one form needs none)."""
    return _REGISTRY.get(mechanism)


def registered_forms() -> dict[str, Forms]:
    """Every registered table, by mechanism."""
    return dict(_REGISTRY)
