"""genq's fused CPU small ops (kernels.cpu: the residual add with its RMSNorm, SiLU(gate) * up,
rotary in place) against the torch path of the modules they stand in for, bf16, on AVX-512 and
on the plain C++ loops: the same values (the norm's sum of squares, added in another order, may
round a few elements a bf16 step or two apart), and a model whose small ops run fused gives the
torch path's tokens."""

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu as cpu_kernels
from worker.model_executor.models.llama import MLP, RMSNorm, RotaryEmbedding, TableRope

BF16 = torch.bfloat16


def test_the_kernels_build_on_this_machine() -> None:
    """Every machine genq sets up on has a compiler: the kernels must load (a skip would hide it)."""
    assert cpu_kernels.load()


def isas() -> list[str]:
    return ["scalar", *(["avx512"] if " avx512bw " in open("/proc/cpuinfo").read() else [])]


def steps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements differ; each by at most two bf16 steps (asserted: a normalised value a
    step apart stays so or becomes two once multiplied by its weight and rounded again)."""
    diff = (a.float() - b.float()).abs()
    assert torch.all(diff <= torch.maximum(a.float().abs(), b.float().abs()) * 2**-6), diff.max()
    return int((a != b).sum())


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("tokens", [1, 37, 128])
@pytest.mark.parametrize("hidden", [64, 576, 100])  # (100: a tail past the last whole vector)
def test_add_rms_norm_is_the_torch_paths(isa: str, tokens: int, hidden: int) -> None:
    torch.manual_seed(tokens + hidden)
    norm = RMSNorm(hidden, 1e-5).to(BF16)
    norm.weight.data = torch.randn(hidden, dtype=BF16)
    x, residual = torch.randn(tokens, hidden, dtype=BF16) * 3, torch.randn(tokens, hidden, dtype=BF16)
    want_out, want_residual = norm(x, residual)
    cpu_kernels.add_rms_norm_(x, residual, norm.weight.data, 1e-5, isa=isa)
    assert torch.equal(residual, want_residual)
    assert steps_apart(x, want_out) <= max(2, x.numel() // 500)


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("shape", [(1, 64), (33, 1536), (128, 40)])
def test_silu_and_mul_is_the_torch_paths(isa: str, shape: tuple[int, int]) -> None:
    tokens, intermediate = shape
    torch.manual_seed(tokens)
    gate_up = torch.randn(tokens, 2 * intermediate, dtype=BF16) * 4
    gate, up = gate_up.clone().split(intermediate, dim=-1)
    want = F.silu(gate, inplace=True).mul_(up)
    got = cpu_kernels.silu_and_mul(gate_up, isa=isa)
    assert got.shape == (tokens, intermediate)
    assert steps_apart(got, want) <= max(1, got.numel() // 10_000)


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("head_dim", [16, 64, 128, 40])
def test_rope_in_place_is_the_torch_paths_on_a_strided_qkv(isa: str, head_dim: int) -> None:
    """q and k heads rotated where they lie in the projection's output (each token's row holds
    v after them), as the model hands them over."""
    tokens, heads, kv_heads = 29, 9, 3
    torch.manual_seed(head_dim)
    rotary = RotaryEmbedding(1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)), 1.0, 512)
    positions = torch.randint(0, 512, (tokens,))
    table = rotary.for_step(positions, BF16)
    assert isinstance(table, TableRope)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=BF16)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    want = table(qk, heads)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    cpu_kernels.rope_(qk, table.cos, table.sin, isa=isa)
    assert torch.equal(qk, want)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # (v untouched)


def test_bad_inputs_are_refused_naming_what() -> None:
    with pytest.raises(RuntimeError, match="x must be a bfloat16 CPU tensor"):
        cpu_kernels.add_rms_norm_(torch.ones(2, 8), torch.ones(2, 8), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="gate_up must be a contiguous"):
        cpu_kernels.silu_and_mul(torch.ones(2, 7, dtype=BF16))
    with pytest.raises(RuntimeError, match="cos and sin must be contiguous"):
        cpu_kernels.rope_(torch.ones(3, 2, 8, dtype=BF16), torch.ones(2, 8, dtype=BF16), torch.ones(3, 8, dtype=BF16))


def test_a_model_with_fused_small_ops_gives_the_torch_paths_tokens(tiny_llama_dir) -> None:
    """bf16 greedy decoding, the whole engine on the cpu backend (which turns the fused ops on),
    then the same engine with its modules back on torch's small ops."""
    from worker import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [5 + i, 17, 29, 41 + i, 8] * (1 + i)} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(tiny_llama_dir), dtype="bfloat16", attention_backend="cpu", max_model_len=96)
    modules = [m for m in llm.engine.runner.model.modules() if type(m) in (RMSNorm, MLP, RotaryEmbedding)]
    assert {type(m) for m in modules} == {RMSNorm, MLP, RotaryEmbedding} and all(m.cpu_fused for m in modules)
    fused = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for module in modules:
        module.cpu_fused = False
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == fused
