"""Lightning training: the causal-LM LightningModule and callbacks (no hand-written loop)."""

from .callbacks import StepProgressBar, ThroughputLogger
from .module import LMModule
from .parallel import FSDP2Strategy

__all__ = ["LMModule", "StepProgressBar", "ThroughputLogger", "FSDP2Strategy"]
