"""Structured outputs (SamplingParams(structured_outputs=StructuredOutputsParams(...))): the forms and
their errors, the mask against xgrammar's and against a trie walk by hand, and the engine under
greedy and sampled decoding, n > 1, stop strings, prefix caching, preemption and speculation."""
from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("xgrammar")

from minipaged import LLM, SamplingParams  # noqa: E402
from minipaged.data import Sequence  # noqa: E402
from minipaged.sampling_params import StructuredOutputsParams  # noqa: E402
from minipaged.structured_output import StructuredOutputs, choice_mask, grammar_mask, token_bytes  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


# -- the params ------------------------------------------------------------------------------------
def test_exported_at_the_top_level_and_in_sampling_params():
    import minipaged

    assert minipaged.StructuredOutputsParams is StructuredOutputsParams
    sp = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    assert sp.structured_outputs.kind == "choice" and sp.needs_logits
    as_dict = SamplingParams(structured_outputs={"regex": "[0-9]+"})  # the HTTP body's form
    assert isinstance(as_dict.structured_outputs, StructuredOutputsParams) and as_dict.structured_outputs.regex == "[0-9]+"


@pytest.mark.parametrize("kw, words", [
    (dict(), "exactly one"),
    (dict(regex="a", choice=["a"]), "exactly one"),
    (dict(regex="(ab"), "parenthesis"),
    (dict(json={"type": "objekt"}), "objekt"),
    (dict(json="{not json"), "not JSON"),
    (dict(grammar='root ::= missing'), "missing"),
    (dict(choice="yes"), "list"),
    (dict(choice=["yes", ""]), "non-empty"),
])
def test_a_bad_form_is_a_value_error_naming_the_error(kw, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        StructuredOutputsParams(**kw)


def test_ignore_eos_is_refused_with_a_grammar():
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(choice=["a"]))


# -- the mask ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def grammar(smollm2):
    model, tok = smollm2
    return StructuredOutputs(tok, model.config.vocab_size), token_bytes(tok, model.config.vocab_size), tok


def _seq(tok, so: StructuredOutputsParams, text: str, sid: str) -> Sequence:
    seq = Sequence.for_request(sid, [1], SamplingParams(structured_outputs=so), tok.eos_token_ids)
    seq.output_token_ids = tok.encode(text)
    return seq


@pytest.mark.parametrize("prefix", ["", "Pos", "Positive", "café", "caf", "Neg"])
def test_choice_mask_by_trie_walk_equals_xgrammars(grammar, prefix):
    structured, vocab, tok = grammar
    choices = ["Positive", "Negative", "café au lait", "Posh"]
    mine = choice_mask(vocab, choices, prefix.encode(), tok.eos_token_ids)
    theirs = grammar_mask(structured, _seq(tok, StructuredOutputsParams(choice=choices), prefix, f"c{prefix}"))
    assert mine.sum() > 0
    diff = (mine != theirs).nonzero().flatten().tolist()
    assert not diff, f"after {prefix!r}: tokens {[tok.decode([t]) for t in diff[:8]]} differ"
    if prefix in ("Positive",):
        assert theirs.nonzero().flatten().tolist() == list(tok.eos_token_ids), "a finished choice allows only EOS"


def test_the_batch_mask_equals_one_matcher_per_row(grammar):
    """apply() masks the whole batch in one call; each row equals xgrammar's mask for that sequence alone."""
    import xgrammar as xgr

    structured, _, tok = grammar
    forms = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=r"\d{3}-\d{4}"),
             StructuredOutputsParams(grammar='root ::= "yes" | "no"')]
    texts = ['{"name": "Al', "12", "y"]
    seqs = [_seq(tok, f, t, f"b{i}") for i, (f, t) in enumerate(zip(forms, texts))]
    plain = _seq(tok, StructuredOutputsParams(choice=["x"]), "", "plain")
    plain.sampling_params = SamplingParams()  # an unconstrained row between them
    batch = seqs[:1] + [plain] + seqs[1:]
    logits = torch.randn(len(batch), structured.vocab_size)
    before = logits.clone()
    assert structured.apply(logits, batch) == {}
    assert torch.equal(logits[1], before[1]), "an unconstrained row is left alone"
    for r, seq in [(0, seqs[0]), (2, seqs[1]), (3, seqs[2])]:
        m = xgr.GrammarMatcher(structured.compile(seq.sampling_params.structured_outputs))
        for t in seq.output_token_ids:
            assert m.accept_token(t)
        bm = xgr.allocate_token_bitmask(1, structured.vocab_size)
        m.fill_next_token_bitmask(bm)
        want = before[r : r + 1].clone()
        xgr.apply_token_bitmask_inplace(want, bm)
        assert torch.equal(logits[r], want[0])


def test_drafts_the_grammar_refuses_are_cut_and_the_matcher_rolls_back(grammar):
    structured, _, tok = grammar
    seq = _seq(tok, StructuredOutputsParams(regex=r"abc(abc)*"), "abc", "d")
    good, bad = tok.encode("abcab"), tok.encode("x")
    seq.spec_token_ids = good + bad
    assert structured.trim_drafts([seq]) == len(bad)
    assert seq.spec_token_ids == good
    m = structured.matcher(seq)
    assert m.read == seq.output_token_ids, "the matcher is back where the sequence's tokens are"
    row = structured.mask_after(seq, good, torch.zeros(1, structured.vocab_size))
    assert row[0, bad[0]] == float("-inf") and row[0, tok.encode("c")[0]] == 0
    assert m.read == seq.output_token_ids


# -- the engine -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(smollm2):
    model, tok = smollm2
    return LLM(model, tok)


def _greedy(so, **kw):
    return SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 48), structured_outputs=so, **kw)


@pytest.mark.slow
def test_every_form_gives_valid_text_that_finishes_with_stop(llm):
    prompts = ["Classify the review 'I loved it'. Sentiment:", "Describe a person as JSON:", "Phone number:",
               "Is the sky blue? Answer:", "Give me a JSON object:"]
    forms = [StructuredOutputsParams(choice=["Positive", "Negative"]), StructuredOutputsParams(json=SCHEMA),
             StructuredOutputsParams(regex=r"\d{3}-\d{4}"), StructuredOutputsParams(grammar='root ::= "yes" | "no"'),
             StructuredOutputsParams(json_object=True)]
    outs = llm.generate(prompts, [_greedy(f, max_tokens=64) for f in forms])
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), [(t, o.outputs[0].finish_reason) for t, o in zip(texts, outs)]
    assert texts[0] in ("Positive", "Negative")
    person = json.loads(texts[1])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert re.fullmatch(r"\d{3}-\d{4}", texts[2])
    assert texts[3] in ("yes", "no")
    assert isinstance(json.loads(texts[4]), dict)


@pytest.mark.slow
def test_sampled_and_n_samples_each_follow_their_grammar(llm):
    so = StructuredOutputsParams(json=SCHEMA)
    sp = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=64, structured_outputs=so)
    out = llm.generate("Describe a person as JSON:", sp)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        if c.finish_reason == "stop":
            assert set(json.loads(c.text)) == {"name", "age"}
        else:  # cut by max_tokens: still a prefix the grammar allows
            assert c.text.lstrip().startswith("{")
    # sample i draws from seed + i: sample 1 equals one request with seed 4
    alone = llm.generate("Describe a person as JSON:", SamplingParams(temperature=1.0, seed=4, max_tokens=64, structured_outputs=so))[0]
    assert alone.outputs[0].token_ids == out.outputs[1].token_ids


@pytest.mark.slow
def test_n_greedy_samples_are_each_the_unconstrained_tokens_where_the_model_complies(llm):
    """n > 1 under a grammar: every sample has its own matcher; greedy, each equals the unconstrained
    tokens the choice allows, then EOS."""
    toks, text = _unconstrained(llm)
    out = llm.chat(CHAT, SamplingParams(temperature=0, n=3, max_tokens=48,
                                        structured_outputs=StructuredOutputsParams(choice=[text, "I do not know."])))[0]
    eos = llm.get_tokenizer().eos_token_ids[0]
    assert len(out.outputs) == 3
    assert [c.token_ids for c in out.outputs] == [toks + [eos]] * 3 and all(c.finish_reason == "stop" for c in out.outputs)


def _unconstrained(llm, n=16):
    out = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=n))[0].outputs[0]
    eos = set(llm.get_tokenizer().eos_token_ids)
    toks = [t for t in out.token_ids if t not in eos]
    return toks, llm.get_tokenizer().decode(toks)


@pytest.mark.slow
def test_greedy_tokens_are_exact_where_the_model_already_complies(llm):
    toks, text = _unconstrained(llm)
    eos = llm.get_tokenizer().eos_token_ids
    out = llm.chat(CHAT, _greedy(StructuredOutputsParams(choice=[text, "I do not know."])))[0].outputs[0]
    assert out.token_ids == toks + [eos[0]] and out.finish_reason == "stop", "the grammar changed tokens it allowed"
    regex = llm.chat(CHAT, _greedy(StructuredOutputsParams(regex=re.escape(text) + "[a-z ]*"), max_tokens=len(toks)))[0].outputs[0]
    assert regex.token_ids == toks


@pytest.mark.slow
def test_speculative_decoding_keeps_the_grammar_and_the_greedy_tokens(smollm2, llm):
    model, tok = smollm2
    spec = LLM(model, tok, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                               "prompt_lookup_min": 1, "disable_by_batch_size": 64})
    toks, text = _unconstrained(llm)
    forms = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=r"(ab|abc)+x"),
             StructuredOutputsParams(choice=[text])]
    prompts = [[{"role": "user", "content": "A person as JSON, like {\"name\": \"Bob\", \"age\": 3}:"}],
               [{"role": "user", "content": "Write abcabcabcab then x"}], CHAT]
    want = [llm.chat(p, _greedy(f, max_tokens=40))[0].outputs[0] for p, f in zip(prompts, forms)]
    got = [spec.chat(p, _greedy(f, max_tokens=40))[0].outputs[0] for p, f in zip(prompts, forms)]
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
    stats = spec.llm_engine.spec.stats
    assert stats.num_draft_tokens > 0, "no draft was verified: the test did not exercise speculation"
    assert re.fullmatch(r"(ab|abc)+x", got[1].text) or got[1].finish_reason == "length"


@pytest.mark.slow
def test_preemption_and_prefix_caching_keep_the_grammar_and_the_greedy_tokens(smollm2, llm):
    model, tok = smollm2
    prompts = [[{"role": "user", "content": f"Person number {i} as JSON:"}] for i in range(6)]
    so = StructuredOutputsParams(json=SCHEMA)
    roomy = [o.outputs[0] for o in llm.chat(prompts, _greedy(so, max_tokens=40))]
    toks, text = _unconstrained(llm)                    # a choice the model already makes: its tokens must not move
    tight = LLM(model, tok, block_size=16, num_blocks=14)
    outs = tight.chat(prompts + [CHAT], [_greedy(so, max_tokens=40)] * len(prompts)
                      + [_greedy(StructuredOutputsParams(choice=[text]), max_tokens=40)])
    got, chosen = [o.outputs[0] for o in outs[:-1]], outs[-1].outputs[0]
    assert tight.llm_engine.scheduler.num_preemptions > 0, "the small pool was meant to force preemption"
    assert [g.token_ids for g in got] == [r.token_ids for r in roomy]
    assert chosen.token_ids == toks + [tok.eos_token_ids[0]] and chosen.finish_reason == "stop"
    assert sum(g.finish_reason == "stop" for g in got) >= len(got) // 2, "too few finished: the JSON check below checks little"
    again = [o.outputs[0] for o in tight.chat(prompts[:2], _greedy(so, max_tokens=40))]  # prompts now cached
    assert [a.token_ids for a in again] == [r.token_ids for r in roomy[:2]]
    for g in got:
        if g.finish_reason == "stop":
            assert set(json.loads(g.text)) == {"name", "age"}


@pytest.mark.slow
def test_stop_strings_cut_constrained_text(llm):
    out = llm.generate("Phone number:", _greedy(StructuredOutputsParams(regex=r"\d{3}-\d{4}"), stop=["-"]))[0].outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch(r"\d{3}", out.text)


@pytest.mark.slow
def test_a_grammar_no_token_can_continue_ends_that_request_alone(llm):
    tok = llm.get_tokenizer()
    stuck = SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=tok.encode("maybe"),
                           structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    fine = _greedy(StructuredOutputsParams(choice=["yes", "no"]))
    with pytest.warns(UserWarning, match="structured outputs"):
        outs = llm.generate(["Is it?", "Is it?"], [stuck, fine])
    assert outs[0].outputs[0].finish_reason == "error" and "no token can continue" in outs[0].error
    assert outs[1].outputs[0].finish_reason == "stop" and outs[1].outputs[0].text in ("yes", "no")


def test_a_bad_grammar_is_refused_before_any_work(tiny_model):
    """The engine compiles the grammar at add_request: an engine without a tokenizer refuses it there, queueing nothing."""
    from minipaged.engine import LLMEngine

    model, tok = tiny_model
    eng = LLMEngine(model, None)
    with pytest.raises(ValueError, match="tokenizer"):
        eng.add_request("0", [5, 6], SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"])))
    assert not eng.has_unfinished_requests()


def test_tiny_model_outputs_follow_the_grammar(tiny_model):
    model, tok = tiny_model
    llm = LLM(model, tok)
    outs = llm.generate(["hello", "the cat"], [_greedy(StructuredOutputsParams(regex=r"[a-c]{2,5}")),
                                               SamplingParams(temperature=1.0, seed=0, max_tokens=32,
                                                              structured_outputs=StructuredOutputsParams(choice=["cat", "dog"]))])
    a, b = outs[0].outputs[0], outs[1].outputs[0]
    assert re.fullmatch(r"[a-c]{2,5}", a.text) and a.finish_reason == "stop"
    assert b.text in ("cat", "dog") and b.finish_reason == "stop"


# -- over HTTP, through the official openai client ------------------------------------------------
@pytest.fixture(scope="module")
def api(smollm2):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from minipaged.engine import LLMEngine
    from minipaged.server.app import ServerConfig, create_app

    model, tok = smollm2
    app = create_app(lambda: LLMEngine(model, tok, max_num_seqs=4), ServerConfig(model_names=("smol",)))
    with TestClient(app) as http:
        yield http, openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)


def _ask(client, content, **kw):
    return client.chat.completions.create(model="smol", messages=[{"role": "user", "content": content}], temperature=0,
                                          max_tokens=64, **kw).choices[0]


@pytest.mark.slow
def test_server_response_format_and_structured_outputs(api):
    _, client = api
    obj = _ask(client, "Describe a cat as a JSON object.", response_format={"type": "json_object"})
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.message.content), dict)
    else:
        assert obj.message.content.lstrip().startswith("{")
    person = _ask(client, "Describe a person as JSON.",
                  response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    assert person.finish_reason == "stop" and set(json.loads(person.message.content)) == {"name", "age"}
    pick = _ask(client, "Is water wet?", extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert pick.message.content in ("yes", "no") and pick.finish_reason == "stop"
    old = client.completions.create(model="smol", prompt="Phone:", max_tokens=16, temperature=0,
                                    extra_body={"guided_regex": r"\d{3}-\d{4}"}).choices[0]
    assert re.fullmatch(r"\d{3}-\d{4}", old.text)


@pytest.mark.parametrize("extra, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}}, "objekt"),
    ({"structured_outputs": {"regex": "(ab"}}, "parenthesis"),
    ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "nowhere"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "exactly one"),
    ({"structured_outputs": {"chioce": ["a"]}}, "unknown key"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ({"response_format": {"type": "xml"}}, "xml"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "one of"),
])
def test_server_bad_structured_outputs_are_a_400_naming_the_error(api, extra, words):
    import openai

    _, client = api
    with pytest.raises(openai.BadRequestError, match=re.escape(words)):
        client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       extra_body=extra)


def test_server_tools_with_tool_choice_none_are_taken_and_auto_names_the_parser(api):
    import openai

    _, client = api
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}]
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                       tools=tools, tool_choice="none")
    assert r.choices[0].message.content is not None
    for choice in ("auto", None):
        kw = {"tool_choice": choice} if choice else {}
        with pytest.raises(openai.BadRequestError, match="tool parser") as e:
            client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                           tools=tools, **kw)
        assert "--tool-call-parser" in str(e.value)


def test_the_plan_names_the_grammar_backend(tiny_model):
    from minipaged.engine import LLMEngine

    model, tok = tiny_model
    route = LLMEngine(model, tok, num_blocks=32, block_size=4).plan.routes["structured_outputs"]
    assert route.startswith("xgrammar")


# -- the server's usage and /metrics (issue 39's other server statements) ---------------------------
def test_server_usage_counts_cached_prompt_tokens(api):
    _, client = api
    long = "Paged attention keeps keys and values in fixed-size blocks. " * 6
    first = client.completions.create(model="smol", prompt=long, max_tokens=2, temperature=0)
    second = client.completions.create(model="smol", prompt=long, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens, "the second request's full prompt blocks come from the prefix cache"


def test_metrics_have_the_engine_label_iteration_tokens_cache_info_and_every_reason(tiny_model):
    from prometheus_client.parser import text_string_to_metric_families
    from starlette.testclient import TestClient

    from minipaged.engine import LLMEngine
    from minipaged.server.app import ServerConfig, create_app

    model, tok = tiny_model
    app = create_app(lambda: LLMEngine(model, tok, num_blocks=64, block_size=4), ServerConfig(model_names=("tiny",)))
    with TestClient(app) as http:
        def families():
            return {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}

        fresh = families()
        reasons = {s.labels["finished_reason"] for s in fresh["vllm:request_success"].samples}
        assert reasons >= {"stop", "length", "abort", "error"}, "every finished_reason series is there before any request"
        assert all(s.labels.get("engine") == "0" for s in fresh["vllm:request_success"].samples)
        http.post("/v1/completions", json={"model": "tiny", "prompt": "Hello there", "max_tokens": 3, "temperature": 0})
        after = families()
        info = after["vllm:cache_config_info"].samples[0]
        assert info.value == 1 and info.labels["block_size"] == "4" and info.labels["num_gpu_blocks"] == "64"
        counts = [s for s in after["vllm:iteration_tokens_total"].samples if s.name.endswith("_count")]
        assert counts and counts[0].value >= 3, "one observation per engine step"


@pytest.mark.slow
def test_the_shipped_set_parses_every_output_that_finishes_with_stop(llm):
    from minipaged.bench.structured import parse_rate, shipped_set, valid

    assert len(shipped_set()) >= 10
    assert not valid({"regex": r"\d{3}"}, "12a") and not valid({"json": {"type": "object", "required": ["a"]}}, '{"b": 1}')
    rate = parse_rate(llm)
    assert rate["finished_with_stop"] >= rate["requests"] // 2, rate["rows"]
    assert rate["parse_rate"] == 1.0, [r for r in rate["rows"] if r["valid"] is False]


def test_a_complete_grammar_that_min_tokens_holds_back_ends_that_request_alone(tiny_model):
    """The grammar is complete and allows only EOS, which min_tokens holds back: no token can continue, so that
    request ends with an error naming why, and the request beside it finishes as it would alone."""
    model, tok = tiny_model
    llm = LLM(model, tok)
    held = SamplingParams(temperature=0, max_tokens=8, min_tokens=5,
                          structured_outputs=StructuredOutputsParams(choice=["cat"]))
    fine = _greedy(StructuredOutputsParams(choice=["cat", "dog"]), max_tokens=8)
    alone = llm.generate(["the cat"], [fine])[0].outputs[0]
    with pytest.warns(UserWarning, match="structured outputs"):
        outs = llm.generate(["hello", "the cat"], [held, fine])
    assert outs[0].outputs[0].finish_reason == "error"
    assert "min_tokens=5" in outs[0].error and "no token can continue" in outs[0].error
    assert outs[1].outputs[0].finish_reason == "stop" and outs[1].outputs[0].token_ids == alone.token_ids


def test_bench_structured_mask_cost_counts_the_masks_of_exactly_the_constrained_steps(tiny_model):
    """`minipaged bench structured`'s mask time on the tiny model: both runs decode the same steps (the
    regex cannot end before them), the mask time is counted only in the constrained run, and it is a
    part of that run's step, never more."""
    from minipaged.bench.structured import mask_cost

    llm = LLM(*tiny_model, max_num_seqs=4)
    rows = mask_cost(llm, batches=(1, 3), tokens=3)
    assert [r["batch"] for r in rows] == [1, 3] and all(r["tokens"] == 3 for r in rows)
    for r in rows:
        assert r["free_ms_per_step"] > 0 and r["structured_ms_per_step"] > 0
        assert 0 < r["mask_ms_per_step"] < r["structured_ms_per_step"] and 0 < r["mask_share"] < 1, r


def test_bench_structured_is_a_bench_command():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "minipaged", "bench", "structured", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--tokens" in r.stdout and "--out" in r.stdout, r.stderr
