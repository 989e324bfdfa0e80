"""Every recipe under recipes/fla builds its model (on the meta device: no memory, no time)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from mixerzoo.model import LanguageModel, LMConfig

RECIPES = sorted((Path(__file__).resolve().parents[3] / "recipes" / "fla").glob("*.yaml"))
FIELDS = {f.name for f in dataclasses.fields(LMConfig)}


def test_recipes_exist():
    names = {p.stem for p in RECIPES}
    assert {"gdn-books", "gsa-books", "gdn-attention-3to1-books", "gdn-large", "gsa-large"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_builds(path):
    recipe = yaml.safe_load(path.read_text())
    model = {k: v for k, v in recipe["model"].items() if k in FIELDS}
    vocab = recipe["data"]["init_args"].get("vocab_size", 50257)
    with torch.device("meta"):
        lm = LanguageModel(LMConfig(vocab_size=vocab, **model))
    mixers = {type(b.mixer).__name__ for b in lm.blocks}
    assert mixers & {"GatedDeltaNet", "GatedSlotAttention"}
    lm.check_seq_len(recipe["data"]["init_args"]["seq_len"])
