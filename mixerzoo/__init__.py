"""mixerzoo: sequence mixers as plugins behind one protocol, composed into hybrid LMs and trained with Lightning."""

from .protocol import Mixer, MixerState, state_nbytes

__version__ = "0.1.0"
__all__ = ["Mixer", "MixerState", "state_nbytes", "__version__"]
