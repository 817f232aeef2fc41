"""GGUF checkpoints served from the file: a tiny random Llama written with the `gguf` package
(weights in several of llama.cpp's quantized types, a small byte-level BPE tokenizer and a
chat template in its metadata), against transformers reading the same file."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from producer.sampling_params import SamplingParams
from worker import LLM
from worker.model_executor.model_loader import gguf_dtype, gguf_target, resolve_model_path

HIDDEN, FFN, LAYERS = 64, 128, 2
PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3,"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s")]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: each byte as the character its BPE spells it with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelled[byte] = chr(byte)
        else:
            spelled[byte], extra = chr(256 + extra), extra + 1
    return [spelled[b] for b in range(256)]


VOCAB = [*byte_tokens(), *(a + b for a, b in MERGES), *SPECIALS]


def write_tiny_gguf(path: Path, tied: bool = True) -> Path:
    """A two-layer Llama in GGUF: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and F16 weights, the norms in
    F32, a byte-level BPE tokenizer (gpt2, as llama.cpp names it) of VOCAB and a chat
    template; its LM head tied to the embedding unless `tied` is False."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(1024)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(HIDDEN // 4)
    writer.add_vocab_size(len(VOCAB))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(VOCAB)
    writer.add_token_types([1] * (len(VOCAB) - len(SPECIALS)) + [3] * len(SPECIALS))
    writer.add_token_merges([f"{a} {b}" for a, b in MERGES])
    writer.add_bos_token_id(VOCAB.index("<|endoftext|>"))
    writer.add_eos_token_id(VOCAB.index("<|im_end|>"))
    writer.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(0)

    def add(name: str, shape: tuple[int, ...], kind: Q = Q.F32, scale: float = 0.3, mean: float = 0.0) -> None:
        values = (mean + rng.standard_normal(shape) * scale).astype(np.float32)
        if kind == Q.F32:
            writer.add_tensor(name, values)
        elif kind == Q.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)

    add("token_embd.weight", (len(VOCAB), HIDDEN), Q.Q8_0, scale=1.0)  # peaky logits: greedy picks no near-ties
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,), scale=0.1, mean=1.0)
        add(f"blk.{i}.attn_q.weight", (HIDDEN, HIDDEN), Q.Q8_0)
        add(f"blk.{i}.attn_k.weight", (HIDDEN // 2, HIDDEN), Q.Q4_0)
        add(f"blk.{i}.attn_v.weight", (HIDDEN // 2, HIDDEN), Q.Q4_1)
        add(f"blk.{i}.attn_output.weight", (HIDDEN, HIDDEN), Q.Q5_0)
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,), scale=0.1, mean=1.0)
        add(f"blk.{i}.ffn_gate.weight", (FFN, HIDDEN), Q.Q8_0)
        add(f"blk.{i}.ffn_up.weight", (FFN, HIDDEN), Q.F16)
        add(f"blk.{i}.ffn_down.weight", (HIDDEN, FFN), Q.Q5_1)
    add("output_norm.weight", (HIDDEN,), scale=0.1, mean=1.0)
    if not tied:
        add("output.weight", (len(VOCAB), HIDDEN), Q.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory) -> str:
    """Where this module's GGUF files are converted (each once)."""
    return str(tmp_path_factory.mktemp("gguf-cache"))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q8_0.gguf")


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_gguf_file_is_served_as_transformers_reads_it(tied, tiny_gguf, gguf_cache, tmp_path):
    gguf_file = tiny_gguf if tied else write_tiny_gguf(tmp_path / "untied.gguf", tied=False)
    llm = LLM(str(gguf_file), cache_dir=gguf_cache, dtype="float32", num_gpu_blocks_override=64)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        expected = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
        assert out.outputs[0].token_ids == expected.tolist()
    # converted into the cache, in float32 (every quantized value exactly)
    converted = resolve_model_path(str(gguf_file), gguf_cache)
    assert llm.engine.model_path == converted == gguf_target(gguf_file, Path(gguf_cache))
    assert json.loads((converted / "config.json").read_text())["torch_dtype"] == "float32"
    # the tokenizer and chat template are the file's, as transformers reads them
    file_tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    assert llm.get_tokenizer()(PROMPTS[0]).input_ids == file_tokenizer(PROMPTS[0]).input_ids
    assert llm.get_tokenizer().chat_template == CHAT_TEMPLATE


def test_a_conversion_is_kept_until_the_file_changes(tiny_gguf, gguf_cache):
    first = resolve_model_path(str(tiny_gguf), gguf_cache)
    written = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path(str(tiny_gguf), gguf_cache) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == written  # not converted again
    # a directory holding one GGUF file (and no config.json) means that file
    assert resolve_model_path(str(tiny_gguf.parent), gguf_cache) == first
    stat = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file replaced, say
    try:
        assert gguf_target(tiny_gguf, Path(gguf_cache)) != first
    finally:
        os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_large_checkpoints_are_widened_to_bfloat16(tmp_path):
    gguf_file = write_tiny_gguf(tmp_path / "model.gguf")
    assert gguf_dtype(gguf_file) == torch.float32
    assert gguf_dtype(gguf_file, float32_bytes=1 << 16) == torch.bfloat16


def test_bad_gguf_paths_are_refused_by_name(tmp_path):
    two = tmp_path / "two"
    two.mkdir()
    gguf_file = write_tiny_gguf(two / "a.gguf")
    shutil.copy(gguf_file, two / "b.gguf")
    with pytest.raises(ValueError, match="holds 2 GGUF files"):
        resolve_model_path(str(two), str(tmp_path / "cache"))
    split = tmp_path / "model-00001-of-00002.gguf"
    shutil.copy(gguf_file, split)
    with pytest.raises(ValueError, match="split GGUF"):
        resolve_model_path(str(split), str(tmp_path / "cache"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="junk.gguf"):
        resolve_model_path(str(junk), str(tmp_path / "cache"))
    assert not list((tmp_path / "cache" / "models" / "gguf").iterdir())  # nothing half-written kept


def test_the_tokenizer_argument_replaces_the_models(tiny_gguf, gguf_cache, tmp_path):
    """vLLM's advice for GGUF: the base model's tokenizer, whose chat template then renders
    the prompts (here the file's tokenizer saved with another template)."""
    own = LLM(str(tiny_gguf), cache_dir=gguf_cache, dtype="float32", num_gpu_blocks_override=64)
    base = tmp_path / "base-tokenizer"
    own.get_tokenizer().save_pretrained(base)
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    config = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    (base / "chat_template.jinja").unlink(missing_ok=True)
    other = LLM(str(tiny_gguf), cache_dir=gguf_cache, dtype="float32", num_gpu_blocks_override=64, tokenizer=str(base))
    assert other.get_tokenizer().name_or_path == str(base)
    messages = [{"role": "user", "content": "hi"}]
    assert other.engine.inputs.apply_chat_template(messages, add_generation_prompt=False)["prompt"] == "[user] hi\n"
    assert own.engine.inputs.apply_chat_template(messages, add_generation_prompt=False)["prompt"] == (
        "<|im_start|>user\nhi<|im_end|>\n")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert ([o.outputs[0].token_ids for o in other.generate(PROMPTS, params, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in own.generate(PROMPTS, params, use_tqdm=False)])
    with pytest.raises(ValueError, match="tokenizer '/nowhere'"):
        LLM(str(tiny_gguf), cache_dir=gguf_cache, tokenizer="/nowhere")
