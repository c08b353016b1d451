"""vLLM users' code runs unchanged: SamplingParams' fields, logprobs, penalties, outputs, signatures.

The penalties are checked by hand on a five-token vocabulary against vLLM's definitions
(vllm/model_executor/layers/utils.py ``apply_penalties``: the repetition penalty divides a
positive logit and multiplies a negative one, for tokens in the prompt or the output; the
frequency penalty subtracts ``f * count`` and the presence penalty ``p`` once, for tokens in the
output). Logprobs are checked against transformers' logits through a plain ``log_softmax``.
vLLM's offline examples (basic, chat, prefix caching, the LLMEngine loop) are restated below in
our own words with ``from minipaged import ...`` in place of ``from vllm import ...``.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import math

import pytest
import torch

import minipaged.sampling as sampling_module
from minipaged.sampling import (UNSUPPORTED, Logprob, Sampler, SamplingParams, UnsupportedSamplingParam, apply_min_p,
                                apply_penalties, prompt_logprobs_of)

# -- SamplingParams -------------------------------------------------------------------------
VLLM_FIELDS = dict(n=1, presence_penalty=0.1, frequency_penalty=0.2, repetition_penalty=1.1, temperature=0.7, top_p=0.9,
                   top_k=20, min_p=0.05, seed=3, stop=["\n"], stop_token_ids=[7], ignore_eos=False, max_tokens=None,
                   min_tokens=2, logprobs=1, prompt_logprobs=1, detokenize=True, skip_special_tokens=False,
                   spaces_between_special_tokens=True, include_stop_str_in_output=True, logit_bias={5: 1.5},
                   allowed_token_ids=[1, 2, 3])


def test_sampling_params_takes_vllms_fields():
    sp = SamplingParams(**VLLM_FIELDS)
    for k, v in VLLM_FIELDS.items():
        assert getattr(sp, k) == v, k
    assert sp.max_tokens_for(10, 100) == 90  # None: to the end of the context
    assert SamplingParams(max_tokens=5).max_tokens_for(10, 100) == 5
    # vLLM's defaults spelled out (what vLLM scripts often do) are fine
    SamplingParams(best_of=None, logits_processors=None, truncate_prompt_tokens=None, guided_decoding=None)
    assert sp.clone() == sp and sp.clone() is not sp


@pytest.mark.parametrize("field, value", [("bad_words", ["x"]), ("logits_processors", [print]), ("best_of", 4),
                                          ("truncate_prompt_tokens", 8), ("guided_decoding", {"json": {}}),
                                          ("spaces_between_special_tokens", False), ("detokenize", False)])
def test_a_vllm_field_minipaged_lacks_says_unsupported(field, value):
    with pytest.raises(UnsupportedSamplingParam, match="unsupported"):
        SamplingParams(**{field: value})
    assert issubclass(UnsupportedSamplingParam, ValueError)


def test_a_misspelt_field_is_a_typeerror_naming_the_nearest():
    with pytest.raises(TypeError, match="did you mean 'presence_penalty'"):
        SamplingParams(presense_penalty=1.0)


def test_setting_a_field_after_construction_takes_effect_and_is_checked_by_validate():
    sp = SamplingParams(temperature=0)
    sp.repetition_penalty = 5.0  # as vLLM scripts do
    assert sp.repetition_penalty == 5.0 and sp.changes_logits
    sp.repetition_penalty = -1.0  # taken here; validate() (add_request runs it) refuses it
    with pytest.raises(ValueError, match="repetition_penalty"):
        sp.validate()
    sp.repetition_penalty = 5.0
    with pytest.raises(AttributeError, match="did you mean 'repetition_penalty'"):
        sp.repitition_penalty = 2.0
    sp.bad_words = ["x"]
    with pytest.raises(UnsupportedSamplingParam):
        sp.validate()
    sp.bad_words = None
    sp.stop = "END"
    assert sp.stop == ["END"]
    sp.validate()
    assert dataclasses.replace(sp, seed=4).seed == 4


def test_sampling_params_is_one_dataclass():
    """Its __init__ is the one @dataclass wrote (nothing replaces it after the class), vLLM's
    unsupported fields are fields at their "not used" defaults, and setting a field checks nothing."""
    assert SamplingParams.__init__.__qualname__ == "SamplingParams.__init__"
    assert "self" in inspect.signature(SamplingParams.__init__).parameters
    names = {f.name: f for f in dataclasses.fields(SamplingParams)}
    for name, unused in UNSUPPORTED.items():
        assert name in names and names[name].default == unused[0] and names[name].kw_only, name
    tree = ast.parse(inspect.getsource(sampling_module))
    patched = [n.lineno for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AugAssign))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
               if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "SamplingParams"]
    assert not patched, f"sampling.py assigns to SamplingParams after the class (lines {patched})"
    sp = SamplingParams()
    sp.temperature = -3.0  # no check on assignment
    assert sp.temperature == -3.0
    assert SamplingParams(3, 0.5).max_tokens == 3  # positional calls keep their meaning


@pytest.mark.parametrize("kw", [dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                                dict(min_p=1.5), dict(min_tokens=-1), dict(min_tokens=20, max_tokens=10),
                                dict(logprobs=-1), dict(logprobs=21), dict(prompt_logprobs=1.0), dict(logit_bias={"a": 1}),
                                dict(logit_bias={1: float("nan")}), dict(allowed_token_ids=[]), dict(max_tokens=0)])
def test_out_of_range_values_are_refused(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplingParams(**kw)


# -- penalties, by hand on a five-token vocabulary ---------------------------------------
LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
PROMPT, OUTPUT = [0], [3, 3, 1]


def test_penalties_match_vllms_definitions_by_hand():
    # repetition 2 on the seen tokens {0, 1, 3}: 2 -> 1, -1 -> -2, 3 -> 1.5 (2 and 4 unseen: unchanged)
    assert apply_penalties(LOGITS, PROMPT, OUTPUT, 0, 0, 2.0).tolist() == [1.0, -2.0, 0.5, 1.5, -2.0]
    # frequency 0.5 counts output tokens only: token 3 twice (-1), token 1 once (-0.5); the prompt's 0 is free
    assert apply_penalties(LOGITS, PROMPT, OUTPUT, 0, 0.5, 1.0).tolist() == [2.0, -1.5, 0.5, 2.0, -2.0]
    # presence 0.25: once per token present in the output, however often
    assert apply_penalties(LOGITS, PROMPT, OUTPUT, 0.25, 0, 1.0).tolist() == [2.0, -1.25, 0.5, 2.75, -2.0]
    # all three, in vLLM's order (repetition, then frequency, then presence)
    assert apply_penalties(LOGITS, PROMPT, OUTPUT, 0.25, 0.5, 2.0).tolist() == [1.0, -2.75, 0.5, 0.25, -2.0]
    assert torch.equal(LOGITS, torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0]))  # the input is not changed


class _Seq:
    def __init__(self, prompt, output, eos=()):
        self.prompt_token_ids, self.output_token_ids, self.eos_token_ids = list(prompt), list(output), tuple(eos)


def test_the_sampler_applies_penalties_bias_and_masks_before_choosing():
    s = Sampler()
    cases = {
        "plain": (SamplingParams(temperature=0), 3),
        "penalised": (SamplingParams(temperature=0, presence_penalty=0.25, frequency_penalty=0.5, repetition_penalty=2.0), 0),
        "bias": (SamplingParams(temperature=0, logit_bias={4: 6.0}), 4),  # -2 + 6 = 4 > 3
        "allowed": (SamplingParams(temperature=0, allowed_token_ids=[1, 2]), 2),
        "min_tokens": (SamplingParams(temperature=0, min_tokens=5, stop_token_ids=[0]), 3),
    }
    for name, (p, _) in cases.items():
        s.add(name, p, seq=_Seq(PROMPT, OUTPUT, eos=[3]))
    got = s(LOGITS.repeat(len(cases), 1), list(cases), [p for p, _ in cases.values()])
    # min_tokens=5 with 3 out: EOS (3) and the stop token 0 are masked, so 2 (0.5) wins
    want = [w for _, w in cases.values()]
    want[-1] = 2
    assert got == want, dict(zip(cases, got))


def test_without_a_sequence_the_sampler_counts_the_tokens_it_chose():
    s = Sampler()
    p = SamplingParams(temperature=0, frequency_penalty=2.0)
    s.add("a", p, prompt_token_ids=[0])
    picks = [s(LOGITS[None], ["a"], [p])[0] for _ in range(3)]
    # 3 (3.0); then 3 - 2 = 1 < 2: token 0; then 0 is at 0, 3 at 1: token 3 again
    assert picks == [3, 0, 3]


def test_min_p_keeps_tokens_at_least_min_p_times_the_top():
    probs = torch.softmax(LOGITS, -1)
    kept = torch.isfinite(apply_min_p(LOGITS, 0.3)).tolist()
    assert kept == [bool(q >= 0.3 * probs.max()) for q in probs] and kept == [True, False, False, True, False]
    assert torch.equal(apply_min_p(LOGITS, 0.0), LOGITS)


def test_sampler_logprobs_are_the_raw_log_softmax_with_ranks():
    s = Sampler()
    s.decode = lambda t: f"<{t}>"
    p = SamplingParams(temperature=0, logprobs=2, repetition_penalty=3.0)  # penalties change the choice, not the logprobs
    s.add("a", p, seq=_Seq([3], []))
    tok = s(LOGITS[None], ["a"], [p])[0]
    lps = torch.log_softmax(LOGITS, -1)
    assert tok == 0  # 3 was in the prompt: 3 / 3 = 1 < 2
    [entry] = s.logprobs("a")
    assert list(entry) == [0, 3]  # the chosen token first, then the top 2 by rank
    assert entry[0] == Logprob(pytest.approx(float(lps[0])), 2, "<0>") and entry[3] == Logprob(pytest.approx(float(lps[3])), 1, "<3>")
    assert s.cumulative_logprob("a") == pytest.approx(float(lps[0]))
    s2 = Sampler()
    p0 = SamplingParams(temperature=0, logprobs=0)
    s2.add("b", p0)
    s2(LOGITS[None], ["b"], [p0])
    assert list(s2.logprobs("b")[0]) == [3]  # logprobs=0: the chosen token only


def test_prompt_logprobs_shape():
    logits = torch.randn(4, 5)
    out = prompt_logprobs_of(logits, [1, 2, 3, 4], 1)
    lps = torch.log_softmax(logits, -1)
    assert out[0] is None and len(out) == 4
    for i in range(1, 4):
        tid = [1, 2, 3, 4][i]
        assert next(iter(out[i])) == tid and out[i][tid].logprob == pytest.approx(float(lps[i - 1, tid]))
        assert min(x.rank for x in out[i].values()) == 1


# -- the OpenAI server, in process, through the official openai client ---------------------
@pytest.fixture(scope="module")
def app_client(tiny_model):
    """The app over a tiny random model, and an ``openai.OpenAI`` client that talks to it in process."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from minipaged.engine import LLMEngine
    from minipaged.server.app import ServerConfig, create_app

    model, tok = tiny_model
    app = create_app(lambda: LLMEngine(model, tok, num_blocks=64, block_size=4, max_num_seqs=4),
                     ServerConfig(model_names=("tiny", "org/tiny")))
    with TestClient(app) as http:
        yield app, http, openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)


def test_server_ignores_unknown_fields_and_logs_each_once(app_client, caplog):
    from minipaged.server import protocol as P

    _, _, client = app_client
    P._LOGGED_UNKNOWN.discard("store")
    with caplog.at_level("WARNING", logger="minipaged.server"):
        for _ in range(2):  # what guidellm, aiperf and the openai SDK's newer fields send
            r = client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0,
                                          extra_body={"store": False, "metadata": {"a": "b"}, "service_tier": "auto"})
            assert r.choices[0].finish_reason == "length"
    assert sum("'store'" in rec.getMessage() for rec in caplog.records) == 1


def test_server_max_completion_tokens_on_both_endpoints(app_client):
    _, _, client = app_client
    r = client.completions.create(model="tiny", prompt="Hi", temperature=0, extra_body={"max_completion_tokens": 3,
                                                                                         "ignore_eos": True})
    assert r.usage.completion_tokens == 3
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=2,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert c.usage.completion_tokens == 2


def test_server_continuous_usage_stats_in_every_chunk(app_client):
    _, _, client = app_client
    chunks = list(client.completions.create(model="tiny", prompt="Hi", max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True},
                                            extra_body={"ignore_eos": True}))
    with_text = [c for c in chunks if c.choices]
    assert with_text and all(c.usage is not None for c in with_text)
    counts = [c.usage.completion_tokens for c in with_text]
    assert counts == sorted(counts) and counts[-1] == 5 and chunks[-1].usage.completion_tokens == 5


def test_server_model_by_id(app_client):
    _, http, client = app_client
    assert client.models.retrieve("tiny").id == "tiny"
    assert client.models.retrieve("org/tiny").id == "org/tiny"
    r = http.get("/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_server_refuses_what_it_would_silently_get_wrong(app_client):
    import openai

    _, _, client = app_client
    with pytest.raises(openai.BadRequestError, match="tool parser"):  # a tool call would never be read out
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    with pytest.raises(openai.BadRequestError, match="bad_words is not supported") as e:
        client.completions.create(model="tiny", prompt="Hi", extra_body={"bad_words": ["x"]})
    assert e.value.body["code"] == "unsupported_parameter" and e.value.body["param"] == "bad_words"


def test_metrics_have_vllms_names_and_request_histograms(app_client):
    from prometheus_client.parser import text_string_to_metric_families

    _, http, client = app_client
    before = {s.name: s.value for f in text_string_to_metric_families(http.get("/metrics").text) for s in f.samples
              if s.name == "vllm:e2e_request_latency_seconds_count"}
    for i in range(3):
        client.completions.create(model="tiny", prompt=f"Hello {i}", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success", "vllm:num_preemptions",
                 "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                 "vllm:request_inference_time_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                 "vllm:request_params_n", "vllm:request_params_max_tokens"):
        assert name in families, f"/metrics has no {name}"
    assert not [n for n in families if n.startswith("minipaged:")]
    samples = {s.name: s for f in families.values() for s in f.samples if "le" not in s.labels}
    assert samples["vllm:num_requests_running"].labels["model_name"] == "tiny"
    for h in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "request_generation_tokens", "request_params_max_tokens"):
        got = samples[f"vllm:{h}_count"].value - before.get("vllm:e2e_request_latency_seconds_count", 0)
        assert got >= 3, (h, got)
    hist = families["vllm:request_generation_tokens"]
    count = next(s.value for s in hist.samples if s.name.endswith("_count"))
    total = next(s.value for s in hist.samples if s.name.endswith("_sum"))
    assert total >= 4 * 3 and count >= 3


# -- the engine: logprobs, penalties and vLLM's output fields, on a tiny random model ---------
@pytest.fixture(scope="module")
def llm(tiny_model):
    from minipaged import LLM

    model, tok = tiny_model
    return LLM(model, tok, block_size=4, num_blocks=256)


@pytest.fixture(scope="module")
def hf_tiny(tiny_hf_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32).eval()


def _hf_log_softmax(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("sampled", [False, True])
def test_logprobs_equal_transformers_log_softmax(llm, hf_tiny, sampled):
    sp = SamplingParams(temperature=0.8 if sampled else 0, seed=7, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate("The quick brown fox", sp)[0]
    comp = out.outputs[0]
    ids = out.prompt_token_ids + comp.token_ids
    lps = _hf_log_softmax(hf_tiny, ids)
    P = len(out.prompt_token_ids)
    assert len(comp.logprobs) == len(comp.token_ids) == 6
    for j, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = lps[P - 1 + j]
        assert next(iter(entry)) == tok  # the sampled token first, as vLLM returns them
        assert entry[tok].logprob == pytest.approx(float(row[tok]), abs=1e-4)
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
        top = torch.topk(row, 3).indices.tolist()
        assert [t for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank) if lp.rank <= 3] == top
        assert all(isinstance(lp.decoded_token, str) for lp in entry.values())
    assert comp.cumulative_logprob == pytest.approx(sum(float(lps[P - 1 + j, t]) for j, t in enumerate(comp.token_ids)), abs=1e-3)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == P
    for i in range(1, P):
        entry = out.prompt_logprobs[i]
        tok = out.prompt_token_ids[i]
        assert next(iter(entry)) == tok and entry[tok].logprob == pytest.approx(float(lps[i - 1, tok]), abs=1e-4)
        assert len(entry) <= 3  # the prompt's token and the top 2
    if not sampled:
        assert all(entry[t].rank == 1 for t, entry in zip(comp.token_ids, comp.logprobs))  # greedy picks rank 1


def _penalise_by_hand(logits: list[float], prompt: list[int], output: list[int], pres: float, freq: float, rep: float) -> list[float]:
    out = list(logits)
    for t in range(len(out)):
        n = output.count(t)
        if rep != 1 and (t in prompt or n):
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
        out[t] -= freq * n + (pres if n else 0.0)
    return out


def test_penalties_end_to_end_match_a_replay_by_hand(llm, hf_tiny):
    pen = dict(presence_penalty=0.4, frequency_penalty=0.6, repetition_penalty=1.5)
    plain = llm.generate("naive cafe, numbers 12345", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    out = llm.generate("naive cafe, numbers 12345", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, **pen))[0]
    prompt, toks = out.prompt_token_ids, out.outputs[0].token_ids
    with torch.no_grad():
        logits = hf_tiny(torch.tensor([prompt + toks])).logits[0].float()
    for j, tok in enumerate(toks):
        row = _penalise_by_hand(logits[len(prompt) - 1 + j].tolist(), prompt, toks[:j], pen["presence_penalty"],
                                pen["frequency_penalty"], pen["repetition_penalty"])
        assert tok == max(range(len(row)), key=row.__getitem__), f"step {j}"
    assert len(set(toks)) >= len(set(plain.outputs[0].token_ids))  # penalised: no fewer distinct tokens


def test_min_tokens_holds_eos_back(llm, tiny_model):
    _, tok = tiny_model
    eos = tok.eos_token_ids[0]
    sp = SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100.0})
    assert llm.generate("Hi", sp)[0].outputs[0].token_ids == [eos]  # EOS at once
    sp.min_tokens = 3  # set after construction: takes effect
    o = llm.generate("Hi", sp)[0].outputs[0]
    assert len(o.token_ids) == 4 and o.token_ids[-1] == eos and eos not in o.token_ids[:3] and o.finish_reason == "stop"
    assert o.stop_reason is None  # EOS: no stop_reason, as in vLLM


def test_stop_reason_and_include_stop_str_in_output(llm, tiny_model):
    _, tok = tiny_model
    base = llm.generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert base.stop_reason is None and base.finish_reason == "length" and base.finished()
    stop_tok = base.token_ids[3]
    o = llm.generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_tok]))[0].outputs[0]
    assert o.stop_reason == stop_tok and o.finish_reason == "stop" and o.token_ids[-1] == stop_tok
    # a random model's text is noise: a bias makes it repeat one token, so a stop string is sure to come
    fox = tok.encode(" fox")[0]
    piece = tok.decode([fox])
    forced = dict(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={fox: 100.0})
    text = llm.generate("def add(a, b):", SamplingParams(**forced))[0].outputs[0].text
    stop = piece[1:] + piece  # e.g. "fox fox": it starts inside the first repetition
    assert len(piece) >= 2 and stop in text, (piece, text)
    cut = llm.generate("def add(a, b):", SamplingParams(**forced, stop=[stop]))[0].outputs[0]
    assert cut.stop_reason == stop and cut.finish_reason == "stop" and cut.text == text[: text.find(stop)]
    kept = llm.generate("def add(a, b):", SamplingParams(**forced, stop=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == cut.text + stop and kept.stop_reason == stop
    streamed = "".join(llm.stream("def add(a, b):", SamplingParams(**forced, stop=[stop], include_stop_str_in_output=True)))
    assert streamed == kept.text


def test_min_tokens_defers_stop_strings_as_vllm_does(llm, tiny_model):
    """vLLM looks for stop strings only once more than min_tokens tokens are out (its detokenizer
    skips the check while ``len(output_token_ids) <= min_tokens``); the search still reaches back
    ``len(stop) - 1`` characters, so a stop string that ends after min_tokens is honoured even when
    it began before."""
    _, tok = tiny_model
    fox = tok.encode(" fox")[0]
    piece = tok.decode([fox])  # every token below prints this piece
    forced = dict(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={fox: 100.0})
    prompt = "def add(a, b):"
    assert llm.generate(prompt, SamplingParams(**forced, stop=[piece]))[0].outputs[0].token_ids == [fox]  # at once
    o = llm.generate(prompt, SamplingParams(**forced, stop=[piece], min_tokens=3))[0].outputs[0]
    assert len(o.token_ids) == 4 and o.text == piece * 3 and o.stop_reason == piece and o.finish_reason == "stop"
    streamed = "".join(llm.stream(prompt, SamplingParams(**forced, stop=[piece], min_tokens=3)))
    assert streamed == piece * 3
    # a stop string of two pieces: with min_tokens=1 it is found when the second token completes it
    two = llm.generate(prompt, SamplingParams(**forced, stop=[piece * 2], min_tokens=1))[0].outputs[0]
    assert len(two.token_ids) == 2 and two.text == "" and two.stop_reason == piece * 2
    # min_tokens = max_tokens: no stop string can end it early
    full = llm.generate(prompt, SamplingParams(**{**forced, "max_tokens": 5}, stop=[piece], min_tokens=5))[0].outputs[0]
    assert full.text == piece * 5 and full.finish_reason == "length" and full.stop_reason is None


def test_stop_checker_ignores_eos_and_stop_tokens_before_min_tokens():
    from minipaged.detokenizer import StopChecker

    c = StopChecker(max_tokens=6, num_prompt_tokens=1, eos_token_ids=[2], stop_token_ids=[3], min_tokens=3)
    assert [c.append(t)[0] for t in (2, 3)] == [None, None]  # forced through the masks (a draft, a custom sampler)
    assert c.append(2)[0] == "stop"  # the third token may end it (vLLM: num_output_tokens < min_tokens checks nothing)


def test_skip_special_tokens_false_keeps_them(llm, tiny_model):
    _, tok = tiny_model
    special = tok.encode("<|im_start|>")
    assert len(special) == 1
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logit_bias={special[0]: 100.0})
    assert "<|im_start|>" not in llm.generate("Hi", sp)[0].outputs[0].text
    assert llm.generate("Hi", SamplingParams(**{**{f.name: getattr(sp, f.name) for f in dataclasses.fields(sp)},
                                                "skip_special_tokens": False}))[0].outputs[0].text == "<|im_start|>" * 2


def test_decoded_token_of_a_special_token_is_its_text(llm, tiny_model):
    """vLLM decodes each logprob's token alone with the tokenizer's default (special tokens kept:
    ``convert_ids_list_to_tokens`` in vllm/transformers_utils/detokenizer_utils.py), whatever
    ``skip_special_tokens`` says about the answer's text; prompt logprobs likewise."""
    _, tok = tiny_model
    special = tok.encode("<|im_start|>")[0]
    for skip in (True, False):
        sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logit_bias={special: 100.0}, logprobs=1,
                            prompt_logprobs=1, skip_special_tokens=skip)
        out = llm.generate("<|im_start|>user Hi", sp)[0]
        o = out.outputs[0]
        assert o.token_ids == [special] * 2 and o.text == ("" if skip else "<|im_start|>" * 2)
        assert [e[special].decoded_token for e in o.logprobs] == ["<|im_start|>"] * 2
        assert out.prompt_token_ids[0] == special and out.prompt_logprobs[0] is None
        assert out.prompt_logprobs[1][out.prompt_token_ids[1]].decoded_token == tok.decode([out.prompt_token_ids[1]])


def test_max_tokens_none_runs_to_the_end_of_the_context(tiny_model):
    from minipaged import LLM

    model, tok = tiny_model
    small = LLM(model, tok, block_size=4, num_blocks=64, max_model_len=40)
    out = small.generate("Hello there", SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 40 and out.outputs[0].finish_reason == "length"


def test_max_tokens_set_after_adding_applies_to_later_requests(llm):
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    rid = eng.add_request("copy-1", "Hello", sp)
    sp.max_tokens = 6  # after adding: the stop settings were copied onto the first request's sequence
    rid2 = eng.add_request("copy-2", "Hello", sp)
    done = eng.run()
    assert (len(done[rid].outputs[0].token_ids), len(done[rid2].outputs[0].token_ids)) == (3, 6)


def test_request_output_has_vllms_fields(llm):
    out = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert out.prompt == "The quick brown fox" and out.finished is True
    c = out.outputs[0]
    assert c.finished() and c.cumulative_logprob is None and c.logprobs is None and c.stop_reason is None
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert m.time_in_queue >= 0 and m.num_generation_tokens == 3 and m["finish_time"] == m.finished_time
    ids = llm.generate({"prompt_token_ids": out.prompt_token_ids}, SamplingParams(max_tokens=1))[0]
    assert ids.prompt is None  # token ids: no prompt text, as in vLLM
    chat = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}],
                    SamplingParams(max_tokens=2))[0]
    assert chat.finish_reason != "rejected" and chat.prompt.startswith("<|im_start|>user\nHi there<|im_end|>")
    assert chat.prompt.endswith("<|im_start|>assistant\n")


def test_chat_options(llm):
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    cont = llm.chat(conv, SamplingParams(max_tokens=1), add_generation_prompt=False, continue_final_message=True)[0]
    assert cont.prompt.endswith("Hello, I am")
    closed = llm.chat(conv, SamplingParams(max_tokens=1), add_generation_prompt=False)[0]
    assert closed.prompt.endswith("<|im_end|>\n") or closed.prompt.endswith("<|im_end|>")
    custom = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=1),
                      chat_template="{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")[0]
    assert custom.prompt == "[user] Hi\n"


def test_llm_helpers(llm, tiny_hf_dir):
    from minipaged import LLM, LLMEngine

    assert llm.get_tokenizer() is llm.tokenizer and isinstance(llm.llm_engine, LLMEngine)
    assert llm.get_default_sampling_params() == SamplingParams()
    with pytest.raises(FileNotFoundError, match="local folder or GGUF"):
        LLM(str(tiny_hf_dir), tokenizer="facebook/opt-125m")  # refused before anything loads
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(tiny_hf_dir), dtype="float8")
    other = LLM(str(tiny_hf_dir), tokenizer=str(tiny_hf_dir), dtype="float32", block_size=4, num_blocks=64, enforce_eager=True)
    assert other.generate("Hi", SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].token_ids == \
        llm.generate("Hi", SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].token_ids


def test_add_request_takes_vllms_order_and_the_old_one(llm):
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=2)
    a = eng.add_request("req-a", "Hello", sp)  # vLLM: (request_id, prompt, params)
    b = eng.add_request("Hello", sp)  # minipaged's older (prompt, params)
    c = eng.add_request("Hello", sp, request_id="req-c")
    d = eng.add_request(request_id="req-d", prompt={"prompt_token_ids": [5, 6, 7]}, params=sp)
    assert (a, c, d) == ("req-a", "req-c", "req-d") and b not in (a, c, d)
    done = eng.run()
    assert done[a].prompt == done[b].prompt == "Hello" and done[a].outputs[0].token_ids == done[b].outputs[0].token_ids
    with pytest.raises(TypeError, match="prompt"):
        eng.add_request("only-an-id", None, sp)


# -- vLLM's offline examples, restated, with `from minipaged import ...` -------------------
def test_example_basic(tiny_hf_dir):
    from minipaged import LLM, SamplingParams as SP

    prompts = ["Hello, my name is", "The capital of France is", "The future of AI is"]
    sampling_params = SP(temperature=0.8, top_p=0.95)
    llm = LLM(model=str(tiny_hf_dir), block_size=4, num_blocks=128)
    outputs = llm.generate(prompts, sampling_params)
    for prompt, output in zip(prompts, outputs):
        assert output.prompt == prompt and isinstance(output.outputs[0].text, str)
        assert len(output.outputs[0].token_ids) == 16 or output.outputs[0].finish_reason == "stop"


def test_example_chat(tiny_hf_dir):
    from minipaged import LLM

    llm = LLM(model=str(tiny_hf_dir), block_size=4, num_blocks=128)
    sampling_params = llm.get_default_sampling_params()
    sampling_params.max_tokens = 8
    sampling_params.temperature = 0.5
    conversation = [  # short: the tiny model's context is 128 tokens of a 400-token vocabulary
        {"role": "system", "content": "Be brief"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Add 2 and 3."},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    assert len(outputs) == 1 and outputs[0].prompt.count("<|im_start|>") == 5 and outputs[0].finish_reason in ("stop", "length")
    outputs = llm.chat([conversation for _ in range(3)], sampling_params, use_tqdm=True)
    assert [o.finish_reason in ("stop", "length") for o in outputs] == [True] * 3
    template = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    outputs = llm.chat(conversation, sampling_params, chat_template=template)
    assert outputs[0].prompt == "system: Be brief\nuser: Hello\nassistant: Hello!\nuser: Add 2 and 3.\n"


def test_example_automatic_prefix_caching(tiny_hf_dir):
    from minipaged import LLM, SamplingParams as SP

    long_prefix = "Paged attention stores keys and values in fixed-size blocks; a block table maps positions to blocks. " * 2
    questions = ["What is a block?", "What maps positions?"]
    llm = LLM(model=str(tiny_hf_dir), enable_prefix_caching=True, block_size=4, num_blocks=256)
    sp = SP(temperature=0)
    first = llm.generate(long_prefix + questions[0], sp)[0]
    second = llm.generate(long_prefix + questions[1], sp)[0]
    again = llm.generate(long_prefix + questions[0], sp)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= 4 * (len(long_prefix) // 40)
    assert again.outputs[0].text == first.outputs[0].text and again.num_cached_tokens > second.num_cached_tokens - 4
    assert llm.reset_prefix_cache() is True
    assert llm.generate(long_prefix + questions[0], sp)[0].num_cached_tokens == 0


def test_example_llm_engine_loop(tiny_hf_dir):
    import argparse

    from minipaged import EngineArgs, LLMEngine, SamplingParams as SP

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(description="the LLMEngine loop"))
    args = parser.parse_args(["--model", str(tiny_hf_dir), "--block-size", "4", "--num-blocks", "128"])
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    test_prompts = [
        ("A robot may not injure a human being", SP(temperature=0.0, logprobs=1, prompt_logprobs=1)),
        ("To be or not to be,", SP(temperature=0.8, top_k=5, presence_penalty=0.2)),
        ("What is the meaning of life?", SP(n=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1)),
    ]
    request_id = 0
    finished = {}
    while test_prompts or engine.has_unfinished_requests():
        if test_prompts:
            prompt, sampling_params = test_prompts.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params)
            request_id += 1
        for request_output in engine.step():
            if request_output.finished:
                finished[request_output.request_id] = request_output
    assert sorted(finished) == ["0", "1", "2"]
    first = finished["0"]
    assert first.prompt == "A robot may not injure a human being"
    assert len(first.outputs[0].logprobs) == len(first.outputs[0].token_ids)
    assert all(1 <= len(e) <= 2 for e in first.outputs[0].logprobs)
    assert len(first.prompt_logprobs) == len(first.prompt_token_ids) and first.prompt_logprobs[0] is None
    assert len(finished["2"].outputs) == 2


# -- the server: logprobs, echo and penalties through the openai client ---------------------
def test_server_chat_logprobs(app_client):
    _, _, client = app_client
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.top_logprobs[0].token == c.token  # greedy: the chosen token is the most likely
    streamed = []
    for ch in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                             temperature=0, logprobs=True, top_logprobs=2, stream=True,
                                             extra_body={"ignore_eos": True}):
        if ch.choices and ch.choices[0].logprobs is not None:
            streamed += [c.token for c in ch.choices[0].logprobs.content]
    assert streamed == [c.token for c in content]


def test_server_logprobs_name_special_tokens(app_client, tiny_model):
    _, _, client = app_client
    _, tok = tiny_model
    special = tok.encode("<|im_start|>")[0]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0,
                                       logprobs=True, top_logprobs=1,
                                       extra_body={"ignore_eos": True, "logit_bias": {str(special): 100}})
    assert r.choices[0].message.content == ""  # skip_special_tokens: the text leaves them out
    assert [(c.token, c.bytes) for c in r.choices[0].logprobs.content] == [("<|im_start|>", list(b"<|im_start|>"))] * 2
    c = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True, "logit_bias": {str(special): 100},
                                              "skip_special_tokens": False})
    assert c.choices[0].text == "<|im_start|>" * 2 and c.choices[0].logprobs.tokens == ["<|im_start|>"] * 2


def test_server_return_tokens_as_token_ids(app_client):
    """vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>" (both endpoints)."""
    _, _, client = app_client
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0,
                                       logprobs=True, top_logprobs=2, extra_body=extra)
    for c in r.choices[0].logprobs.content:
        assert c.token.startswith("token_id:") and all(t.token.startswith("token_id:") for t in c.top_logprobs)
        assert c.bytes == list(c.token.encode())
    c = client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0, logprobs=1, extra_body=extra)
    lp = c.choices[0].logprobs
    assert all(t.startswith("token_id:") for t in lp.tokens) and all(k.startswith("token_id:") for d in lp.top_logprobs for k in d)


MARKED = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}[assistant]{% endif %}{% if mood %} ({{ mood }}){% endif %}")


def test_server_refuses_a_request_template_unless_trusted(app_client):
    """vLLM: a request's own chat_template needs --trust-request-chat-template (a 400 otherwise)."""
    import openai

    _, _, client = app_client
    msgs = [{"role": "user", "content": "Hi"}]
    for extra in ({"chat_template": MARKED}, {"chat_template_kwargs": {"chat_template": MARKED}}):
        with pytest.raises(openai.BadRequestError, match="--trust-request-chat-template") as e:
            client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1, extra_body=extra)
        assert e.value.body["param"] == "chat_template"
    # chat_template_kwargs alone are always taken (the model's template ignores a variable it does not use)
    plain = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, temperature=0)
    kw = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, temperature=0,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert (kw.choices[0].message.content, kw.usage.prompt_tokens) == (plain.choices[0].message.content, plain.usage.prompt_tokens)


@pytest.fixture(scope="module")
def trusting_client(tiny_model):
    """An app started as `minipaged serve --trust-request-chat-template`, and an openai client to it."""
    openai = pytest.importorskip("openai")
    from starlette.testclient import TestClient

    from minipaged.engine import LLMEngine
    from minipaged.server.app import ServerConfig, create_app

    model, tok = tiny_model
    app = create_app(lambda: LLMEngine(model, tok, num_blocks=64, block_size=4, max_num_seqs=4),
                     ServerConfig(model_names=("tiny",), trust_request_chat_template=True))
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)


def test_server_renders_a_request_chat_template_with_its_kwargs(trusting_client, llm, tiny_model):
    import openai

    _, tok = tiny_model
    client = trusting_client
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}]

    def ask(**extra):
        return client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0,
                                              extra_body={"ignore_eos": True, **extra})

    cases = [({"chat_template": MARKED}, "[user] Hi\n[assistant] Hello\n[user] More\n[assistant]"),
             ({"chat_template": MARKED, "chat_template_kwargs": {"mood": "glad"}},
              "[user] Hi\n[assistant] Hello\n[user] More\n[assistant] (glad)"),
             ({"chat_template_kwargs": {"chat_template": MARKED}, "add_generation_prompt": False},
              "[user] Hi\n[assistant] Hello\n[user] More\n")]
    for extra, text in cases:
        r = ask(**extra)
        want = llm.generate(text, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
        assert r.usage.prompt_tokens == len(tok.encode(text)) and r.choices[0].message.content == want.outputs[0].text, extra
    for bad, what in (("{% for m in messages %}", "TemplateSyntaxError"),
                      ("{{ raise_exception('this template wants a system message') }}", "wants a system message")):
        with pytest.raises(openai.BadRequestError, match="chat template failed to render") as e:
            ask(chat_template=bad)
        assert e.value.body["param"] == "chat_template" and what in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        ask(chat_template_kwargs={"chat_template": 5})
    assert e.value.body["param"] == "chat_template_kwargs"
    assert ask().choices[0].finish_reason == "length"  # still serving


def test_llm_chat_takes_chat_template_kwargs_and_names_a_broken_template(llm):
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=1), chat_template=MARKED,
                   chat_template_kwargs={"mood": "calm"})[0]
    assert out.prompt == "[user] Hi\n[assistant] (calm)"
    with pytest.warns(UserWarning, match="chat_template: the chat template failed to render"):  # LLM's way: refused, said why
        bad = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=1), chat_template="{{ 1 / 0 }}")[0]
    assert bad.finish_reason == "rejected" and "ZeroDivisionError" in bad.error
    with pytest.raises(ValueError, match="chat_template: the chat template failed to render"):
        llm.llm_engine.add_request("broken-template", {"messages": [{"role": "user", "content": "Hi"}], "chat_template": "{% if %}"},
                                   SamplingParams(max_tokens=1))


def test_server_completion_logprobs_and_echo(app_client, llm):
    _, _, client = app_client
    r = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=4, temperature=0, logprobs=2,
                                  echo=True, extra_body={"ignore_eos": True})
    ch = r.choices[0]
    want = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2))[0]
    assert ch.text == "The quick brown fox" + want.outputs[0].text
    lp = ch.logprobs
    assert len(lp.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    gen = lp.token_logprobs[r.usage.prompt_tokens:]
    assert gen == pytest.approx([e[t].logprob for t, e in zip(want.outputs[0].token_ids, want.outputs[0].logprobs)], abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset)


def test_server_penalties_equal_llm_generate(app_client, llm):
    _, _, client = app_client
    kw = dict(presence_penalty=0.5, frequency_penalty=0.7)
    extra = {"repetition_penalty": 1.3, "min_tokens": 2, "ignore_eos": True}
    r = client.completions.create(model="tiny", prompt="numbers 12345", max_tokens=8, temperature=0, extra_body=extra, **kw)
    want = llm.generate("numbers 12345", SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3, min_tokens=2,
                                                        ignore_eos=True, **kw))[0]
    assert r.choices[0].text == want.outputs[0].text


def test_bench_serve_draws_fresh_prompts_unless_seeded():
    import argparse

    from minipaged.bench.serve import add_arguments, fresh_seed, make_requests

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).seed is None and p.parse_args(["--seed", "3"]).seed == 3
    a, b = fresh_seed(), fresh_seed()
    assert a != b  # 2**31 seeds: two draws agree about once in two billion runs
    ids = lambda seed: [r.prompt for r in make_requests("fixed", 4, seed, 512)]  # noqa: E731
    assert ids(a) != ids(b) and ids(5) == ids(5)


def test_serve_names_the_missing_extra_and_takes_vllms_flags(monkeypatch, capsys):
    import builtins

    from minipaged.cli import build_parser, main

    args = build_parser().parse_args(["serve", "some/model", "--dtype", "half", "--seed", "3", "--served-model-name", "a", "b",
                                      "--disable-log-requests"])
    assert (args.model_tag, args.dtype, args.seed, args.served_model_name, args.log_requests) == ("some/model", "half", 3, ["a", "b"], False)
    real_import = builtins.__import__

    def no_uvicorn(name, *a, **kw):
        if name == "uvicorn" or name.startswith("uvicorn."):
            raise ImportError("No module named 'uvicorn'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_uvicorn)
    assert main(["serve"]) == 2
    assert 'pip install "minipaged[serve]"' in capsys.readouterr().err
    monkeypatch.setattr(builtins, "__import__", real_import)
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("minipaged ")
