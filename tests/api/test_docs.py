"""What the docs tell a user to paste runs as written (tests/docs_support.py reads it from
the markdown, so a new or changed snippet is tested as it stands):

- the README's Python client quickstart, in a fresh interpreter against the live stack (the session's
  Redis and worker on the tiny Llama; only the Redis URL differs);
- docs/engine.md's offline quickstart, on the tiny Llama: the default model's name and the trainer's
  checkpoint path are the tiny model's, the KV pool is small, `trainer_model` is transformers'
  model of it; the rest as pasted;
- every `genq` command line in README.md, docs/*.md, docker-compose.yml and the Dockerfile:
  its command answers --help, and every flag the line names is one it takes.

The `arq` command lines are tests/queue/test_queue_docs.py's.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from docs_support import ENGINE_DOC, ROOT, Command, command_lines, marked_block

from producer.cli import main as genq
from producer.protocol import JobStatus

SNIPPET_TIMEOUT_S = 60.0
WORD = re.compile(r"[a-z][a-z0-9_-]*")  # a subcommand, or a positional argument shown as a plain word


def substitute(code: str, old: str, new: str) -> str:
    """`old` replaced, once: a snippet that changed fails here, never loads something else."""
    assert code.count(old) == 1, f"the snippet no longer holds {old!r} once:\n{code}"
    return code.replace(old, new)


# -- the client quickstart ------------------------------------------------------------------

# After the snippet, in the same interpreter: what it left, for the test to check.
CLIENT_EPILOGUE = """
import json
print("\\n" + json.dumps({
    "job": job.id, "text": job.result().text, "finish_reason": job.result().finish_reason,
    "results": [[r.status, len(r.token_ids)] for r in results],
    "norm": sum(x * x for x in vector) ** 0.5,
}))
"""


def test_the_client_quickstart_runs_against_a_live_worker(live_worker: str) -> None:
    code = substitute(marked_block("client-quickstart"), '"redis://127.0.0.1:6379/0"', repr(live_worker))
    done = subprocess.run([sys.executable, "-c", code + CLIENT_EPILOGUE], cwd=ROOT, capture_output=True,
                          text=True, timeout=SNIPPET_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    printed, last_line = done.stdout.rstrip("\n").rsplit("\n", 1)
    left = json.loads(last_line)
    assert left["job"] == "greeting-1"
    # the stream printed the whole text, then the result's finish reason
    assert printed == left["text"] + left["finish_reason"] + "\n" and left["text"]
    assert left["results"] and all(status == JobStatus.FINISHED and n > 0 for status, n in left["results"])
    assert left["norm"] == pytest.approx(1.0, abs=1e-3)  # the embedding, normalized


# -- the offline quickstart -----------------------------------------------------------------

def test_the_offline_quickstart_runs_on_the_tiny_model(tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = repr(str(tiny_llama_dir))
    code = marked_block("offline-quickstart", ENGINE_DOC)
    # the default KV pool (2 GiB on the CPU) would cost seconds to allocate, for nothing here
    code = substitute(code, "LLM()", f"LLM({model}, num_gpu_blocks_override=256)")
    code = substitute(code, '"/ckpt/step-200"', model)  # a checkpoint of the same model
    namespace: dict[str, Any] = {"trainer_model": AutoModelForCausalLM.from_pretrained(tiny_llama_dir)}
    exec(compile(code, "docs/engine.md (offline-quickstart)", "exec"), namespace)
    outs = namespace["outs"]
    assert len(outs) == 2
    for out in outs:
        assert 0 < len(out.outputs[0].token_ids) <= 32 and out.outputs[0].finish_reason in ("length", "stop")


# -- genq command lines ---------------------------------------------------------------------

def genq_commands() -> dict[tuple[str, ...], list[Command]]:
    """The documented command lines by the command they run: the leading plain words
    (`genq keys create acme ...` runs ("keys", "create", "acme"), which --help answers alike)."""
    by_command: dict[tuple[str, ...], list[Command]] = {}
    for line in command_lines("genq"):
        words = line.text.split()[1:]
        command = tuple(_leading(words))
        by_command.setdefault(command, []).append(line)
    return by_command


def _leading(words: list[str]) -> list[str]:
    out: list[str] = []
    for word in words:
        if not WORD.fullmatch(word):
            break
        out.append(word)
    return out


GENQ_COMMANDS = genq_commands()


@pytest.mark.parametrize("command", sorted(GENQ_COMMANDS), ids=lambda c: " ".join(("genq", *c)))
def test_each_documented_genq_command_line_answers_help_with_its_flags(
    command: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        genq([*command, "--help"])
    shown = capsys.readouterr()
    assert exited.value.code == 0, shown.err
    for line in GENQ_COMMANDS[command]:
        unknown = [f for f in line.flags if not re.search(rf"(?<![\w-]){f}(?![\w-])", shown.out)]
        assert unknown == [], f"{line.where}: `{line.text}` names flags `genq {' '.join(command)}` lacks"


def test_the_genq_console_script_runs() -> None:
    script = Path(sys.executable).parent / "genq"
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S)
    assert done.returncode == 0 and "usage: genq" in done.stdout, done.stderr
