"""The backbone: embedding -> blocks (pre-norm, sequence mixer, channel mixer) -> final norm -> head."""

from .config import LMConfig, LayerSpec
from .generation import generate, generate_many
from .lm import Block, LanguageModel

__all__ = ["LMConfig", "LayerSpec", "LanguageModel", "Block", "generate", "generate_many"]
