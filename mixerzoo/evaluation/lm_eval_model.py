"""A model class for EleutherAI's lm-evaluation-harness (``lm-eval``, optional): ``--model mixerzoo``.

Importing this module registers :class:`MixerzooLM` under the name ``mixerzoo`` (lm-eval's ``register_model``).
It loads a Lightning checkpoint, a folder made by ``mixerzoo export`` or a Hub repository id, with its own
tokenizer (:func:`mixerzoo.hub.load_model`), and answers the three request types through
the Mixer protocol only, one request at a time:

- ``loglikelihood(context, continuation)``: ``[eos] + context + continuation`` streamed ``chunk`` tokens at a time
  with the mixers' states; the continuation's summed log-probability and whether each of its tokens is the argmax.
- ``loglikelihood_rolling(text)``: the whole text after ``eos`` in one stream with the states, so every token is
  predicted once with all of its left context (no windows: memory is bounded by the mixers, not the text).
- ``generate_until(context, {until, max_gen_toks})``: greedy decoding that carries the states, stopped at the first
  ``until`` string (cut off) or after ``max_gen_toks`` tokens.

Use from Python (``lm_eval.simple_evaluate(model=MixerzooLM("run.ckpt"), tasks=[...])``) or from the shell with
``python -m mixerzoo.evaluation.lm_eval_model --model mixerzoo --model_args pretrained=run.ckpt --tasks ...``
(lm-eval's own command line, after this module registered the class).

Raises:
    ImportError: on import when ``lm_eval`` is not installed (``pip install lm-eval``).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from ..model.generation import stream_tokens
from .models import model_device, stream_logits

__all__ = ["MixerzooLM"]


@register_model("mixerzoo")
class MixerzooLM(LM):
    """lm-eval model over any mixerzoo model (see the module docstring).

    Args:
        pretrained: a ``.ckpt``, an export folder or a Hub repository id.
        tokenizer: a tokenizer.json to use instead of the model's.
        device: ``cpu``/``cuda``/... (default: cuda if available). dtype: ``float32``/``bfloat16``/``float16``.
        chunk: tokens per forward call when streaming (memory bound).
        max_gen_toks: default cap of generated tokens.
    """

    def __init__(self, pretrained: str, tokenizer: str | None = None, device: str | None = None,
                 dtype: str | None = None, chunk: int = 1024, max_gen_toks: int = 256, batch_size: int = 1,
                 **_: object) -> None:
        super().__init__()
        from ..hub.source import load_model

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        loaded = load_model(str(pretrained), tokenizer=tokenizer, device=device, dtype=dtype)
        self.model, self.tokenizer, self.eos_id = loaded.model, loaded.tokenizer, loaded.eos_id
        self.vocab = int(self.model.config.vocab_size)
        self.chunk, self.max_gen_toks = int(chunk), int(max_gen_toks)

    # -- helpers --------------------------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _prefix(self) -> list[int]:
        return [self.eos_id] if self.eos_id is not None else []

    @torch.no_grad()
    def _score(self, ids: list[int], n_scored: int) -> tuple[float, bool]:
        """Log-probability of the last ``n_scored`` tokens of ``ids`` given the ones before, and whether each was
        the argmax; the input is streamed with the mixers' states."""
        x = torch.tensor([ids[:-1]], dtype=torch.long)
        target = torch.tensor(ids[1:], dtype=torch.long)
        first = len(ids) - 1 - n_scored  # index in the prediction sequence of the first scored token
        total, greedy = 0.0, True
        for start, logits, _ in stream_logits(self.model, x, self.chunk):
            c = logits.shape[1]
            lo = max(first, start)
            if lo >= start + c:
                continue
            lp = F.log_softmax(logits[0, lo - start:, :self.vocab], -1).cpu()
            tgt = target[lo:start + c]
            total += float(lp.gather(1, tgt[:, None]).sum())
            greedy &= bool((lp.argmax(-1) == tgt).all())
        return total, greedy

    def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Tokens of the context and of the continuation as they come out of encoding them together (lm-eval's
        convention: trailing spaces of the context move to the continuation)."""
        n_space = len(context) - len(context.rstrip())
        if n_space:
            context, continuation = context[:-n_space], context[-n_space:] + continuation
        whole, ctx = self._encode(context + continuation), self._encode(context)
        if whole[:len(ctx)] == ctx and len(whole) > len(ctx):
            return ctx, whole[len(ctx):]
        return ctx, self._encode(continuation)

    # -- the three request types ------------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for req in requests:
            context, continuation = req.args[0], req.args[1]
            ctx, cont = self._split(context, continuation)
            ids = self._prefix() + ctx + cont
            if len(ids) < 2 or not cont:
                out.append((0.0, True))
                continue
            out.append(self._score(ids, len(cont)))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in requests:
            ids = self._prefix() + self._encode(req.args[0])
            out.append(self._score(ids, len(ids) - 1)[0] if len(ids) > 1 else 0.0)
        return out

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        device = model_device(self.model)
        for req in requests:
            context, kwargs = req.args[0], dict(req.args[1] or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            limit = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = self._prefix() + self._encode(context)
            new: list[int] = []
            text = ""
            for tok in stream_tokens(self.model, torch.tensor([ids or [0]], device=device), limit, temperature=0):
                new.append(int(tok[0]))
                text = self.tokenizer.decode(new, skip_special_tokens=False)
                if any(u in text for u in until):
                    break
            for u in until:
                text = text.split(u)[0]
            out.append(text)
        return out

    @property
    def tokenizer_name(self) -> str:
        return "mixerzoo"


if __name__ == "__main__":  # lm-eval's command line with this class registered
    from lm_eval.__main__ import cli_evaluate

    sys.argv[0] = "lm_eval"
    cli_evaluate()
