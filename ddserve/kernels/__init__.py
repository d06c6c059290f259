"""Kernels, each beside a plain-torch reference. Backend choice lives in `backend.py` (its
docstring says which kernel serves what); an engine's kernel configuration in `config.py`."""
