"""engine.py reads in one sitting: input processing, output processing and the ``LLM`` facade
live in their own modules (inputs.py, output_processor.py, llm.py, as vLLM V1 keeps its
``Processor`` and ``OutputProcessor`` apart from the engine core), the ``LLMEngine`` class fits
450 lines, and no function in those modules (nor in engine_stats.py and sampling.py) is over 60
lines (a function fits a screen).

Sizes are read from the source with ``ast``: a function's lines run from its first decorator to
its last line, docstring and comments included.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "minipaged"
MODULES = ("engine.py", "inputs.py", "output_processor.py", "llm.py", "engine_stats.py", "sampling.py")
MAX_CLASS_LINES = 450
MAX_FUNCTION_LINES = 60


def _span(node: ast.AST) -> int:
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return node.end_lineno - first + 1


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """Every function or method (nested ones too) over ``limit`` lines -> its length."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = f"{prefix}{getattr(child, 'name', '')}"
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and _span(child) > limit:
                out[name] = _span(child)
            visit(child, f"{name}." if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) else prefix)

    visit(ast.parse(source), "")
    return out


def class_lines(source: str, name: str) -> int:
    found = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == name]
    assert len(found) == 1, f"one class {name} expected, found {len(found)}"
    return _span(found[0])


def test_the_engine_class_fits_a_sitting():
    n = class_lines((ROOT / "engine.py").read_text(), "LLMEngine")
    assert n <= MAX_CLASS_LINES, f"LLMEngine is {n} lines (at most {MAX_CLASS_LINES}): move what is not the loop out"


def test_no_function_in_the_engine_modules_is_over_a_screen():
    too_long = {f"{m}:{name}": n for m in MODULES for name, n in long_functions((ROOT / m).read_text()).items()}
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): {too_long}"


def test_the_size_checks_catch_what_they_look_for():
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    source = f"class C:\n    @staticmethod\n    def long():\n{body}\n\n    def short():\n        pass\n"
    # the decorator line counts: 1 + 1 + 60 = 62 lines
    assert long_functions(source) == {"C.long": MAX_FUNCTION_LINES + 2}
    assert long_functions(source, limit=MAX_FUNCTION_LINES + 2) == {}
    assert class_lines(source, "C") == MAX_FUNCTION_LINES + 6


def test_each_part_of_serving_lives_in_its_module():
    import minipaged
    from minipaged import engine, inputs, llm, output_processor

    assert minipaged.LLM is llm.LLM and minipaged.LLMEngine is engine.LLMEngine
    from minipaged.engine import LLM  # code written before the facade moved keeps working

    assert LLM is llm.LLM
    defined = {n.name for n in ast.parse((ROOT / "engine.py").read_text()).body
               if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    assert not defined & {"LLM", "_Mailbox", "_KeepSpecialTokens", "_check_encodable", "_is_chat"}, defined
    where = {"InputProcessor": inputs, "check_encodable": inputs, "as_prompt_list": inputs, "request_output": output_processor,
             "stop_reason": output_processor, "text_tokenizer": output_processor, "_Mailbox": llm}
    for name, module in where.items():
        assert getattr(module, name).__module__ == module.__name__, name


def test_input_processing_stands_alone_without_an_engine():
    import pytest

    from minipaged.inputs import InputProcessor, fit_max_tokens
    from minipaged.sampling import SamplingParams

    p = InputProcessor(None, vocab_size=10)
    assert p.encode_prompt([1, 2]) == [1, 2] and p.encode_prompt({"prompt_token_ids": [3]}) == [3]
    with pytest.raises(ValueError, match="no tokenizer"):
        p.encode_prompt("hi")
    with pytest.raises(ValueError, match=r"token ids must be in 0..9"):
        p.encode_prompt([10])
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        p.check_params(SamplingParams(stop=["x"]), max_num_seqs=4)
    sp = SamplingParams(max_tokens=None)
    fitted = fit_max_tokens(sp, True, 3, 8)
    assert fitted.max_tokens == 5 and sp.max_tokens is None  # the caller's params are left as they were
    with pytest.raises(ValueError, match="does not fit"):
        fit_max_tokens(SamplingParams(max_tokens=6), True, 3, 8)
    assert fit_max_tokens(SamplingParams(max_tokens=6), False, 3, 8).max_tokens == 5  # the engine's default: cut
