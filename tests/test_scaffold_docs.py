"""docs/recipes.md is generated from the signatures and docstrings: it must list every field and be current."""

from pathlib import Path

import pytest

from mixerzoo.scaffold import recipe_reference as rr

REPO = Path(__file__).resolve().parents[1]
REGENERATE = "regenerate it: python -m mixerzoo.scaffold.recipe_reference > docs/recipes.md"


def test_parse_args_section():
    doc = """Summary.

    Args:
        alpha: first line
            continued here.

            A second paragraph that is left out.
        beta, gamma: shared ``code`` and :class:`~pkg.mod.Thing`. Default: ``3``.
        delta: last | one.

    Returns:
        nothing: not an argument.
    """
    assert rr.parse_args_section(doc) == {"alpha": "first line continued here.",
                                          "beta": "shared `code` and `Thing`.", "gamma": "shared `code` and `Thing`.",
                                          "delta": "last \\| one."}


def test_recipes_reference_is_current():
    doc = (REPO / "docs" / "recipes.md").read_text()
    parts = rr.sections()
    for key in ("top-level", "model", "mixers", "data-recall", "data-text", "throughput"):
        assert parts[key] in doc, f"docs/recipes.md is stale in its {key} table; {REGENERATE}"
    # Lightning's own texts and types depend on its version: require the fields, not the exact words
    for key in ("trainer", "checkpoint"):
        for row in parts[key].splitlines()[2:]:
            assert row.split(" | ")[0] + " |" in doc, f"docs/recipes.md lacks {row.split(' | ')[0]}; {REGENERATE}"
    from mixerzoo.data import RecallDataModule, TextDataModule
    from mixerzoo.training import LMModule
    for prefix, cls in (("model", LMModule), ("data.init_args", RecallDataModule), ("data.init_args", TextDataModule)):
        for name in rr._params(cls.__init__):
            assert f"| `{prefix}.{name}` |" in doc


def test_a_model_field_without_description_is_reported(monkeypatch):
    fields = {k: v for k, v in rr._model_fields().items() if k != "norm_eps"}
    monkeypatch.setattr(rr, "_model_fields", lambda: fields)
    with pytest.raises(KeyError, match=r"\['norm_eps'\] have no description .*LMConfig"):
        rr.sections()
