"""Prepacked oneDNN linears on CPU compute what F.linear computes: in bfloat16 exactly (the CPU
path's speed-up must not change a single bit of the model's output), in float32 to its
rounding (F.linear goes to MKL there, which sums in another order)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from worker import LLM
from worker.core.scheduler import ScheduledRequest, SchedulerOutput
from worker.model_executor.models.packed_linear import PackedLinear, can_pack

CPU = torch.device("cpu")
DTYPES = [
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not can_pack(CPU, torch.bfloat16), reason="no oneDNN bfloat16 on this CPU")),
    pytest.param(torch.float32, marks=pytest.mark.skipif(not can_pack(CPU, torch.float32), reason="no oneDNN in this torch")),
]


def assert_same(packed: torch.Tensor, plain: torch.Tensor, atol: float = 1e-5) -> None:
    """Bitwise in bfloat16; in float32, as close as two orders of summing are."""
    if packed.dtype == torch.bfloat16:
        assert torch.equal(packed, plain)
    else:
        torch.testing.assert_close(packed, plain, rtol=1.3e-6, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_rows", [1, 3, 8, 77, 300])
def test_packed_linear_is_f_linear(dtype, bias, num_rows):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias).to(dtype)
    packed = PackedLinear(linear, batch_hint=8)  # a hint unlike most of the row counts
    wide = torch.randn(num_rows, 2 * 96, dtype=dtype)
    with torch.inference_mode():
        for x in (wide[:, :96].contiguous(), wide[:, 96:]):  # strided rows, as after a split
            assert_same(packed(x), F.linear(x, linear.weight, linear.bias))


def _steps(tokens: list[list[int]], num_groups: int) -> list[SchedulerOutput]:
    """A prefill of each prompt, then one decode step of all of them (a hybrid model's
    windowed layers have a block table of their own: blocks 16 on)."""
    tables = [[4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3] for i in range(len(tokens))]
    more = [tuple([b + 16 * g for b in table] for g in range(1, num_groups)) for table in tables]
    prefill = [ScheduledRequest(str(i), ids, 0, tables[i], True, group_tables=more[i]) for i, ids in enumerate(tokens)]
    decode = [ScheduledRequest(str(i), [ids[-1]], len(ids), tables[i], True, group_tables=more[i])
              for i, ids in enumerate(tokens)]
    return [SchedulerOutput(prefill), SchedulerOutput(decode)]


# packing replaces every nn.Linear, whatever the family: these cover what differs among them
# (an untied head, q/k/v biases, biases on every projection, windowed layers' second KV group,
# linear attention's projections)
@pytest.mark.parametrize("tiny_model_dir", ["mistral", "qwen2", "ernie4_5", "gemma2", "qwen3_5"], indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_packs_every_linear_and_keeps_the_plain_models_logits(tiny_model_dir, dtype):
    """The engine's CPU model has no plain nn.Linear left, and its logits over a prefill and
    a decode step equal (bit for bit in bfloat16) those of the same checkpoint loaded
    without packing."""
    # (the torch backend: the cpu one's fused small ops sum a bf16 norm's squares in another order)
    llm = LLM(str(tiny_model_dir), dtype=str(dtype).removeprefix("torch."), num_gpu_blocks_override=64,
              attention_backend="torch")
    runner = llm.engine.runner
    assert not any(type(m) is nn.Linear for m in runner.model.modules())
    num_packed = sum(type(m) is PackedLinear for m in runner.model.modules())
    torch.manual_seed(2)
    steps = _steps([torch.randint(3, 49152, (n,)).tolist() for n in (5, 23, 40)], len(runner.kv_layout))
    packed = [runner.execute(step).logits for step in steps]
    runner.model = runner._load_model(Path(tiny_model_dir), use_kernels=False)  # the same weights, unpacked
    # every linear layer was packed: four a layer and the head, or Qwen3.5's linear attention's five
    assert sum(type(m) is nn.Linear for m in runner.model.modules()) == num_packed >= 4 * len(runner.model.layers) + 1
    plain = [runner.execute(step).logits for step in steps]
    for a, b in zip(packed, plain, strict=True):
        assert_same(a, b, atol=2e-4)  # float32 rounding, through every layer (Qwen3.5 has four)
