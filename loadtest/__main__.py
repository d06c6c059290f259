"""`python -m loadtest` is `python -m loadtest.run`."""

from __future__ import annotations

import sys

from loadtest.run import main

sys.exit(main())
