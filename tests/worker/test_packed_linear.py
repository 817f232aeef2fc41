"""Prepacked oneDNN linears (bfloat16 on CPU) compute exactly what F.linear computes: the CPU
path's speed-up must not change a single bit of the model's output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from worker import LLM
from worker.models.packed_linear import PackedLinear, can_pack
from worker.scheduler import ScheduledRequest, SchedulerOutput

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not can_pack(CPU, torch.bfloat16), reason="no oneDNN bfloat16 on this CPU")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_rows", [1, 3, 8, 77, 300])
def test_packed_linear_is_f_linear_bitwise(bias, num_rows):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(linear, batch_hint=8)  # a hint unlike most of the row counts
    wide = torch.randn(num_rows, 2 * 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        for x in (wide[:, :96].contiguous(), wide[:, 96:]):  # strided rows, as after a split
            assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))


def _steps(tokens: list[list[int]], num_groups: int) -> list[SchedulerOutput]:
    """A prefill of each prompt, then one decode step of all of them (a hybrid model's
    windowed layers have a block table of their own: blocks 16 on)."""
    tables = [[4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3] for i in range(len(tokens))]
    more = [tuple([b + 16 * g for b in table] for g in range(1, num_groups)) for table in tables]
    prefill = [ScheduledRequest(str(i), ids, 0, tables[i], True, group_tables=more[i]) for i, ids in enumerate(tokens)]
    decode = [ScheduledRequest(str(i), [ids[-1]], len(ids), tables[i], True, group_tables=more[i])
              for i, ids in enumerate(tokens)]
    return [SchedulerOutput(prefill), SchedulerOutput(decode)]


def test_engine_packs_every_linear_and_keeps_the_plain_models_logits(tiny_model_dir):
    """All four tiny families (q/k/v biases, tied and untied heads): the engine's bf16 CPU
    model has no plain nn.Linear left, and its logits over a prefill and a decode step equal,
    bit for bit, those of the same checkpoint loaded without packing."""
    llm = LLM(str(tiny_model_dir), dtype="bfloat16", num_gpu_blocks_override=64)
    runner = llm.engine.runner
    assert not any(type(m) is nn.Linear for m in runner.model.modules())
    assert sum(type(m) is PackedLinear for m in runner.model.modules()) == 4 * runner.model_config.num_hidden_layers + 1
    torch.manual_seed(2)
    steps = _steps([torch.randint(3, 49152, (n,)).tolist() for n in (5, 23, 40)], len(runner.kv_layout))
    packed = [runner.execute(step).logits for step in steps]
    runner.model = runner._load_model(Path(tiny_model_dir), use_kernels=False)  # the same weights, unpacked
    assert any(type(m) is nn.Linear for m in runner.model.modules())
    plain = [runner.execute(step).logits for step in steps]
    for a, b in zip(packed, plain, strict=True):
        assert torch.equal(a, b)
