"""What can go wrong when loading a model, as exceptions a learner can act on.

One base class to catch (``ModelLoadError``); the subclasses also derive from the built-in
error they resemble, so ``except FileNotFoundError`` works too.
"""
from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says which file and what to do."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """No model where we looked (the message lists where)."""


class CorruptModelError(ModelLoadError, ValueError):
    """A model file exists but cannot be read (truncated download, wrong format)."""


class UnsupportedModelError(ModelLoadError, ValueError):
    """A readable model of an architecture or feature minipaged does not implement."""
