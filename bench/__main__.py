"""``python -m bench [--quick]``: every benchmark, plots and summary.json (see bench/run.py)."""

import sys

from .run import main

sys.exit(main())
