"""The facade vLLM users know: ``LLM(model=...).generate(prompts, sampling_params)``, ``chat`` and
``stream``, over one LLMEngine.

Owns loading a model by name or path and handing each call exactly its own outputs (the engine's
mailbox); the serving itself is the engine's (engine.py), the prompt forms inputs.py's.
"""
from __future__ import annotations

import os
import time
import warnings
from typing import Any, Iterator

import torch

from .config import split_kwargs
from .engine import LLMEngine
from .inputs import as_prompt_list, chat_prompts
from .output_processor import rejected_output
from .outputs import RequestOutput
from .sampling import SamplingParams
from .spec_decode import SpeculativeConfig


class _Mailbox:
    """One engine's outputs, kept for their owners: each ``LLM.stream`` and ``generate`` call claims
    its request ids, and whoever steps the engine files every output under its request's id, so
    streams and calls read in any order each get exactly their own (an output nobody claimed, from
    a request added straight to the engine, is dropped as ``step()``'s caller would)."""

    def __init__(self, engine: "LLMEngine") -> None:
        self.engine = engine
        self.boxes: dict[str, list[RequestOutput]] = {}

    def claim(self, request_id: str) -> None:
        self.boxes.setdefault(request_id, [])

    def release(self, request_id: str) -> None:
        self.boxes.pop(request_id, None)

    def take(self, request_id: str) -> list[RequestOutput]:
        box = self.boxes.get(request_id)
        if not box:
            return []
        out = list(box)
        box.clear()
        return out

    def pump(self) -> None:
        """One engine step; its outputs go to their owners' boxes."""
        for o in self.engine.step():
            box = self.boxes.get(o.request_id)
            if box is not None:
                box.append(o)


def _mailbox(engine: "LLMEngine") -> _Mailbox:
    """The engine's mailbox (one per engine, however many LLM objects or calls use it). It lives on
    the engine, so it goes with it: no module-level registry keeps an engine alive."""
    box = engine.__dict__.get("_mailbox")
    if box is None:
        box = engine.__dict__["_mailbox"] = _Mailbox(engine)
    return box


class LLM:
    """The facade vLLM users know: ``LLM(model=...).generate(prompts, sampling_params)``.

    ``model`` is None (the default SmolLM2-135M-Instruct), a path (a GGUF file or a local
    Hugging Face folder), or an already built model (then pass ``tokenizer`` too). A loaded
    model goes to ``device`` (default: CUDA when present, else the CPU) in ``dtype``.
    Every other keyword is an EngineConfig setting (``block_size``, ``kv_cache_bytes``, ...) or
    a part (``allocator_cls``, ``block_table_cls``, ``scheduler_cls``, ``attention``); an unknown
    one is a TypeError naming the nearest valid one.
    """

    def __init__(self, model: Any = None, tokenizer: Any = None, device: str | torch.device | None = None,
                 dtype: torch.dtype | str = "auto", seed: int | None = None, generation_config: Any = "auto",
                 **kwargs: Any) -> None:
        from .dtypes import resolve_dtype
        from .engine_args import NO_EFFECT, load_tokenizer

        for name in [k for k in kwargs if k in NO_EFFECT]:  # vLLM settings that mean nothing here
            value = kwargs.pop(name)
            if NO_EFFECT[name] and value not in NO_EFFECT[name]:
                raise ValueError(f"LLM({name}={value!r}) is unsupported by minipaged (no pipeline parallelism, no CUDA graphs); leave it out")
        from .generation_config import read_generation_config

        self.generation_defaults = read_generation_config(generation_config, model)  # the model's sampling settings
        config, parts = split_kwargs(kwargs)  # before loading anything: a typo costs no load time
        SpeculativeConfig.from_dict(config.speculative_config)  # so does a bad speculative_config
        dtype = resolve_dtype(dtype)  # vLLM's names ("float32", "half", "auto": float32) or a torch dtype
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = load_tokenizer(tokenizer)  # a local folder or GGUF file; a Hub name says so now
        if model is None or isinstance(model, (str, os.PathLike)):
            from .model import load_model

            # A GPU when there is one (Colab's GPU runtime), else the CPU; fp32 unless asked.
            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            t = time.perf_counter()
            model, loaded_tok = load_model(model, dtype=dtype, device=device)
            self.load_seconds = time.perf_counter() - t
            tokenizer = tokenizer or loaded_tok
        if seed is not None:  # vLLM's seed: unseeded sampled requests repeat from run to run
            import random

            import numpy as np

            torch.manual_seed(seed)
            random.seed(seed)  # vLLM seeds Python's and numpy's generators too
            np.random.seed(seed % 2**32)
        self.engine = LLMEngine(model, tokenizer, config, parts)

    @property
    def llm_engine(self) -> "LLMEngine":
        """The engine (vLLM's name for it)."""
        return self.engine

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters ``generate`` and ``chat`` use when given none: SamplingParams'
        defaults, with the model's generation_config.json over them (see minipaged.generation_config)."""
        return SamplingParams(**self.generation_defaults)

    def get_metrics(self) -> list:
        """vLLM's ``LLM.get_metrics()``: the engine's counters and gauges so far, each with a
        ``name`` (vLLM's ``vllm:`` names), ``labels`` and ``value`` (see minipaged.metrics_reader)."""
        from .metrics_reader import engine_metrics

        return engine_metrics(self.engine)

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Any, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Serve all ``prompts`` together (continuous batching); outputs in the prompts' order.

        A prompt that is invalid or can never fit is not fatal: its output has
        ``finish_reason="rejected"``, its own request id, and ``error`` says why; the others are served.
        """
        prompts = as_prompt_list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts: give one, or one per prompt")
            params = list(sampling_params)
        else:
            if sampling_params is None and self.generation_defaults:  # the model's own settings
                sampling_params = self.get_default_sampling_params()
            params = [sampling_params] * len(prompts)  # None: the engine's default, cut to fit the context
        eng = self.engine
        mail = _mailbox(eng)
        ids: list[str | RequestOutput] = []
        mine: list[str] = []
        done: dict[str, RequestOutput] = {}
        try:
            self._add_all(prompts, params, ids, mine)
            self._wait(mine, done, use_tqdm)
        finally:
            for rid in mine:
                mail.release(rid)
                if rid not in done:  # interrupted (Ctrl-C, an error): do not leave them running unowned
                    eng.abort_request(rid)
        results = []
        for rid in ids:
            o = rid if isinstance(rid, RequestOutput) else done[rid]
            if o.finish_reason in ("rejected", "error") and not isinstance(rid, RequestOutput):
                warnings.warn(f"request {o.request_id} {o.finish_reason}: {o.error}", stacklevel=2)
            results.append(o)
        return results

    def _add_all(self, prompts: list, params: list, ids: list, mine: list) -> None:
        """Add each prompt; ``ids`` gets its request id in order (a refused one: its output, and a
        warning), ``mine`` the ids this call claimed in the mailbox."""
        eng = self.engine
        mail = _mailbox(eng)
        for prompt, p in zip(prompts, params):
            rid = eng.new_request_id()
            try:
                ids.append(eng.add_request(prompt, p, request_id=rid))
                mail.claim(rid)
                mine.append(rid)
            except (ValueError, TypeError) as e:
                warnings.warn(f"request {rid} rejected: {e}", stacklevel=3)
                ids.append(rejected_output(rid, eng.inputs.prompt_text(prompt), str(e)))

    def _wait(self, mine: list[str], done: dict[str, RequestOutput], use_tqdm: bool) -> None:
        """Step until this call's requests (``mine``) are done, each final output into ``done``;
        another stream's outputs wait in its box."""
        eng = self.engine
        mail = _mailbox(eng)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(mine), desc="generating", unit="req")
        try:
            while len(done) < len(mine):
                for rid in mine:
                    for o in mail.take(rid):
                        if o.finished and rid not in done:
                            done[rid] = o
                            if bar is not None:
                                bar.update(1)
                if len(done) == len(mine):
                    break
                if not eng.has_unfinished_requests():
                    raise RuntimeError(f"the engine has no unfinished requests, but {len(mine) - len(done)} of this call's never finished")
                mail.pump()
        finally:
            if bar is not None:
                bar.close()

    def beam_search(self, prompts: Any, params: "BeamSearchParams", use_tqdm: bool = False) -> list:
        """vLLM's offline beam search: per prompt a ``BeamSearchOutput`` whose ``sequences`` are the
        ``params.beam_width`` best hypotheses, best first (``tokens`` include the prompt's, ``text``
        is their text, ``cum_logprob`` the generated tokens' summed log-probability). All prompts'
        beams run together, sharing blocks (see minipaged.beam_search). A search that can never fit
        is not fatal: its output is empty, ``error`` says why, and the others are served."""
        from .beam_search import BeamSearchOutput, BeamSearchParams

        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a minipaged.BeamSearchParams, got {type(params).__name__}")
        params.validate(self.engine.config.max_num_seqs)
        prompts = as_prompt_list(prompts)
        eng = self.engine
        mail = _mailbox(eng)
        ids: list = []
        mine: list[str] = []
        done: dict[str, RequestOutput] = {}
        try:
            for prompt in prompts:
                rid = eng.add_beam_request(prompt, params)
                ids.append(rid)
                mail.claim(rid)
                mine.append(rid)
            self._wait(mine, done, use_tqdm)
        finally:
            for rid in mine:
                mail.release(rid)
                if rid not in done:
                    eng.abort_request(rid)
        results = []
        for rid in ids:
            o = done[rid]
            if o.finish_reason in ("rejected", "error"):
                warnings.warn(f"beam search {rid} {o.finish_reason}: {o.error}", stacklevel=2)
            results.append(BeamSearchOutput(list(getattr(o, "beam_sequences", [])), request_id=rid, error=o.error))
        return results

    def chat(self, messages: Any, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_content_format: str = "auto",
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts; the content a string or OpenAI's
        ``[{"type": "text", "text": ...}]`` parts) or a list of conversations, as vLLM's ``LLM.chat``:
        ``chat_template`` (a Jinja string) replaces the model's, ``add_generation_prompt`` opens the
        assistant's turn, ``continue_final_message`` continues the last (assistant) message,
        ``chat_template_kwargs`` are more variables for the template."""
        prompts = chat_prompts(messages, chat_template, add_generation_prompt, continue_final_message,
                               chat_template_content_format, chat_template_kwargs)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt: Any, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the answer's text piece by piece as tokens come (other requests may run too).

        Closing the generator early (``break``, ``close()``, or dropping it) aborts the request
        and frees its blocks. A stop string never appears in the pieces.
        """
        eng = self.engine
        mail = _mailbox(eng)
        rid = eng.add_request(prompt, sampling_params)
        mail.claim(rid)
        finished = False
        try:
            while True:
                outs = mail.take(rid)  # its own outputs only: the others' wait in their boxes
                if not outs:  # (another caller may have stepped the engine meanwhile and filled the box)
                    if not eng.has_unfinished_requests():
                        return
                    mail.pump()
                    continue
                for o in outs:
                    if o.finish_reason in ("rejected", "error"):
                        finished = True
                        raise ValueError(f"request {o.finish_reason}: {o.error}")
                    if o.delta_text:
                        yield o.delta_text
                    if o.finished:
                        finished = True
                        return
        finally:
            mail.release(rid)
            if not finished:
                eng.abort_request(rid)


