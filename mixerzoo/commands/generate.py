"""``mixerzoo generate CKPT_OR_DIR --prompt TEXT [--max_new_tokens --temperature --top_k --top_p --seed]``.

Streams the continuation to stdout as tokens are produced, carrying every mixer's state from step to step
(:func:`mixerzoo.model.generation.stream_tokens`: one prefill pass, then one-token steps; the prefix is never
recomputed), and reports tokens/s on stderr. The model comes from a Lightning checkpoint (tokenizer from the
checkpoint's data-module state), an exported folder, or a Hub repository id.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import IO

import torch

from . import CommandParser, add_option, resolve_device, user_errors

__all__ = ["main", "build_parser", "load_for_generation", "stream_text", "layer_summary"]


def layer_summary(config) -> str:
    """Which mixer each layer runs, layers with the same one grouped: ``0 swa; 1 attention`` or, after an
    override that swapped a layer name's mixer, ``0-29 tova (layer name attention)``."""
    groups: dict[str, list[int]] = {}
    for i, spec in enumerate(config.layer_specs()):
        label = spec.mixer if spec.mixer == spec.name else f"{spec.mixer} (layer name {spec.name})"
        groups.setdefault(label, []).append(i)

    def ranges(indices: list[int]) -> str:
        runs: list[list[int]] = []
        for i in indices:
            if runs and i == runs[-1][1] + 1:
                runs[-1][1] = i
            else:
                runs.append([i, i])
        return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)

    return "; ".join(f"{ranges(indices)} {label}" for label, indices in groups.items())


def load_for_generation(source: str, tokenizer: str | None = None, device: str | None = None,
                        dtype: str | None = None, mixers: dict | None = None):
    """``(model, tokenizer, eos_id)`` from any source :func:`mixerzoo.hub.load_model` opens (a ``.ckpt``, an
    export folder, a Hub repository id, a transformers folder or a ``.gguf`` file).

    Raises:
        FileNotFoundError, ConfigError, MissingPluginError, HubDownloadError: see :func:`mixerzoo.hub.load_model`.
    """
    from ..hub.source import load_model

    loaded = load_model(source, tokenizer=tokenizer, mixers=mixers, device=device, dtype=dtype)
    return loaded.model, loaded.tokenizer, loaded.eos_id


def stream_text(model, tokenizer, prompt_ids: list[int], out: IO[str], max_new_tokens: int = 64,
                temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                eos_id: int | None = None, seed: int | None = None) -> tuple[list[int], dict]:
    """Generate after ``prompt_ids`` and write the continuation's text to ``out`` as it is produced.

    Text is written once it decodes cleanly (a byte-level BPE may split a character over several tokens; the
    text appears when the character is complete). Returns ``(new token ids, timings)`` with timings in seconds:
    ``first_token_s`` (prefill + first step), ``total_s``, ``tokens_per_s`` (new tokens / total) and
    ``decode_tokens_per_s`` (tokens after the first / time after the first).
    """
    from ..model.generation import stream_tokens

    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    base = tokenizer.decode(prompt_ids, skip_special_tokens=False)

    def continuation() -> str:  # decode with the prompt, so that spacing and merges come out right
        text = tokenizer.decode(prompt_ids + new, skip_special_tokens=False)
        return text[len(base):] if text.startswith(base) else tokenizer.decode(new, skip_special_tokens=False)

    new: list[int] = []
    shown = 0
    start = time.perf_counter()
    first = None
    for tok in stream_tokens(model, ids, max_new_tokens, temperature, top_k, top_p, eos_id, generator):
        new.append(int(tok[0]))
        if first is None:
            first = time.perf_counter() - start
        text = continuation()
        if not text.endswith("\ufffd") and len(text) > shown:
            out.write(text[shown:])
            out.flush()
            shown = len(text)
    total = time.perf_counter() - start
    text = continuation()
    if len(text) > shown:
        out.write(text[shown:])
    out.flush()
    n = len(new)
    after = total - (first or 0.0)
    return new, {"first_token_s": first or 0.0, "total_s": total, "tokens_per_s": n / total if total > 0 else 0.0,
                 "decode_tokens_per_s": (n - 1) / after if n > 1 and after > 0 else 0.0}


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="mixerzoo generate", allow_abbrev=False,
        description="Generate text from a checkpoint, an exported folder or a Hub repository id, streaming tokens "
                    "to stdout (each step reuses the mixers' states) and reporting tokens/s on stderr.")
    p.add_argument("source", help="a Lightning .ckpt, a folder made by `mixerzoo export`/`import`, a Hub repo id, "
                                  "or a pretrained transformers folder / .gguf file")
    p.add_argument("--prompt", default="", help="the text to continue (default: start after end-of-text)")
    add_option(p, "--max_new_tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy; default 1.0")
    add_option(p, "--top_k", type=int, default=None, help="sample among the k most likely tokens")
    add_option(p, "--top_p", type=float, default=None, help="nucleus sampling: the smallest set with mass >= p")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampler (reproducible samples)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="compute dtype (default: as saved)")
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json to use instead of the model's")
    add_option(p, "--no_echo", action="store_true", help="do not print the prompt before the continuation")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as one user message in the model's chat template (imported chat models)")
    p.epilog = ("Change layers before generating with --model.mixers.NAME.KEY VALUE, as in `mixerzoo fit`, e.g. "
                "--model.mixers.attention.mixer tova --model.mixers.attention.multi_state 256")
    return p


def mixer_overrides(argv: list[str]) -> tuple[list[str], dict]:
    """Take ``--model.mixers.NAME.KEY VALUE`` out of ``argv``: ``(the rest, {NAME: {KEY: value}})``."""
    from ..model.config import apply_mixer_overrides, split_mixer_overrides

    rest, overrides, _ = split_mixer_overrides(argv)
    return rest, apply_mixer_overrides({}, overrides) if overrides else {}


def chat_prompt(template: str | None, prompt: str, bos_token: str | None = None) -> str:
    """``prompt`` as one user message rendered by the model's Jinja chat template with the generation prompt
    (rendered by transformers' ``apply_chat_template(..., add_generation_prompt=True)``; only the template and the
    bos token take part, so a placeholder tokenizer stands in for the real one).

    Raises:
        ConfigError: the model has no chat template.
    """
    from ..model.config import ConfigError

    if not template:
        raise ConfigError("--chat: this model has no chat template (tokenizer_config.json chat_template); drop --chat")
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    wrapper = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str('{"version": "1.0", "model": {"type": '
                                                                          '"WordLevel", "vocab": {}, "unk_token": ""}}'),
                                      chat_template=template, bos_token=bos_token)
    return wrapper.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)


def unknown_words(tokenizer, text: str, encoding) -> list[str]:
    """The words of ``text`` that ``tokenizer`` (a ``tokenizers.Tokenizer``) maps to its unknown token, in order,
    once each: a synthetic task's tokenizer (numbers ``0 .. V-1``) reads any other word as ``0``. [] for a
    tokenizer without an unknown token (byte-level BPE reads every text)."""
    unk = getattr(getattr(tokenizer, "model", None), "unk_token", None)
    unk_id = tokenizer.token_to_id(unk) if unk else None
    if unk_id is None:
        return []
    words = [text[a:b] for i, (a, b) in zip(encoding.ids, encoding.offsets) if i == unk_id and text[a:b] != unk]
    return list(dict.fromkeys(words))


def _vocabulary_hint(tokenizer) -> str:
    vocab = tokenizer.get_vocab()
    if vocab and all(t.isdigit() for t in vocab):
        return f" (this one's are the numbers 0 to {len(vocab) - 1}, space-separated)"
    return ""


def main(argv: list[str], out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """Run ``mixerzoo generate``; returns the exit status (2 for user errors)."""
    out, err = out or sys.stdout, err or sys.stderr
    status = [0]
    with user_errors(status):
        argv, mixers = mixer_overrides(list(argv))
        args = build_parser().parse_args(argv)
        from ..model.config import ConfigError

        if args.max_new_tokens < 1:
            raise ConfigError(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
        if args.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
        if args.top_p is not None and not 0 < args.top_p <= 1:
            raise ConfigError(f"--top_p must be in (0, 1], got {args.top_p}")
        device = resolve_device(args.device)
        t0 = time.perf_counter()
        from ..hub.source import load_model

        loaded = load_model(args.source, tokenizer=args.tokenizer, mixers=mixers, device=device, dtype=args.dtype)
        model, tok, eos_id = loaded.model, loaded.tokenizer, loaded.eos_id
        load_s = time.perf_counter() - t0
        print(f"[mixerzoo generate] layers: {layer_summary(model.config)}", file=err)
        err.flush()
        prompt = args.prompt
        if args.chat:
            prompt = chat_prompt(loaded.chat_template, prompt, loaded.trained.tokenizer_settings.get("bos_token"))
        encoding = tok.encode(prompt) if prompt else None
        prompt_ids = encoding.ids if encoding is not None else []
        unknown = unknown_words(tok, prompt, encoding) if encoding is not None else []
        if unknown:
            unk = tok.model.unk_token
            raise ConfigError(f"--prompt: {', '.join(repr(w) for w in unknown[:5])} "
                              f"{'is' if len(unknown) == 1 else 'are'} not in the tokenizer's vocabulary of "
                              f"{tok.get_vocab_size()} tokens and would be read as the unknown token {unk!r}; "
                              f"use only its tokens{_vocabulary_hint(tok)}")
        if not prompt_ids:
            if eos_id is None:
                raise ConfigError("--prompt is empty and the tokenizer has no end-of-text token to start from; give "
                                  "a prompt")
            prompt_ids = [eos_id]
        from ..hub.source import warn_if_beyond_context

        warn_if_beyond_context(loaded.trained, len(prompt_ids) + args.max_new_tokens, "prompt + --max_new_tokens")
        if prompt and not args.no_echo:
            out.write(tok.decode(prompt_ids, skip_special_tokens=False))
        from ..model.lm import mixer_errors_named

        with mixer_errors_named(model):
            new, t = stream_text(model, tok, prompt_ids, out, args.max_new_tokens, args.temperature, args.top_k,
                                 args.top_p, eos_id, args.seed)
        out.write("\n")
        out.flush()
        state = getattr(model, "_last_state_bytes", None)
        print(f"[mixerzoo generate] {len(prompt_ids)} prompt + {len(new)} new tokens on {device}: "
              f"{t['tokens_per_s']:.1f} tokens/s overall, {t['decode_tokens_per_s']:.1f} tokens/s after the first "
              f"(first token {t['first_token_s'] * 1e3:.0f} ms; model loaded in {load_s:.1f} s"
              + (f"; state {state / 2**10:.1f} KiB" if state else "") + ")", file=err)
    return status[0]
