"""Long-context evaluation of any checkpoint through the Mixer protocol (``mixerzoo evaluate``).

A file per idea: :mod:`.models` (loading, the streaming loop), :mod:`.documents` (long documents, held-out split),
:mod:`.per_position` (loss by position, KVM paper fig. 3), :mod:`.recall` (MQAR, basic/positional ICR),
:mod:`.niah` (needle in a haystack over book text), :mod:`.cost` (speed, memory, state bytes), :mod:`.report`
(results.json, report.md, PNGs) and :mod:`.runner` (everything with progress bars). No code here knows a mechanism.
"""

from .models import EvalModel as EvalModel
from .models import load_eval_model as load_eval_model
from .models import stream_logits as stream_logits
from .runner import EvalSettings as EvalSettings
from .runner import run_evaluation as run_evaluation
from .runner import write_outputs as write_outputs

__all__ = ["EvalModel", "load_eval_model", "stream_logits", "EvalSettings", "run_evaluation", "write_outputs"]
