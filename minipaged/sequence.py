"""A request's state as the scheduler sees it: tokens, status, and how far its KV is computed.

The classes live in :mod:`minipaged.data` (the floor every part stands on); this module keeps
the names where the course first meets them: ``from minipaged.sequence import Sequence``.
"""
from __future__ import annotations

from .data import FinishReason, Sequence, SequenceStatus

__all__ = ["FinishReason", "Sequence", "SequenceStatus"]
