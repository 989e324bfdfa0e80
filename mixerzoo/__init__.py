"""mixerzoo: sequence mixers as plugins behind one protocol, composed into hybrid LMs and trained with Lightning."""

from .protocol import Mixer, MixerState, state_nbytes

__version__ = "0.1.0"
__all__ = ["Mixer", "MixerState", "state_nbytes", "from_pretrained", "__version__"]


def __getattr__(name: str):
    if name == "from_pretrained":  # lazily: mixerzoo.hub needs safetensors (and huggingface_hub for repo ids)
        from .hub import from_pretrained

        return from_pretrained
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
