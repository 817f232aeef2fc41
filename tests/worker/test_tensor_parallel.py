"""Tensor parallelism on CPU: two ranks (rank 0 in the test's process, rank 1 spawned) over a
gloo group decode as transformers does, and the split is refused by name where it cannot be
made. The CUDA path (NCCL, a GPU per rank) is the same code with another group."""

from __future__ import annotations

import functools
import gc
import multiprocessing
import os
import shutil
import signal
import threading
import time

import pytest
import torch
from test_engine import (
    PROMPTS,
    check_prefill_logits_against,
    greedy,
    hf_greedy_along,
    run_and_compare,
)
from test_gptq_awq import write_checkpoint
from test_quantization import BLOCK, write_fp8_checkpoint, write_per_channel_checkpoint

from producer.sampling_params import SamplingParams
from worker import LLM
from worker.config import EngineConfig
from worker.model_executor.model_loader import iter_safetensors
from worker.model_executor.models.config import ModelConfig
from worker.model_executor.models.llama import LlamaForCausalLM
from worker.model_executor.models.moe import Experts
from worker.model_executor.models.quant import QuantLinear
from worker.model_executor.tensor_parallel import shard_weights


def split_llm(model_dir, **kwargs) -> LLM:
    return LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=256, num_threads=1,
               tensor_parallel_size=2, **kwargs)


# ernie4_5: biases on every projection (o_proj's and down_proj's added once over the ranks)
# and q/k rows reordered for its interleaved RoPE; phi3: q/k/v and gate/up fused in the
# checkpoint, a partial rotary; qwen3: a head_dim of its own, per-head q/k norms, two query
# heads per KV head on each rank; olmo2: q and k normed over whole projections, each rank's
# sums of squares summed over the ranks; qwen2_moe: every expert split, and the gated shared
# expert; granitemoe: experts stacked in the checkpoint; deepseek_v2 and _v3: latent
# attention's heads split, its latent cache whole on both ranks (V3's queries through a low
# rank, with interleaved RoPE; DeepSeek-V3's routing on whole router weights, shared experts
# and a dense first layer); gpt_oss: a sink logit per head, biases on the experts (down_proj's
# added once) and interleaved gate/up; minimax_m2: whole-projection q/k norms (as olmo2's) over
# experts routed by sigmoid scores and a bias. (One KV head that both ranks keep: the GPTQ case below.
# Llama 4's split, experts stacked inputs first, is Qwen3-VL-MoE's Hub layout's, below.)
@pytest.mark.parametrize("family", ["ernie4_5", "phi3", "qwen3", "olmo2", "qwen2_moe", "granitemoe", "deepseek_v2",
                                    "deepseek_v3", "gpt_oss", "minimax_m2"])
def test_a_split_model_decodes_as_transformers(family, tiny_family):
    model_dir = tiny_family(family)
    llm = split_llm(model_dir)
    local = llm.engine.runner.local
    assert (local.model_config.num_attention_heads, local.model_config.num_key_value_heads) == (2, 1)
    if local.model_config.moe is not None:  # half of every expert's features
        whole = ModelConfig.from_hf(local.model_config.hf_config)
        assert local.model_config.moe.intermediate_size * 2 == whole.moe.intermediate_size
    assert local.kv_caches[0][0].shape[1] == 1  # [blocks, KV heads, ...]: this rank's KV head only
    run_and_compare(llm, model_dir)
    (rank1,) = llm.engine.runner.processes
    del llm, local
    gc.collect()
    assert not rank1.is_alive() and rank1.exitcode == 0  # the other ranks stop with the engine


# expert parallelism: qwen2_moe (8 experts, 4 a rank, beside the gated shared expert, split by
# its features); gpt_oss (stacked experts, their biases added by the rank that holds each);
# deepseek_v3 (sigmoid routing within groups, whole on both ranks); nemotron_3_latent (experts
# without a gate, in the latent space); llama4 (the token weighed going into its one expert);
# mixtral (w1, w3, w2 per expert); granitemoe (stacked as input_linear and output_linear)
@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss", "deepseek_v3", "nemotron_3_latent", "llama4", "mixtral",
                                    "granitemoe"])
def test_experts_dealt_out_whole_decode_as_transformers(family, tiny_family):
    model_dir = tiny_family(family)
    llm = split_llm(model_dir, enable_expert_parallel=True)
    local = llm.engine.runner.local
    moe, whole = local.model_config.moe, ModelConfig.from_hf(local.model_config.hf_config).moe
    assert (moe.intermediate_size, 2 * moe.num_local_experts) == (whole.intermediate_size, whole.num_experts)
    experts = next(m for m in local.model.modules() if isinstance(m, Experts))
    assert experts.num_experts == whole.num_experts // 2 and experts.intermediate_size == whole.intermediate_size
    run_and_compare(llm, model_dir)


def test_experts_dealt_out_whole_on_the_kernel_path(tiny_family):
    """The fused MoE kernel on each rank's experts: pairs routed to the other rank's experts
    (an id past this rank's last) add nothing. Prefill logits equal transformers'."""
    model_dir = tiny_family("qwen2_moe")
    check_prefill_logits_against(model_dir, model_dir, "triton", {"tensor_parallel_size": 2, "num_threads": 1,
                                                                  "enable_expert_parallel": True})


def test_an_expert_kept_float_is_named_by_its_own_id_on_every_rank(tiny_family, tmp_path):
    """Qwen3-MoE's experts in fp8, but expert 4 of the first layer kept float: rank 1 holds
    experts 3 to 5, and reads "experts.4" as its second (not as a fourth it does not have),
    keeping that layer's experts float. Prefill logits equal transformers'."""
    from safetensors.torch import load_file, save_file

    from worker.model_executor.models.quant import dequantize

    fp8 = write_fp8_checkpoint(tiny_family("qwen3_moe"), tmp_path / "q", BLOCK, ("model.layers.0.mlp.experts.4",))
    stored = load_file(fp8 / "model.safetensors")  # the oracle: its values times their scales, for transformers
    dense = {name: dequantize(t, stored[name + "_scale_inv"], BLOCK) if t.dtype == torch.float8_e4m3fn else t
             for name, t in stored.items() if not name.endswith("_scale_inv")}
    shutil.copytree(tiny_family("qwen3_moe"), tmp_path / "oracle")
    save_file(dense, tmp_path / "oracle" / "model.safetensors")
    check_prefill_logits_against(fp8, tmp_path / "oracle", "torch", {"tensor_parallel_size": 2, "num_threads": 1,
                                                                     "enable_expert_parallel": True})


def test_experts_dealt_out_whole_split_at_no_block(tiny_family, tmp_path):
    """Qwen3-MoE's experts in fp8 blocks of 64 x 64 (attention and the dense MLP float):
    split by features, each rank's 32 rows of an expert are half a block, refused by name;
    dealt out whole, they serve, equal to transformers on the same checkpoint."""
    fp8 = write_fp8_checkpoint(tiny_family("qwen3_moe"), tmp_path / "q", (64, 64),
                               ("model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.1.mlp"))
    with pytest.raises(ValueError, match="leaves 32 output rows of the experts' gate_proj and up_proj on each rank, "
                                         "not whole blocks .* \\(enable_expert_parallel keeps each expert whole\\)"):
        split_llm(fp8)
    llm = check_prefill_logits_against(fp8, fp8, "torch", {"tensor_parallel_size": 2, "num_threads": 1,
                                                           "enable_expert_parallel": True})
    assert llm.engine.runner.local.model_config.moe.num_local_experts == 3


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("family, layer, stacked_name", [
    ("mixtral", 0, "gate_up_proj"), ("nemotron_3_latent", 1, "up_proj")])
def test_experts_one_per_tensor_and_stacked_split_alike(tiny_family, rank, family, layer, stacked_name):
    """Mixtral's checkpoint holds each expert's w1, w3 and w2 (Nemotron 3's its up_proj and
    down_proj, without a gate); transformers 5 stacks them (`experts.gate_up_proj` or
    `experts.up_proj`, `experts.down_proj`): a rank's share loads the same from both."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_family(family)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    stacked = hf.state_dict()
    mixer = "mlp" if family == "mixtral" else "mixer"
    first = stacked[f"model.layers.{layer}.{mixer}.experts.{stacked_name}"]  # [experts, (2 *) I, hidden]
    whole = ModelConfig.from_hf(hf.config)
    loaded = []
    for weights in (iter_safetensors(model_dir), iter(stacked.items())):
        model = LlamaForCausalLM(whole.shard(2))
        model.load_weights(weights, functools.partial(shard_weights, cfg=whole, rank=rank, world_size=2))
        loaded.append(dict(model.named_parameters()))
    expert = loaded[0][f"layers.{layer}.mlp.experts.w13"]  # [experts, (2 *) I / 2, hidden]: gate rows, then up rows
    half = whole.moe.intermediate_size // 2
    assert expert.shape[1] == (whole.moe.intermediate_size if whole.moe.gated else half)
    torch.testing.assert_close(expert[1, :half], first[1, rank * half : (rank + 1) * half])
    for name, param in loaded[0].items():
        assert torch.equal(param, loaded[1][name]), name


def test_the_kernel_path_splits_alike(tiny_llama_dir):
    """Triton's norms, rotary and paged attention over each rank's heads (on a GPU each rank
    has its own; eager there: a split model's decode steps are not captured as graphs)."""
    llm = split_llm(tiny_llama_dir, attention_backend="triton", device="cuda" if torch.cuda.is_available() else "cpu")
    assert llm.engine.runner.graphs is None
    prompts = ["Hello, my name is", "x"]
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(12), use_tqdm=False)]
    tok = llm.get_tokenizer()
    assert tokens == hf_greedy_along(tiny_llama_dir, [tok.encode(p) for p in prompts], tokens)


def quantized_checkpoint(case: str, src, root) -> tuple:
    """(the checkpoint, the float one transformers reads as its oracle, LLM arguments)."""
    if case == "GPTQ":  # int4 packed along the rows, a scale and a zero point per 32 columns
        write_checkpoint(src, root / "q", root / "oracle", "gptq", bits=4, sym=False, group=32)
        return root / "q", root / "oracle", {}
    if case == "fp8 at load":  # a scale per output channel: o_proj's and down_proj's whole on both ranks
        return src, write_per_channel_checkpoint(src, root / "oracle"), {"quantization": "fp8"}
    fp8 = write_fp8_checkpoint(src, root / "q", BLOCK, ("model.layers.1.mlp",))  # the second MLP float
    return fp8, fp8, {}


# fp8 in 16 x 32 blocks: q/k/v and gate/up by whole blocks of rows, o_proj and down_proj by
# whole blocks of columns, a float layer among them; GPTQ on the kernel path, where each rank
# keeps its packed integers and zero points, over one KV head both ranks keep (its grids
# whole on each); experts in fp8 blocks; fp8 quantized at load
@pytest.mark.parametrize("case, family, backend", [("fp8 blocks", "llama", "torch"), ("GPTQ", "llama3_rope", "triton"),
                                                   ("fp8 blocks", "qwen3_moe", "torch"),
                                                   ("fp8 at load", "qwen3_moe", "torch")])
def test_quantized_checkpoints_split_as_transformers_reads_them(tiny_family, tmp_path, case, family, backend):
    checkpoint, oracle, args = quantized_checkpoint(case, tiny_family(family), tmp_path)
    llm = check_prefill_logits_against(checkpoint, oracle, backend, {"tensor_parallel_size": 2, "num_threads": 1, **args})
    if backend == "triton":
        qkv = llm.engine.runner.model.layers[0].self_attn.qkv_proj  # q: 32 rows a rank, k and v: 16 each
        assert isinstance(qkv, QuantLinear) and qkv.weight.shape == (64, 8) and qkv.weight.dtype == torch.int32
        assert qkv.weight_zero is not None and qkv.weight_zero.shape == (64, 2)


def test_quantized_layers_split_at_whole_blocks_or_are_refused():
    """Each rank's rows and columns of a quantized layer must be whole blocks of its scales
    (and int4's whole words), as vLLM requires."""
    from transformers import LlamaConfig

    def whole(quantization: dict, **sizes) -> ModelConfig:
        shape = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, **sizes}
        return ModelConfig.from_hf(LlamaConfig(**shape, quantization_config=quantization))

    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}
    assert whole(gptq).shard(2).intermediate_size == 64
    refused = [
        (whole({"quant_method": "fp8", "weight_block_size": [32, 32]}),
         "leaves 16 output rows of k_proj and v_proj on each rank, not whole blocks of the checkpoint's 32 rows"),
        (whole(gptq, intermediate_size=96),
         "leaves 48 input columns of down_proj on each rank, not whole groups of the checkpoint's 32 columns"),
        (whole({**gptq, "group_size": -1}, hidden_size=40, num_attention_heads=2),
         "leaves 20 input columns of o_proj on each rank, not whole words of eight int4 values"),
        (whole({**gptq, "desc_act": True}), "its act-order \\(desc_act\\) GPTQ weights run on one device only"),
    ]
    from transformers import GptOssConfig

    mxfp4 = GptOssConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_local_experts=4, architectures=["GptOssForCausalLM"],
                         quantization_config={"quant_method": "mxfp4"})
    refused.append((ModelConfig.from_hf(mxfp4), "leaves 48 input columns of the experts' down_proj on each rank, not "
                    "whole groups of the checkpoint's 32 columns a scale \\(enable_expert_parallel keeps each expert "
                    "whole; or quantization='fp8', which widens"))
    assert ModelConfig.from_hf(mxfp4, "fp8").shard(2).moe.intermediate_size == 48
    dealt = ModelConfig.from_hf(mxfp4).shard(2, expert_parallel=True).moe  # (whole experts: whole blocks)
    assert (dealt.intermediate_size, dealt.num_experts, dealt.num_local_experts) == (96, 4, 2)
    with pytest.raises(ValueError, match=r"num_experts \(4\) is not divisible by tensor_parallel_size \(8\)"):
        ModelConfig.from_hf(GptOssConfig(**{**mxfp4.to_dict(), "num_attention_heads": 8, "num_key_value_heads": 8})
                            ).shard(8, expert_parallel=True)
    for cfg, error in refused:
        with pytest.raises(ValueError, match=error):
            cfg.shard(2)


@pytest.mark.parametrize("version, chunk", [("qwen2_5_vl", {"max_num_batched_tokens": 8, "max_num_seqs": 2}),
                                            ("qwen3_vl_moe", {})], ids=["qwen2_5_vl in chunks", "qwen3_vl_moe"])
def test_image_text_models_split_with_the_images_on_rank_0(version, chunk, tiny_qwen_vl, tmp_path):
    """Rank 0 alone loads the image encoder; each step's image rows and M-RoPE positions go to
    the other rank with the step, in chunks that cut through the images. Qwen3-VL-MoE (as the
    Hub lays out its experts) adds the deepstack embeddings and split experts, whose effect
    the logprobs show."""
    from test_qwen_vl_images import ONE, TWO, hf_greedy_logprobs, hub_layout

    model_dir = tiny_qwen_vl(version)
    expected = [hf_greedy_logprobs(model_dir, *case) for case in (ONE, TWO)]
    served = hub_layout(model_dir, tmp_path / "hub") if version == "qwen3_vl_moe" else model_dir
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    llm = split_llm(served, **chunk)
    assert llm.engine.runner.local.image_encoder is not None
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}} for text, images in (ONE, TWO)],
                           params, use_tqdm=False)
    for out, (tokens, logprobs) in zip(outputs, expected, strict=True):
        assert out.outputs[0].token_ids == tokens
        assert [entry.logprob for entry in out.outputs[0].logprobs] == pytest.approx(logprobs, abs=1e-4)


def test_a_rank_that_stopped_fails_the_step_by_name(tiny_llama_dir):
    llm = split_llm(tiny_llama_dir)
    (rank1,) = llm.engine.runner.processes
    os.kill(rank1.pid, signal.SIGKILL)
    rank1.join()
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 \(exit code -9\) stopped"):
        llm.generate("Hello", SamplingParams(max_tokens=4), use_tqdm=False)


def test_a_rank_that_stops_while_starting_fails_the_engine_by_name(tiny_llama_dir):
    """Killed before it joins the group: rank 0 gives up at once, not at the group's timeout."""
    killed: list[int] = []
    # another module's split engine may still be alive in this process (the suite's files
    # share processes): its rank 1 is not the one to kill
    before = {child.pid for child in multiprocessing.active_children()}

    def kill_rank1_once_started() -> None:
        deadline = time.monotonic() + 60
        while not killed and time.monotonic() < deadline:
            for child in multiprocessing.active_children():
                if child.name == "genq-tp-rank1" and child.pid is not None and child.pid not in before:
                    os.kill(child.pid, signal.SIGKILL)
                    killed.append(child.pid)
            time.sleep(0.005)

    threading.Thread(target=kill_rank1_once_started, daemon=True).start()
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 \(exit code -9\) stopped"):
        llm = split_llm(tiny_llama_dir)
        # on a loaded machine the kill may land just after rank 1 joined: then the first
        # step must fail by name instead, never hang or pass
        llm.generate("Hello", SamplingParams(max_tokens=4), use_tqdm=False)
    assert killed


@pytest.mark.parametrize("size, message", [
    (3, r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"),
    (8, r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(8\)"),
])
def test_a_split_that_does_not_divide_is_refused(tiny_llama_dir, size, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64, tensor_parallel_size=size)


def test_kv_heads_split_or_are_shared():
    """Two KV heads: split over two ranks, kept one a rank over four; over three, refused."""
    from transformers import LlamaConfig

    whole = ModelConfig.from_hf(LlamaConfig(num_attention_heads=12, num_key_value_heads=2, hidden_size=96,
                                            intermediate_size=96))
    assert [whole.shard(n).num_key_value_heads for n in (2, 4, 6, 12)] == [1, 1, 1, 1]
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\) is not divisible by tensor_parallel_size "
                                         r"\(3\), nor does it divide it"):
        whole.shard(3)


def test_state_layers_split_by_their_heads_or_are_refused():
    """A layer with a state splits by its heads: Gated DeltaNet's key and value heads, Mamba2's
    heads and groups (B and C), each a whole number a rank, else refused by name."""
    from transformers import GraniteMoeHybridConfig, Qwen3_5TextConfig

    qwen = ModelConfig.from_hf(Qwen3_5TextConfig(num_attention_heads=8, num_key_value_heads=4, linear_num_key_heads=4,
                                                 linear_num_value_heads=8, full_attention_interval=2,
                                                 architectures=["Qwen3_5ForCausalLM"]))
    share = qwen.shard(4).linear
    assert (share.num_key_heads, share.num_value_heads, share.key_head_dim) == (1, 2, qwen.linear.key_head_dim)
    with pytest.raises(ValueError, match=r"linear_num_key_heads \(4\) is not divisible by tensor_parallel_size \(8\)"):
        qwen.shard(8)
    granite = ModelConfig.from_hf(GraniteMoeHybridConfig(num_attention_heads=8, num_key_value_heads=8,
                                                         mamba_n_heads=16, mamba_n_groups=2, num_local_experts=0,
                                                         num_hidden_layers=2, layer_types=["mamba", "attention"],
                                                         architectures=["GraniteMoeHybridForCausalLM"]))
    assert granite.shard(2).linear.num_key_heads == 1
    with pytest.raises(ValueError, match=r"Mamba2's n_groups \(2\) is not divisible by tensor_parallel_size \(4\)"):
        granite.shard(4)


def test_whole_projection_norms_over_replicated_kv_heads():
    """OLMo 2 over four ranks: one query head each, each of the 2 KV heads kept by two. Every
    rank's normed q and k equal its columns of the whole norms, given its all-reduce: the sum
    of what the four ranks give it (gathered first, then handed back)."""
    from transformers import Olmo2Config

    from worker.model_executor.models.llama import Attention
    from worker.model_executor.tensor_parallel import _kv_share

    whole = ModelConfig.from_hf(Olmo2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                            num_key_value_heads=2, num_hidden_layers=1,
                                            architectures=["Olmo2ForCausalLM"]))
    torch.manual_seed(0)
    full = Attention(whole)
    for norm in (full.q_norm, full.k_norm):
        norm.weight.data.uniform_(0.5, 1.5)
    q, k = torch.randn(5, 64), torch.randn(5, 32)
    ranks = []
    for rank in range(4):
        attn = Attention(whole.shard(4))
        attn.world_size = 4
        attn.q_norm.weight.data = full.q_norm.weight.data.chunk(4)[rank]
        attn.k_norm.weight.data = _kv_share(full.k_norm.weight.data, whole, rank, 4)
        ranks.append((attn, q.chunk(4, dim=1)[rank], _kv_share(k.T, whole, rank, 4).T))
    given: list[torch.Tensor] = []
    for attn, q_part, k_part in ranks:  # what each rank gives the all-reduce
        attn.reduce = lambda t: given.append(t) or t
        attn._split_norms(q_part, k_part)
    for rank, (attn, q_part, k_part) in enumerate(ranks):
        attn.reduce = lambda t: sum(given)
        q_normed, k_normed = attn._split_norms(q_part, k_part)
        torch.testing.assert_close(q_normed, full.q_norm(q).chunk(4, dim=1)[rank])
        torch.testing.assert_close(k_normed, _kv_share(full.k_norm(k).T, whole, rank, 4).T)


def test_a_bad_split_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)


# qwen3_5: Gated DeltaNet beside gated attention; qwen3_next: its checkpoints' grouped
# projections, over experts; granitemoehybrid: Mamba2 (B and C in two groups, a group a rank)
# beside NoPE attention and experts; nemotron_3_latent: one-part layers (Mamba2, attention, an
# MLP without a gate, or Nemotron 3's experts without one, in a latent space whose projection
# out takes each rank's partial sums)
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "granitemoehybrid", "nemotron_3_latent"])
def test_models_with_states_split_as_transformers(family, tiny_family):
    """Each rank holds its heads' states, in the same slots, saved states and spares: two
    slots taken in turn by nine requests (a slot freed on rank 0 is freed on rank 1), n-gram
    guesses taken back on both ranks where wrong, and follow-ups served from the states the
    ranks kept. Greedy tokens equal transformers'."""
    model_dir = tiny_family(family)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    llm = split_llm(model_dir, max_model_len=256, max_num_seqs=2, max_num_batched_tokens=24, mamba_block_size=16,
                    num_state_snapshots=16, speculative_config=spec)
    whole = ModelConfig.from_hf(llm.engine.runner.local.model_config.hf_config).linear
    local = llm.engine.runner.local.model_config.linear
    assert (2 * local.num_key_heads, 2 * local.num_value_heads) == (whole.num_key_heads, whole.num_value_heads)
    outputs = run_and_compare(llm, model_dir)
    tok = llm.get_tokenizer()
    first = tok.encode(PROMPTS[5])  # its answer after it again: guesses partly right
    follow_up = first * 2 + outputs[5].outputs[0].token_ids + first
    [out] = llm.generate({"prompt_token_ids": follow_up}, greedy(), use_tqdm=False)
    assert out.num_cached_tokens >= 16
    assert out.outputs[0].token_ids == hf_greedy_along(model_dir, [follow_up], [out.outputs[0].token_ids])[0]
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # guesses were taken back
    assert not llm.engine.runner.states.slots
