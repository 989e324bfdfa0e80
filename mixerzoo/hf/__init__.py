"""``transformers`` interoperability for exported models.

An export folder carries two small code files that ``transformers`` imports with ``trust_remote_code=True``
(named in config.json's ``auto_map``); they only re-export :class:`~mixerzoo.hf.configuration.MixerzooConfig`
and :class:`~mixerzoo.hf.modeling.MixerzooForCausalLM` from the installed mixerzoo, so the model code is the
code mixerzoo tests, and the mixers come from the installed plugins::

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("exports/my-model", trust_remote_code=True)

Alternatively :func:`register` makes ``model_type: mixerzoo`` known to the Auto classes in this process, so
``trust_remote_code`` is not needed. Importing this package does not import ``transformers``.
"""

from __future__ import annotations

from ..hub.remote_code import ARCHITECTURE, AUTO_MAP, remote_code

__all__ = ["AUTO_MAP", "ARCHITECTURE", "remote_code", "register"]


def register() -> None:
    """Register ``MixerzooConfig``/``MixerzooForCausalLM`` with ``AutoConfig``/``AutoModelForCausalLM`` in this
    process (then exported folders load without ``trust_remote_code``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .configuration import MixerzooConfig
    from .modeling import MixerzooForCausalLM

    AutoConfig.register("mixerzoo", MixerzooConfig, exist_ok=True)
    AutoModelForCausalLM.register(MixerzooConfig, MixerzooForCausalLM, exist_ok=True)
