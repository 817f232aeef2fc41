"""Tokenizers read once per directory and process (worker.model_executor.tokenizer_loader): each engine gets
its own copy, as transformers reads it, and a directory whose files were written since is
read again."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from transformers import AutoTokenizer

from worker import LLM
from worker.model_executor.tokenizer_loader import load_tokenizer

TEXT = "Hello, <|im_start|> world 12345 ünïcödé"
MESSAGES = [{"role": "user", "content": "Hi there"}]


def test_each_engine_has_its_own_copy_as_transformers_reads_it(tiny_llama_dir: Path) -> None:
    oracle = AutoTokenizer.from_pretrained(tiny_llama_dir)
    first, second = load_tokenizer(None, tiny_llama_dir), load_tokenizer(None, tiny_llama_dir)
    for tokenizer in (first, second):
        ids = tokenizer.encode(TEXT)
        assert ids == oracle.encode(TEXT) and tokenizer.decode(ids) == oracle.decode(ids)
        assert tokenizer.all_special_ids == oracle.all_special_ids
    second.chat_template = "{{ messages[0]['content'] }}"
    assert first.apply_chat_template(MESSAGES, tokenize=False) == oracle.apply_chat_template(MESSAGES, tokenize=False)
    # an engine that sets its own chat template leaves the next one the model's
    templated = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64,
                    chat_template="{{ messages[0]['content'] }}!")
    plain = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64)
    assert templated.get_tokenizer().chat_template == "{{ messages[0]['content'] }}!"
    assert plain.get_tokenizer().chat_template == oracle.chat_template


def test_a_directory_written_since_is_read_again(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    before = load_tokenizer(None, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 77}))
    assert load_tokenizer(None, model).model_max_length == 77 == AutoTokenizer.from_pretrained(model).model_max_length
    assert before.model_max_length != 77
