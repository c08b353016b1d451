"""The rest of a vLLM user's offline API (issue 39): FlexibleArgumentParser, cleanup_dist_env_and_memory,
LLM(generation_config=...), best_of refused with V1's advice, LLM(seed=) seeding random and numpy,
LLM.get_metrics()."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from minipaged import LLM, SamplingParams
from minipaged.generation_config import read_generation_config


def test_flexible_argument_parser_takes_underscores_and_feeds_llm():
    from minipaged.engine_args import EngineArgs
    from minipaged.utils import FlexibleArgumentParser

    p = FlexibleArgumentParser()
    EngineArgs.add_cli_args(p)
    args = vars(p.parse_args(["--max_model_len=256", "--block_size", "8"]))
    assert args["max_model_len"] == 256 and args["block_size"] == 8


def test_cleanup_dist_env_and_memory_runs():
    from minipaged.distributed import cleanup_dist_env_and_memory

    assert cleanup_dist_env_and_memory() is None
    assert cleanup_dist_env_and_memory(shutdown_ray=True) is None


def test_best_of_is_refused_with_what_to_use_instead():
    with pytest.raises(ValueError, match="removed in vLLM V1.*n=4.*cumulative_logprob"):
        SamplingParams(best_of=4)
    assert SamplingParams(n=2, best_of=2).n == 2  # equal to n means nothing extra: taken


def test_generation_config_sources(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7, "repetition_penalty": 1.1, "bos_token_id": 1}))
    want = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 7, "repetition_penalty": 1.1}
    assert read_generation_config("auto", tmp_path) == want
    assert read_generation_config(tmp_path, None) == want
    assert read_generation_config(tmp_path / "generation_config.json", None) == want
    assert read_generation_config("vllm", tmp_path) == {}
    assert read_generation_config("auto", tmp_path / "model.gguf") == want  # the file beside a model file
    assert read_generation_config("auto", tmp_path / "nothing" / "x.gguf") == {}
    with pytest.raises(ValueError, match="no generation_config.json"):
        read_generation_config(tmp_path / "nothing", None)
    (tmp_path / "greedy.json").write_text(json.dumps({"do_sample": False}))
    assert read_generation_config(tmp_path / "greedy.json", None) == {"temperature": 0.0}


def test_llm_defaults_from_the_model_folder(tiny_hf_dir, tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_hf_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    llm = LLM(str(folder))
    sp = llm.get_default_sampling_params()
    assert sp.temperature == 0.0 and sp.max_tokens == 3
    out = llm.generate("hello")[0].outputs[0]  # no params: the model's own settings
    assert len(out.token_ids) <= 3
    plain = LLM(str(folder), generation_config="vllm").get_default_sampling_params()
    assert plain.temperature == SamplingParams().temperature and plain.max_tokens == SamplingParams().max_tokens


def test_seed_seeds_python_random_and_numpy_too(tiny_model):
    model, tok = tiny_model
    LLM(model, tok, seed=7, num_blocks=16, block_size=4)
    first = (random.random(), float(np.random.rand()))
    LLM(model, tok, seed=7, num_blocks=16, block_size=4)
    assert (random.random(), float(np.random.rand())) == first


def test_get_metrics_counts_what_ran(tiny_model):
    from minipaged.metrics_reader import Counter, Gauge

    model, tok = tiny_model
    llm = LLM(model, tok, num_blocks=32, block_size=4)
    llm.generate(["hello", "the cat"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    metrics = {m.name: m for m in llm.get_metrics() if not m.labels}
    assert isinstance(metrics["vllm:generation_tokens"], Counter) and metrics["vllm:generation_tokens"].value == 8
    assert metrics["vllm:prompt_tokens"].value > 0
    assert isinstance(metrics["vllm:num_requests_running"], Gauge) and metrics["vllm:num_requests_running"].value == 0
