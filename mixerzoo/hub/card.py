"""The model card (README.md) of an export: what the model is, the recipe, training tokens, metrics, usage."""

from __future__ import annotations

import os
from collections import Counter

import yaml

from .. import __version__
from .checkpoint import TrainedModel

__all__ = ["model_card"]


def _front_matter(trained: TrainedModel, plugins: dict, repo_id: str | None) -> str:
    mixers = sorted({s.mixer for s in trained.config.layer_specs()})
    meta = {
        "library_name": "mixerzoo",
        "pipeline_tag": "text-generation",
        "tags": ["mixerzoo", "custom_code", *[f"mixer:{m}" for m in mixers]],
    }
    if repo_id:
        meta["model_name"] = repo_id
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n"


def _human(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n:,} ({n / size:.3g}{unit})"
    return f"{n:,}"


def model_card(trained: TrainedModel, plugins: dict, n_params: int, repo_id: str | None, name: str) -> str:
    """Markdown with YAML front matter for the Hub.

    Args:
        trained: what was read from the checkpoint. plugins: ``{kind: {name: {distribution, version}}}``.
        n_params: parameter count (tied weights once). repo_id: the Hub id (for the usage snippet).
        name: the folder name (used in the snippet when there is no repo id).
    """
    cfg = trained.config
    specs = cfg.layer_specs()
    where = repo_id or f"path/to/{name}"
    pattern = ", ".join(f"{n}x {k}" for k, n in Counter(s.name for s in specs).items())
    layers = "\n".join(f"| {i} | {s.name} | {s.mixer} | `{s.options}` |" for i, s in enumerate(specs))
    requires = sorted({f"{m['distribution']}=={m['version']}" for kind in plugins.values() for m in kind.values()
                       if not str(m["distribution"]).startswith("(")})
    data = trained.recipe.get("data", {}).get("init_args", {})
    tokens = trained.training_tokens
    token_line = (f"{_human(tokens)} = {trained.batches} batches x batch_size {data.get('batch_size')} x seq_len "
                  f"{data.get('seq_len')} (per process; multiply by the number of processes for multi-device runs)"
                  if tokens is not None else "unknown (the checkpoint has no data hyper-parameters)")
    metrics = "\n".join(f"| {k} | {v:.6g} |" if isinstance(v, float) else f"| {k} | {v} |"
                        for k, v in trained.metrics.items())
    recipe = yaml.safe_dump(trained.recipe, sort_keys=False, default_flow_style=None, width=100)
    prompt = "Once upon a time" if trained.eos_id is not None else "1 2 3"
    return f"""{_front_matter(trained, plugins, repo_id)}
# {repo_id.rsplit("/", 1)[-1] if repo_id else name}

A causal language model built with mixerzoo (version {__version__}): {cfg.n_layers} layers of
width {cfg.d_model} ({pattern}), {n_params:,} parameters, vocabulary {cfg.vocab_size}.

| layer | name | mixer | options |
|---|---|---|---|
{layers}

Requires: `{' '.join(requires) or 'mixerzoo'}` (each mixer is a plugin found by name; a missing one is reported
with the distribution to install).

## Training

- Training tokens: {token_line}
- Optimizer steps: {trained.global_step}
- Tokenizer: {trained.tokenizer_source}
- Exported from: `{os.path.basename(trained.source)}`

### Recipe (the checkpoint's hyper-parameters; trainer settings are not stored in checkpoints)

```yaml
{recipe}```

## Metrics

| metric | value |
|---|---|
{metrics}

## Usage

With mixerzoo:

```python
import torch, mixerzoo
from mixerzoo.hub import load_tokenizer
from mixerzoo.model import generate

model = mixerzoo.from_pretrained("{where}")
tok = load_tokenizer("{where}")
ids = torch.tensor([tok.encode("{prompt}").ids])
print(tok.decode(generate(model, ids, max_new_tokens=32, temperature=0)[0].tolist()))
```

From the command line: `mixerzoo generate {where} --prompt "{prompt}" --max_new_tokens 32`

With transformers (the model code comes from the installed mixerzoo):

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("{where}", trust_remote_code=True)
tok = AutoTokenizer.from_pretrained("{where}", trust_remote_code=True)
out = model.generate(**tok("{prompt}", return_tensors="pt"), max_new_tokens=32, do_sample=False)
print(tok.decode(out[0]))
```

## Files

`config.json` (the backbone config under `lm_config`, plugins under `mixerzoo.plugins`), `model.safetensors`
(weights; no pickles), `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`, and
`configuration_mixerzoo.py` / `modeling_mixerzoo.py` (two-line shims importing mixerzoo, for `transformers`).
"""
