"""``StructuredOutputsParams``: what constrains the text to a language, as vLLM spells it::

    from minipaged.sampling_params import SamplingParams, StructuredOutputsParams

    SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))

Exactly one of the five forms is given:

- ``json``: a JSON schema (a dict, or its text): the output is one JSON value that satisfies it;
- ``json_object=True``: any JSON object (OpenAI's ``response_format={"type": "json_object"}``);
- ``regex``: the whole output matches this regular expression;
- ``choice``: the output is exactly one of these strings;
- ``grammar``: the output is a sentence of this EBNF grammar (xgrammar's GBNF dialect, whose
  start rule is ``root``).

The form is checked when the params are made (``ValueError`` naming the error): a schema, regex
or grammar xgrammar cannot parse never reaches an engine. The engine compiles it against its
tokenizer when the request is added (minipaged.structured_output), and from then on the grammar
masks every token it would refuse.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, fields
from typing import Any

FORMS = ("json", "json_object", "regex", "choice", "grammar")


def clean_backend_error(err: BaseException) -> str:
    """xgrammar's message without its C++ preamble (``[12:00:00] /project/cpp/x.cc:94: ``)."""
    text = str(err).strip()
    return re.sub(r"^\[[0-9:]+\]\s+\S+:\d+:\s*", "", text).strip()


@dataclass
class StructuredOutputsParams:
    """What the output must be: exactly one of ``json``, ``json_object``, ``regex``, ``choice``
    or ``grammar`` (see the module docstring). ``disable_any_whitespace=True`` makes JSON compact
    (no whitespace between tokens of the JSON syntax), as in vLLM."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [f for f in FORMS if getattr(self, f) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams takes exactly one of json (a schema), json_object=True, regex, choice "
                f"(a list of strings) or grammar (EBNF); got {given or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"StructuredOutputsParams(json=...) takes a JSON schema as a dict or a string, got {type(self.json).__name__}")
        if self.json_object not in (None, True, False):
            raise ValueError(f"StructuredOutputsParams(json_object=...) takes True, got {self.json_object!r}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"StructuredOutputsParams(regex=...) takes a non-empty regular expression string, got {self.regex!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(f"StructuredOutputsParams(grammar=...) takes EBNF text with a root rule, got {self.grammar!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice \
                    or any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError(f"StructuredOutputsParams(choice=...) takes a non-empty list of non-empty strings, got {self.choice!r}")
            self.choice = list(self.choice)
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"disable_any_whitespace must be True or False, got {self.disable_any_whitespace!r}")
        check_grammar(*self.key)

    @property
    def kind(self) -> str:
        """Which form was given: one of FORMS."""
        return next(f for f in FORMS if getattr(self, f) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """(kind, its text, compact JSON): what decides the compiled grammar (the cache's key)."""
        kind = self.kind
        if kind == "json":
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
        elif kind == "json_object":
            text = ""
        elif kind == "choice":
            text = choice_grammar(self.choice)
            kind = "grammar"
        else:
            text = getattr(self, kind)
        return kind, text, self.disable_any_whitespace

    @classmethod
    def from_dict(cls, d: Any) -> "StructuredOutputsParams":
        """The HTTP body's ``structured_outputs`` object (vLLM's extra field); unknown keys refused."""
        if isinstance(d, cls):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"structured_outputs must be an object like {{\"choice\": [\"yes\", \"no\"]}}, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"structured_outputs has unknown key(s) {unknown}; it takes {sorted(known)}")
        return cls(**d)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices`` (each a quoted, escaped literal)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@functools.lru_cache(maxsize=256)
def check_grammar(kind: str, text: str, compact: bool) -> None:
    """Parse the form with xgrammar (no tokenizer needed); ValueError naming xgrammar's error."""
    builder = _backend_grammar
    try:
        builder(kind, text, compact)
    except ImportError as e:
        raise ImportError(f"structured outputs need xgrammar: pip install xgrammar ({e})") from e
    except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError with the parser's message
        what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "json_object": "JSON grammar"}[kind]
        raise ValueError(f"invalid {what} for structured outputs: {clean_backend_error(e)}") from None


def _backend_grammar(kind: str, text: str, compact: bool):
    """The xgrammar Grammar of one form (the tokenizer-free half of compiling it)."""
    from .optional import require

    xgr = require("xgrammar")

    if kind == "json":
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"the schema is not JSON: {e}") from None
        return xgr.Grammar.from_json_schema(text, any_whitespace=not compact)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=not compact)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    return xgr.Grammar.from_ebnf(text)


# GuidedDecodingParams is vLLM's older name for the same thing (before 0.10.2)
GuidedDecodingParams = StructuredOutputsParams

__all__ = ["StructuredOutputsParams", "GuidedDecodingParams", "FORMS", "choice_grammar", "check_grammar", "clean_backend_error"]
