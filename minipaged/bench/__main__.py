"""``python -m minipaged.bench [SUB] ...``: the same commands as ``minipaged bench``."""
from __future__ import annotations

import sys

from .commands import main

if __name__ == "__main__":
    sys.exit(main())
