"""vLLM's ``vllm.utils`` helpers that user scripts import: ``FlexibleArgumentParser``."""
from __future__ import annotations

import argparse
import sys
from typing import Any


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` that takes ``--max_model_len`` as ``--max-model-len`` (a flag
    spelt with underscores is read with dashes, as vLLM's parser does), so the scripts written
    for vLLM's command line run unchanged. ``EngineArgs.add_cli_args(parser)`` adds the engine's flags."""

    def parse_args(self, args: Any = None, namespace: Any = None):  # type: ignore[override]
        args = list(sys.argv[1:] if args is None else args)
        return super().parse_args([_dashed(a) for a in args], namespace)

    def parse_known_args(self, args: Any = None, namespace: Any = None):  # type: ignore[override]
        args = None if args is None else [_dashed(a) for a in args]
        return super().parse_known_args(args, namespace)


def _dashed(arg: Any) -> Any:
    """``--a_b=c`` -> ``--a-b=c``; anything else as it is."""
    if not isinstance(arg, str) or not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


__all__ = ["FlexibleArgumentParser"]
