"""Code for one device only, chosen by the layers (``gdn/layer.py``, ``gsa/layer.py``) by device:
:mod:`mixerzoo_fla.backends.fla`, flash-linear-attention's Triton kernels on CUDA. Nothing here is imported by the
``naive`` references, and nothing here imports ``fla`` until a CUDA forward needs it."""
