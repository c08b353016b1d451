"""One Python forward: model/llama.py is what runs, on the table of ops the engine's plan chose.

- no module outside minipaged/model/ re-types the decoder layer (read from the source: no
  function calls a layer's projections or its MLP, or walks ``model.layers`` calling attention);
  the scan sees llama.py's own forward and the executor's old layer walk;
- a change planted in llama.py's MLP changes the greedy tokens of every route (plain, the C
  element-wise ops, the GGUF blocks layer by layer); the fused C decode does not follow it, and
  its bit-for-bit check against the Python forward on the same table then fails;
- the plan's routes are its table's: read from the ops, and each op computes what its route says;
- nothing under minipaged/cpu/ builds a plan.
"""
from __future__ import annotations

import ast
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minipaged.cpu import build, kernels
from minipaged.model import llama
from minipaged.model.ops import OP_NAMES, Op
from minipaged.plan import STAGES, TABLE_STAGES, Plan
from test_architecture import import_graph
from test_gguf_blocks import ALL_ON, gguf_model
from test_whole_step_decode import LAYERS, engine, run

needs_kernels = pytest.mark.skipif(build.library() is None, reason=f"no CPU kernels here: {build.info().get('why_not')}")
ROOT = Path(__file__).resolve().parents[1] / "minipaged"

# -- the only Python decoder forward is in model/ --------------------------------------------
PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
LAYER_PARTS = PROJECTIONS | {"mlp", "self_attn", "input_layernorm", "post_attention_layernorm"}
ATTENDS = {"forward", "attention", "paged_attention", "write_kv", "paged_decode"}


def _attr(node: ast.AST) -> str | None:
    return node.attr if isinstance(node, ast.Attribute) else None


def _mentions_layers(node: ast.AST) -> bool:
    return any(_attr(n) == "layers" for n in ast.walk(node))


def decoder_forwards(source: str) -> list[str]:
    """Functions of ``source`` that compute a decoder layer themselves: they call a layer's
    projection, MLP or norm (``a.q_proj(x)``), hand a projection to a kernel
    (``linear(a.q_proj, h)``), or loop over ``*.layers`` calling attention or the K/V write."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
        if any(_attr(c.func) in LAYER_PARTS for c in calls) or \
                any(_attr(a) in PROJECTIONS for c in calls for a in c.args):
            found.append(fn.name)
            continue
        loops = [n for n in ast.walk(fn) if isinstance(n, ast.For) and _mentions_layers(n.iter)]
        if any(_attr(c.func) in ATTENDS for loop in loops for c in ast.walk(loop) if isinstance(c, ast.Call)):
            found.append(fn.name)
    return found


OLD_LAYER_WALK = '''
def _layers(self, input_ids, positions, meta):
    model, backend = self.model, self.backend
    x = model.embed_tokens(input_ids)
    for layer, k_cache, v_cache in zip(model.layers, self.kv_cache.k, self.kv_cache.v):
        a, mlp = layer.self_attn, layer.mlp
        h = self._norm(layer.input_layernorm, x)
        q = self._linear(a.q_proj, h)
        backend.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        o = backend.forward(q, k_cache, v_cache, meta, a.scale)
    return x

def walk_by_attention_only(model, kv, meta, backend, q):
    for layer, k_cache, v_cache in zip(model.layers, kv.k, kv.v):
        q = backend.forward(q, k_cache, v_cache, meta, 1.0)
    return q

def hooks_only(net, hook):
    for layer in net.layers:
        for m in (layer.self_attn.o_proj, layer.mlp.down_proj):
            m.register_forward_hook(hook)
'''


def test_the_scan_sees_a_layer_walk_and_llamas_own_forward():
    assert decoder_forwards(OLD_LAYER_WALK) == ["_layers", "walk_by_attention_only"]
    own = decoder_forwards((ROOT / "model" / "llama.py").read_text())
    assert {"forward"} == set(own) and len(own) >= 3, own  # Attention, MLP and DecoderLayer's forwards


def test_the_only_python_decoder_forward_is_in_model():
    offenders = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "model":
            continue
        found = decoder_forwards(path.read_text())
        if found:
            offenders[str(rel)] = found
    assert not offenders, f"these re-type the decoder layer outside minipaged/model/ (use model.forward(ops=...)): {offenders}"


# -- a planted change to llama.py's MLP --------------------------------------------------------
def _planted_mlp(self, x, ops=llama.PLAIN_OPS):
    # SiLU on the up projection instead of the gate, and the output 100x: a bug loud enough to turn
    # the tiny model's greedy tokens (its MLP is a small share of the residual stream)
    return 100.0 * ops.linear(self.down_proj, ops.silu_mul(ops.linear(self.up_proj, x), ops.linear(self.gate_proj, x)))


ROUTES = {  # each route's settings and the step route its layer-by-layer steps take
    "plain": ({"fast_paths": False}, "model"),
    "c elementwise": ({"c_kernels": True, "gguf_blocks": False, "whole_step_decode": False,
                       "greedy_from_head": False}, "layers"),
    "gguf blocks": (LAYERS, "layers"),
}


def _tokens(eng, prompts):
    from minipaged.sampling import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in prompts]
    done = eng.run()
    return [done[i].token_ids for i in ids]


@needs_kernels
def test_a_planted_change_to_the_mlp_changes_every_route_but_the_fused_decode(monkeypatch):
    model = gguf_model(seed=5)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (3, 7, 12, 20)]
    before = {name: _tokens(engine(model, record_trace=True, **s), prompts) for name, (s, _) in ROUTES.items()}
    assert len({str(t) for t in before.values()}) == 1, before  # every route: the same tokens

    monkeypatch.setattr(llama.MLP, "forward", _planted_mlp)
    for name, (settings, route) in ROUTES.items():
        eng = engine(model, record_trace=True, **settings)
        after = _tokens(eng, prompts)
        assert {s.route.split("+")[0] for s in eng.trace.steps} == {route}, name
        assert after != before[name], f"{name}: the planted MLP did not change the tokens, so it does not run llama.py"

    # the fused C decode is the one route that does not read llama.py: its bit-for-bit check
    # against the Python forward on the same table (tests/test_whole_step_decode.py) fails
    whole, layers = engine(model, **ALL_ON), engine(model, **LAYERS)
    h1, _, r1 = run(whole, 5, seed=1)
    h2, _, r2 = run(layers, 5, seed=1)
    assert (r1, r2) == ("whole_step", "layers")
    assert not torch.equal(h1, h2)
    monkeypatch.undo()  # and with llama.py as it is, the check holds
    h3, _, _ = run(engine(model, **LAYERS), 5, seed=1)
    assert torch.equal(h1, h3)


# -- the plan's routes are its table ------------------------------------------------------------
def _plans(model):
    from minipaged.attention import reference

    def mine(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out=None):
        return reference.paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out)

    settings = [{"fast_paths": False}, {"attention": "torch"}, {"attention": mine}, {"c_kernels": False}]
    if build.library() is not None:
        settings += [ALL_ON, LAYERS, {"c_kernels": True, "gguf_blocks": False}]
    return [engine(model, **s).plan for s in settings]


def test_the_plans_routes_are_its_tables():
    model = gguf_model(seed=2)
    for plan in _plans(model):
        table = plan.ops.routes()
        assert set(table) == set(TABLE_STAGES), table
        assert {s: plan.routes[s] for s in TABLE_STAGES} == table
        assert set(plan.routes) == set(TABLE_STAGES) | set(plan.stages) and set(STAGES) <= set(plan.routes)
        for name in OP_NAMES:  # every entry of the table is an op that names its route
            assert isinstance(getattr(plan.ops, name), Op)
        # a table with another op is a plan with another route: the routes are read, never written
        mine = replace(plan.ops, linear=Op(plan.ops.linear.fn, {"linear": "mine"}))
        other = Plan(mine, plan.stages, plan.refused, plan.backend)
        assert other.routes["linear"] == "mine" and other.routes["elementwise"] == plan.routes["elementwise"]


@needs_kernels
def test_each_op_computes_what_its_route_names():
    model = gguf_model(seed=2)
    gguf, c_ops, plain = (engine(model, **s).plan for s in (ALL_ON, {"c_kernels": True, "gguf_blocks": False, "packed_gemm": False},
                                                             {"fast_paths": False}))
    m, x = model.layers[0].mlp.up_proj, torch.randn(3, model.config.hidden_size)
    assert gguf.routes["linear"].startswith("gguf")
    assert torch.equal(gguf.ops.linear(m, x), kernels.qmatmul(x, gguf.blocks[m]))
    assert c_ops.routes["linear"] == plain.routes["linear"] == "torch (F.linear)"
    assert torch.equal(c_ops.ops.linear(m, x), F.linear(x, m.weight)) and torch.equal(plain.ops.linear(m, x), m(x))
    norm = model.layers[0].post_attention_layernorm
    y = torch.randn_like(x)
    assert c_ops.routes["elementwise"].startswith("c ") and plain.routes["elementwise"] == "torch"
    h, r = c_ops.ops.add_rmsnorm(norm, x, y)
    r2 = x.clone()
    assert torch.equal(h, kernels.rmsnorm(y, norm.weight, norm.eps, residual=r2)) and torch.equal(r, r2)
    hp, rp = plain.ops.add_rmsnorm(norm, x, y)
    assert torch.equal(rp, x + y) and torch.equal(hp, norm(x + y))
    torch.testing.assert_close(h, hp, rtol=1e-5, atol=1e-6)


# -- the plan is engine-level ---------------------------------------------------------------------
def test_nothing_under_cpu_builds_a_plan():
    graph = import_graph()
    cpu = {n: t for n, t in graph.items() if n == "minipaged.cpu" or n.startswith("minipaged.cpu.")}
    assert "minipaged.cpu.kernels" in cpu and "minipaged.cpu.executor" not in cpu
    bad = {n: [t for t in targets if t in ("minipaged.plan", "minipaged.executor", "minipaged.engine")]
           for n, targets in cpu.items()}
    assert not any(bad.values()), f"minipaged/cpu/ holds kernels only; these import the plan or the engine: {bad}"
    for path in sorted((ROOT / "cpu").rglob("*.py")):
        defined = {n.name for n in ast.walk(ast.parse(path.read_text()))
                   if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
        assert not defined & {"Plan", "build_plan", "Executor", "make_executor"}, (path.name, defined)
    # the plan and the executor are the engine's, and read the kernels
    assert "minipaged.cpu.kernels" in graph["minipaged.executor"] and "minipaged.plan" in graph["minipaged.executor"]
    assert "minipaged.executor" in graph["minipaged.engine"] and "minipaged.model.ops" in graph["minipaged.plan"]


def test_the_speculative_batch_limit_is_the_plans():
    model = gguf_model(seed=2)
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    eng = engine(model, fast_paths=False, speculative_config=spec)
    from minipaged.spec_decode import CPU_DISABLE_BY_BATCH_SIZE

    assert eng.plan.speculative_batch_limit == eng.spec.disable_by_batch_size == CPU_DISABLE_BY_BATCH_SIZE
    eng = engine(model, fast_paths=False, speculative_config={**spec, "disable_by_batch_size": 3})
    assert eng.plan.speculative_batch_limit == eng.spec.disable_by_batch_size == 3
    assert "more than 3 running" in eng.plan.routes["speculative"]
    assert engine(model, fast_paths=False).plan.speculative_batch_limit is None


def test_prompt_logprobs_take_the_plans_table():
    """The extra pass of prompt_logprobs runs on the plan's table: its linear op computes the
    logits of every prompt position (a step computes them only for the rows it samples)."""
    from minipaged.sampling import SamplingParams

    model = gguf_model(seed=2)
    eng = engine(model, c_kernels=False)
    assert eng.plan.table and "this table" in eng.plan.routes["prompt_logprobs"]
    seen = []
    table = eng.plan.ops
    spy = replace(table, linear=Op(lambda m, x: seen.append((m, x.shape[0])) or table.linear(m, x), table.linear.routes))
    eng.executor.plan = replace(eng.plan, ops=spy)
    prompt = [5, 6, 7, 8, 9]
    rid = eng.add_request(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1))
    got = eng.run()[rid].prompt_logprobs
    assert (model.lm_head, len(prompt)) in seen
    plain = engine(model, fast_paths=False)
    assert "model's own forward" in plain.plan.routes["prompt_logprobs"]
    rid = plain.add_request(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1))
    want = plain.run()[rid].prompt_logprobs
    assert got[0] is None and want[0] is None
    for a, b in zip(got[1:], want[1:]):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


def test_the_scan_helpers_are_not_vacuous():
    src = textwrap.dedent('''
        def f(layer, h):
            return layer.mlp(h)
    ''')
    assert decoder_forwards(src) == ["f"]
