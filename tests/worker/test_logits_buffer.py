"""The LM head's output for more rows than one malloc heap block holds goes into a buffer kept
across steps, written chunk by chunk: each call's logits equal the head over the whole batch,
bit for bit, whatever row counts come one after another."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from worker.model_executor.models.logits_buffer import HEAP_BLOCK_BYTES, LogitsBuffer
from worker.model_executor.models.packed_linear import PackedLinear, can_pack

CPU = torch.device("cpu")
VOCAB = 49152  # 170 float32 rows fit one heap block
HEADS = [
    pytest.param("plain", torch.float32),
    pytest.param("packed", torch.float32, marks=pytest.mark.skipif(not can_pack(CPU, torch.float32), reason="no oneDNN")),
    pytest.param("packed", torch.bfloat16,
                 marks=pytest.mark.skipif(not can_pack(CPU, torch.bfloat16), reason="no oneDNN bfloat16 on this CPU")),
]


@pytest.mark.parametrize(("kind", "dtype"), HEADS)
def test_buffered_logits_equal_the_heads_and_are_reused(kind, dtype):
    torch.manual_seed(0)
    linear = nn.Linear(64, VOCAB, bias=False).to(dtype)
    head = PackedLinear(linear, batch_hint=256) if kind == "packed" else linear
    buffer = LogitsBuffer()
    assert HEAP_BLOCK_BYTES // (VOCAB * 4) == 170
    seen = []
    with torch.inference_mode():
        for rows in (300, 171, 100, 513):  # chunked, chunked again in the same buffer, fresh, grown
            hidden = torch.randn(rows, 64, dtype=dtype)
            logits = buffer.logits(head, hidden, VOCAB)
            assert logits.dtype == torch.float32 and logits.shape == (rows, VOCAB)
            assert torch.equal(logits, head(hidden).float()), rows
            seen.append(logits.data_ptr())
    assert seen[1] == seen[0]  # the second step's logits are written where the first's were
    assert buffer.capacity_rows == 513
