"""Lightning training: the causal-LM LightningModule and callbacks (no hand-written loop)."""

from .callbacks import StepProgressBar, ThroughputLogger
from .module import LMModule

__all__ = ["LMModule", "StepProgressBar", "ThroughputLogger"]
