"""Kernels, each beside a plain-torch reference. Backend choice lives in `backend.py`."""
