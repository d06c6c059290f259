"""Served DDTree output == served plain decoding, through HTTP (the check is
tests/http_exactness.py, shared with tests/serve/test_serve_e2e.py). Exits 1 if any completion
differs.

    python bench/serve_exactness.py --out results/serve_exactness.json [-- <ddserve serve flags>]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from http_exactness import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
