"""``python -m minipaged.bench [kernels] ...`` (also ``minipaged bench``)."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "kernels":
        from .kernels import main as kernels_main

        return kernels_main(argv[1:]) or 0
    from .serving import main as serving_main

    return serving_main(argv)


if __name__ == "__main__":
    sys.exit(main())
