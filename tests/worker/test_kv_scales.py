"""A checkpoint's fp8 KV-cache scales (compressed-tensors' kv_cache_scheme). The model here
has keys and values far past fp8's +-448: its k and v projections are scaled up and q and o
down to match, so transformers' float logits are the tiny Llama's, but an fp8 cache without
scales clips. The oracle is transformers whose cache stores each layer's keys and values
as fp8(k / k_scale) * k_scale, as genq's cache holds them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_engine import PROMPTS, check_prefill_logits_against, hf_greedy

from worker import LLM, SamplingParams

LOUD = 4000.0  # k and v are this much larger than the tiny Llama's; q and o this much smaller


def _loud_model(tiny_llama_dir: Path, out: Path) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj, factor in ((attn.k_proj, LOUD), (attn.v_proj, LOUD), (attn.q_proj, 1 / LOUD), (attn.o_proj, 1 / LOUD)):
                proj.weight.mul_(factor)
    model.save_pretrained(out)
    for name in tiny_llama_dir.iterdir():
        if not name.name.endswith(".safetensors") and not (out / name.name).exists():
            shutil.copy(name, out / name.name)
    return out


def _cached_maxima(model_dir: Path) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's largest |k| and |v| per KV head over the test prompts and their greedy
    continuations, as transformers caches them (after the rotation)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.cache_utils import Cache

    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    update = Cache.update

    def observe(self, k, v, layer_idx, *args, **kwargs):
        k_max, v_max = k.abs().amax(dim=(0, 2, 3)), v.abs().amax(dim=(0, 2, 3))  # [kv_heads]
        old = seen.get(layer_idx, (k_max, v_max))
        seen[layer_idx] = (torch.maximum(old[0], k_max), torch.maximum(old[1], v_max))
        return update(self, k, v, layer_idx, *args, **kwargs)

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with pytest.MonkeyPatch.context() as patch, torch.inference_mode():
        patch.setattr(Cache, "update", observe)
        for prompt in PROMPTS:
            model.generate(torch.tensor([tok.encode(prompt)]), max_new_tokens=32, do_sample=False, pad_token_id=0)
        torch.manual_seed(0)  # check_prefill_logits_against's random ids
        model(torch.randint(3, 49152, (1, 300)))
    return seen


def _scaled_checkpoint(model_dir: Path, out: Path, scales: dict[int, tuple[torch.Tensor, torch.Tensor]],
                       strategy: str, names: tuple[str, str] = ("self_attn.k_scale", "self_attn.v_scale")) -> Path:
    """`model_dir` with each layer's K and V scales, as llm-compressor writes them."""
    shutil.copytree(model_dir, out)
    tensors = {}
    for i, (k, v) in scales.items():
        for name, scale in zip(names, (k, v), strict=True):
            tensors[f"model.layers.{i}.{name}"] = scale.reshape(1) if strategy == "tensor" else scale.reshape(-1, 1, 1)
    save_file({name: t.contiguous() for name, t in tensors.items()}, out / "kv_scales.safetensors")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
                                     "kv_cache_scheme": {"num_bits": 8, "type": "float", "symmetric": True,
                                                         "dynamic": False, "strategy": strategy}}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def loud_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    return _loud_model(tiny_llama_dir, tmp_path_factory.mktemp("loud"))


@pytest.fixture(scope="module")
def kv_scales(loud_dir) -> dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Scales per layer and per KV head, each with room to spare over what the tests cache."""
    maxima = _cached_maxima(loud_dir)
    return {"attn_head": {i: (k * 1.5 / 448, v * 1.5 / 448) for i, (k, v) in maxima.items()},
            "tensor": {i: (k.max() * 1.5 / 448, v.max() * 1.5 / 448) for i, (k, v) in maxima.items()}}


def _scaled(strategy: str, loud_dir: Path, kv_scales: dict, out: Path, monkeypatch) -> Path:
    """A checkpoint with scales of the strategy, and transformers caching as it prescribes."""
    from transformers.cache_utils import Cache

    scales = kv_scales[strategy]
    update = Cache.update

    def as_cached(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # x: [B, kv_heads, T, D]
        s = scale.reshape(1, -1, 1, 1).float()
        return ((x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).to(x.dtype)

    monkeypatch.setattr(Cache, "update", lambda self, k, v, i, *a, **kw: update(
        self, as_cached(k, scales[i][0]), as_cached(v, scales[i][1]), i, *a, **kw))
    return _scaled_checkpoint(loud_dir, out, scales, strategy)


@pytest.fixture(params=["tensor", "attn_head"])
def scaled(request, loud_dir, kv_scales, tmp_path, monkeypatch) -> Path:
    return _scaled(request.param, loud_dir, kv_scales, tmp_path / request.param, monkeypatch)


@pytest.fixture
def scaled_per_head(loud_dir, kv_scales, tmp_path, monkeypatch) -> Path:
    """The kernel path's checks (slow in the interpreter) take the per-head scales alone: the
    per-layer ones are the same tensors, one value repeated."""
    return _scaled("attn_head", loud_dir, kv_scales, tmp_path / "attn_head", monkeypatch)


def _greedy(llm: LLM, prompts: list[str]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_matches_transformers_caching_by_the_checkpoints_scales(scaled, loud_dir):
    llm = LLM(str(scaled), dtype="float32", num_gpu_blocks_override=256, kv_cache_dtype="fp8")
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    assert _greedy(llm, PROMPTS) == hf_greedy(loud_dir, ids)


def test_decode_graphs_read_the_scaled_cache(scaled_per_head, loud_dir):
    """The kernel path's decode steps, through the graphs' padded buffers."""
    llm = LLM(str(scaled_per_head), dtype="float32", num_gpu_blocks_override=64, attention_backend="triton",
              device="cuda" if torch.cuda.is_available() else "cpu", kv_cache_dtype="fp8")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS[:2]]
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(loud_dir, ids, max_new=6)


def test_prefill_logits_match(scaled, loud_dir):
    """Chunked prefills reading their cached prefix: the scales at the write and the read."""
    check_prefill_logits_against(scaled, loud_dir, "torch", {"kv_cache_dtype": "fp8"})


def test_prefill_logits_match_on_the_kernel_path(scaled_per_head, loud_dir):
    check_prefill_logits_against(scaled_per_head, loud_dir, "triton", {"kv_cache_dtype": "fp8"})


def test_without_the_scales_an_fp8_cache_clips_these_keys(loud_dir, tiny_llama_dir):
    """What the scales are for: this model's greedy text, fp8 cache without scales, is not the
    model's (nor is the test above one that cannot fail)."""
    llm = LLM(str(loud_dir), dtype="float32", num_gpu_blocks_override=256, kv_cache_dtype="fp8")
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    assert hf_greedy(loud_dir, ids) == hf_greedy(tiny_llama_dir, ids)  # the loud model is the tiny one
    assert _greedy(llm, PROMPTS) != hf_greedy(loud_dir, ids)


def test_a_cache_in_the_model_dtype_leaves_the_scales_unread(loud_dir, kv_scales, tmp_path):
    checkpoint = _scaled_checkpoint(loud_dir, tmp_path / "ck", kv_scales["tensor"], "tensor")
    llm = LLM(str(checkpoint), dtype="float32", num_gpu_blocks_override=256)
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS[:3]]
    assert _greedy(llm, PROMPTS[:3]) == hf_greedy(loud_dir, ids)


def test_older_checkpoints_name_the_scales_by_the_projections(loud_dir, kv_scales, tmp_path):
    names = ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale")
    checkpoint = _scaled_checkpoint(loud_dir, tmp_path / "old", kv_scales["tensor"], "tensor", names)
    llm = LLM(str(checkpoint), dtype="float32", num_gpu_blocks_override=64, kv_cache_dtype="fp8")
    attn = llm.engine.runner.model.layers[1].self_attn
    assert attn.kv_scales is not None and float(attn.kv_scales.v[0]) == pytest.approx(float(kv_scales["tensor"][1][1]))


@pytest.mark.parametrize(("change", "error"), [
    (lambda scales: scales.pop(1), "missing KV-cache scales: layers.1.self_attn.k_scale, layers.1.self_attn.v_scale"),
    (lambda scales: scales.update({0: (torch.tensor(-1.0), scales[0][1])}), "k_scale' holds .*finite and positive"),
    (lambda scales: scales.update({0: (torch.ones(3), scales[0][1])}), "has shape \\(3, 1, 1\\): a KV-cache scale is one"),
])
def test_bad_scales_are_refused_by_name(loud_dir, kv_scales, tmp_path, change, error):
    scales = dict(kv_scales["tensor"])
    change(scales)
    checkpoint = _scaled_checkpoint(loud_dir, tmp_path / "bad", scales, "attn_head")
    with pytest.raises(ValueError, match=error):
        LLM(str(checkpoint), dtype="float32", num_gpu_blocks_override=64, kv_cache_dtype="fp8")


def test_prefill_logits_match_split_over_two_ranks(scaled_per_head, loud_dir):
    """Each rank holds one of the two KV heads, and its scales."""
    check_prefill_logits_against(scaled_per_head, loud_dir, "torch",
                                 {"kv_cache_dtype": "fp8", "tensor_parallel_size": 2, "num_threads": 1})
