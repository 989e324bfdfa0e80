"""Turning configuration and input mistakes into one clear message instead of a deep traceback."""

from __future__ import annotations

import contextlib
import os
import re
import sys

from .model.config import ConfigError
from .registry import PluginImportError, UnknownNameError

__all__ = ["friendly_errors", "USER_ERRORS", "out_of_memory_message"]

# Errors whose message already names the field and the fix: print it, exit 2, no traceback. Lightning's
# MisconfigurationException is its own "this trainer setting cannot work" error (e.g. a strategy or precision
# the machine does not support) and carries a readable message.
USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, UnknownNameError, PluginImportError, FileNotFoundError)
try:
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    USER_ERRORS += (MisconfigurationException,)
except ImportError:  # pragma: no cover - lightning is a dependency
    pass


def out_of_memory_message(e: BaseException) -> str | None:
    """The one-line message for an allocation failure (CPU ``DefaultCPUAllocator``, ``MemoryError`` or CUDA
    ``OutOfMemoryError``), or None when ``e`` is something else."""
    import torch

    text = str(e)
    is_oom = (isinstance(e, (MemoryError, torch.cuda.OutOfMemoryError))  # torch.OutOfMemoryError only from 2.5
              or (isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)))
    if not is_oom:
        return None
    size = re.search(r"allocate (\d+) bytes", text) or re.search(r"allocate ([\d.]+ [KMGT]iB)", text)
    detail = "" if size is None else (f": tried to allocate {int(size.group(1)) / 2**30:,.1f} GiB"
                                      if size.group(1).isdigit() else f": tried to allocate {size.group(1)}")
    return (f"out of memory{detail}; the model or the batch does not fit this machine. Lower "
            f"model.d_model, model.n_layers or the vocabulary (data.init_args.vocab_size / the tokenizer), or "
            f"data.init_args.batch_size / seq_len (trainer.accumulate_grad_batches keeps the effective batch)")


@contextlib.contextmanager
def friendly_errors():
    """Print user errors as ``mixerzoo: error: ...`` and exit with status 2 (``MIXERZOO_TRACEBACK=1`` shows the
    traceback). Other exceptions propagate unchanged: they are bugs and deserve a traceback."""
    try:
        yield
    except USER_ERRORS as e:
        if os.environ.get("MIXERZOO_TRACEBACK"):
            raise
        print(f"mixerzoo: error: {e}", file=sys.stderr)
        sys.exit(2)
    except (RuntimeError, MemoryError) as e:
        message = out_of_memory_message(e)
        if message is None or os.environ.get("MIXERZOO_TRACEBACK"):
            raise
        print(f"mixerzoo: error: {message}", file=sys.stderr)
        sys.exit(2)
