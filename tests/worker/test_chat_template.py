"""vLLM's --chat-template: a worker renders conversations with the template it is given (a
file's or the text itself) instead of its tokenizer's, and publishes that template with its
tokenizer for the API; one that is no file, or no Jinja, is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from producer.sampling_params import SamplingParams
from worker import LLM
from worker.queue.tokenizer import tokenizer_files

TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>>{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("as_file", [False, True])
def test_conversations_are_rendered_by_the_template_given(tiny_llama_dir: Path, tmp_path: Path, as_file: bool) -> None:
    given = str(tmp_path / "t.jinja") if as_file else TEMPLATE
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64, chat_template=given)
    out = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0]
    expected = "<<system>> Be brief.\n<<user>> Hi\n<<assistant>>"
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert out.prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)
    # what the worker publishes for the API renders alike
    published = tmp_path / "published"
    published.mkdir()
    for name, data in tokenizer_files(llm.get_tokenizer()).items():
        (published / name).write_bytes(data)
    assert AutoTokenizer.from_pretrained(published).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True) == expected


@pytest.mark.parametrize("given, message", [
    ("/no/such/template.jinja", "chat_template '/no/such/template.jinja' is no file"),
    ("{% for m in messages %}{{ m }}", "chat_template does not parse as Jinja"),
])
def test_a_template_that_cannot_be_read_is_refused_by_name(tiny_llama_dir: Path, given: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64, chat_template=given)
