"""Our paged model against transformers on the same weights: logits close, greedy tokens equal.

Tiny random Llama and Qwen2 (attention bias) models check prefill, decode, chunked prefill and
packed batches at block sizes 1 and 16; the real SmolLM2 checks the GGUF path end to end.
"""
from __future__ import annotations

import pytest
import torch

from conftest import assert_logits_close, run_paged, tiny_hf_model
from minipaged.model import LlamaConfig, LlamaModel


def ours_from(hf) -> LlamaModel:
    config = LlamaConfig.from_hf_dict(hf.config.to_dict(), name=type(hf).__name__)
    model = LlamaModel(config)
    model.load_hf_state_dict(hf.state_dict())
    return model.eval()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # (T, vocab): one causal forward, no cache


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    hf = tiny_hf_model(request.param, vocab_size=300, seed=1)
    return hf, ours_from(hf)


def test_config_from_hf(pair):
    hf, ours = pair
    c, h = ours.config, hf.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        h.num_hidden_layers, h.num_attention_heads, h.num_key_value_heads, h.head_dim,
    )
    assert c.rope_theta == 5000.0
    assert c.attention_bias == (h.model_type == "qwen2")
    if c.attention_bias:  # the bias is really there and really random, so the test exercises it
        assert ours.layers[0].self_attn.q_proj.bias.abs().sum() > 0


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(
    "chunks",
    [None, [12], [5, 7], [3, 4, 5]],
    ids=["prefill", "prefill+decode", "2-chunk-prefill+decode", "3-chunk-prefill+decode"],
)
def test_tiny_paged_matches_transformers(pair, block_size, chunks):
    hf, ours = pair
    ids = random_ids(20, 300, seed=2)
    got = run_paged(ours, ids, block_size=block_size, chunks=chunks)
    assert_logits_close(got, hf_logits(hf, ids), what=f"{hf.config.model_type} chunks={chunks} block={block_size}")


@pytest.mark.parametrize("block_size", [1, 16])
def test_tiny_packed_batch_matches_transformers(pair, block_size):
    """Three sequences in one flat batch; in step 2 one decodes while another takes an 8-token chunk."""
    hf, ours = pair
    seqs = [random_ids(n, 300, seed=10 + n) for n in (18, 13, 25)]
    plans = [[10], [2, 8], [25]]
    got = run_paged(ours, seqs, block_size=block_size, chunks=plans)
    for s, (ids, g) in enumerate(zip(seqs, got)):
        assert_logits_close(g, hf_logits(hf, ids), what=f"{hf.config.model_type} sequence {s}")


def test_tied_embeddings():
    hf = tiny_hf_model("llama", vocab_size=300, tie=True, seed=3)
    ours = ours_from(hf)
    assert ours.lm_head.weight is ours.embed_tokens.weight
    assert "lm_head.weight" not in dict(ours.named_parameters())
    ids = random_ids(9, 300, seed=4)
    assert_logits_close(run_paged(ours, ids, chunks=[4]), hf_logits(hf, ids), what="tied")


def test_compute_logits_only_given_rows(pair):
    hf, ours = pair
    hidden = torch.randn(3, ours.config.hidden_size)
    logits = ours.compute_logits(hidden)
    assert logits.shape == (3, 300) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf.lm_head(hidden).detach())


def test_load_hf_state_dict_reports_missing_and_wrong_shape(pair):
    hf, ours = pair
    sd = dict(hf.state_dict())
    sd.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(KeyError, match=r"missing \['layers\.1\.mlp\.up_proj\.weight'\]"):
        LlamaModel(ours.config).load_hf_state_dict(sd)
    sd = dict(hf.state_dict())
    sd["model.norm.weight"] = torch.ones(7)
    with pytest.raises(ValueError, match=r"norm\.weight: expected shape \(64,\), got \(7,\)"):
        LlamaModel(ours.config).load_hf_state_dict(sd)


# ----- the real SmolLM2-135M-Instruct from its GGUF ----------------------------------------------


@pytest.mark.slow
def test_smollm2_config_matches_transformers(smollm2, hf_smollm2):
    c, h = smollm2[0].config, hf_smollm2.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.vocab_size) == (
        h.num_hidden_layers, h.hidden_size, h.num_attention_heads, h.num_key_value_heads, h.head_dim,
        h.intermediate_size, h.vocab_size,
    )
    assert c.rope_theta == h.rope_parameters["rope_theta"] and c.tie_word_embeddings == h.tie_word_embeddings
    assert c.rms_norm_eps == pytest.approx(h.rms_norm_eps)


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [16, 1])
def test_smollm2_prefill_and_decode_match_transformers(smollm2, hf_smollm2, block_size):
    """Transformers generates greedily; our paged model, fed the same tokens (prefill then one token a
    step), must give close logits at every position and pick the same next token at every step."""
    model, tok = smollm2
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three primary colours."}]))
    with torch.no_grad():
        out = hf_smollm2.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0].tolist()
    generated = out[len(prompt):]
    full = out[:-1]  # every token whose next-token logits we compare
    got = run_paged(model, full, block_size=block_size, chunks=[len(prompt)])
    assert_logits_close(got, hf_logits(hf_smollm2, full), rtol=1e-4, what=f"SmolLM2 block={block_size}")
    ours_greedy = got[len(prompt) - 1 :].argmax(-1).tolist()
    assert ours_greedy == generated, f"greedy tokens: ours {ours_greedy}, transformers {generated}"


@pytest.mark.slow
def test_smollm2_chunked_prefill_matches_one_shot(smollm2, hf_smollm2):
    model, tok = smollm2
    ids = tok.encode("Paged attention keeps the KV cache in blocks, so memory is reserved only as it is used.")
    got = run_paged(model, ids, block_size=16, chunks=[7, 9])
    assert_logits_close(got, hf_logits(hf_smollm2, ids), rtol=1e-4, what="SmolLM2 chunked")
