"""LoRA adapters against PEFT on the same weights: greedy tokens must be identical in float32,
whichever adapters (or none) share a batch, and whatever the slots and the prefix cache do."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from peft import PeftModel
from test_engine import greedy_along
from transformers import AutoModelForCausalLM

from producer.sampling_params import SamplingParams
from worker import LLM, LoRARequest

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "In a distant galaxy, far beyond the reach of any telescope, there lived " * 3,
    "def fibonacci(n):\n    ",
]
NEW_TOKENS = 12


def peft_greedy(model_dir, adapter_dir, prompt_ids: list[list[int]]) -> list[list[int]]:
    """PEFT's greedy tokens with the adapter (or the base model's, for None), ignoring EOS."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    return greedy_of(model, prompt_ids)


def greedy_of(model, prompt_ids: list[list[int]]) -> list[list[int]]:
    """A transformers (or PEFT) model's greedy tokens, ignoring EOS."""
    model = model.eval()
    out = []
    with torch.inference_mode():
        for ids in prompt_ids:
            gen = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(ids):].tolist())
    return out


def greedy():
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, tiny_llama_adapters, default_model_dir):
    """PEFT's tokens per adapter name (None: the base model), per prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    ids = [tok.encode(p) for p in PROMPTS]
    refs = {name: peft_greedy(tiny_llama_dir, path, ids) for name, path in tiny_llama_adapters.items()}
    refs[None] = peft_greedy(tiny_llama_dir, None, ids)
    assert refs["all"] != refs[None] and refs["qv"] != refs[None] and refs["all"] != refs["qv"]
    return refs


def lora_requests(adapters):
    return {None: None, "all": LoRARequest("all", 1, str(adapters["all"])),
            "qv": LoRARequest("qv", 2, str(adapters["qv"]))}


@pytest.mark.parametrize("max_loras", [1, 2])
def test_mixed_batch_matches_peft(tiny_llama_dir, tiny_llama_adapters, expected, max_loras):
    """Every prompt under the base model and both adapters, all queued at once: with two
    slots they share steps; with one, the adapters take turns (each step runs at most one)."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=256, enable_lora=True,
              max_loras=max_loras, max_lora_rank=8)
    requests = lora_requests(tiny_llama_adapters)
    names = [name for name in ("all", None, "qv") for _ in PROMPTS]
    engine = llm.engine
    for i, name in enumerate(names):
        engine.add_request(str(i), PROMPTS[i % len(PROMPTS)], greedy(), lora_request=requests[name])
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(names))}
    adapters_per_step = []
    while engine.has_unfinished_requests():
        adapters_per_step.append({r.lora_id for r in engine.scheduler.running if r.lora_id})
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids
        adapters_per_step[-1] |= {r.lora_id for r in engine.scheduler.running if r.lora_id}
    for i, name in enumerate(names):
        assert tokens[str(i)] == expected[name][i % len(PROMPTS)], (name, PROMPTS[i % len(PROMPTS)][:20])
    assert max(len(step) for step in adapters_per_step) == max_loras


def test_prefix_cache_is_per_adapter(tiny_llama_dir, tiny_llama_adapters, expected):
    """The same prompt under the base model, then each adapter, then an adapter again: only a
    run of the same adapter reuses blocks, and every output stays the oracle's."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=256, enable_lora=True, max_loras=2)
    requests = lora_requests(tiny_llama_adapters)
    prompt = PROMPTS[2]  # several full blocks
    for name, cached in ((None, False), ("all", False), ("qv", False), ("all", True), (None, True)):
        out = llm.generate(prompt, greedy(), use_tqdm=False, lora_request=requests[name])[0]
        assert out.outputs[0].token_ids == expected[name][2], name
        assert (out.num_cached_tokens > 0) == cached, name


def test_slots_are_reused_when_more_adapters_than_slots(tiny_llama_dir, tiny_llama_adapters, expected):
    """Three adapter ids over one slot: each is loaded back in when its turn comes."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=256, enable_lora=True, max_loras=1)
    all_again = LoRARequest("all-again", 3, str(tiny_llama_adapters["all"]))
    requests = lora_requests(tiny_llama_adapters)
    for lora, name in ((requests["all"], "all"), (requests["qv"], "qv"), (all_again, "all"), (requests["qv"], "qv")):
        out = llm.generate(PROMPTS[0], greedy(), use_tqdm=False, lora_request=lora)[0]
        assert out.outputs[0].token_ids == expected[name][0], lora.lora_name


def test_triton_path_runs_adapters_eagerly(tiny_llama_dir, tiny_llama_adapters, expected):
    """The kernel path replays decodes from graphs of the base model: steps with an adapter
    run eagerly, steps without one still use the graphs."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64, enable_lora=True,
              attention_backend="triton", max_num_seqs=4)
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    requests = lora_requests(tiny_llama_adapters)
    out = llm.generate(PROMPTS[0], greedy(), use_tqdm=False, lora_request=requests["all"])[0]
    assert out.outputs[0].token_ids == expected["all"][0]
    assert sum(graphs.num_steps.values()) == 0
    out = llm.generate(PROMPTS[0], greedy(), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected[None][0]
    assert sum(graphs.num_steps.values()) == NEW_TOKENS - 1


def test_adapters_split_over_two_ranks_match_peft(tiny_llama_dir, tiny_llama_adapters, expected, tmp_path):
    """Each rank keeps its share of an adapter (B's rows of q/k/v and gate/up, A's columns of
    o_proj and down_proj, whose partial deltas the ranks sum with the projections' own). Both
    adapters and the base model in one batch, over one slot they take turns in on every rank;
    a bad adapter is refused by rank 0 and reaches no other; one forgotten, another read."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=256, enable_lora=True, max_loras=1,
              max_lora_rank=8, tensor_parallel_size=2, num_threads=1)
    requests = lora_requests(tiny_llama_adapters)
    names = ["all", None, "qv"]
    outs = llm.generate(PROMPTS[:3] * 3, greedy(), use_tqdm=False,
                        lora_request=[requests[name] for name in names for _ in range(3)])
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == expected[names[i // 3]][i % 3], (names[i // 3], i % 3)
    with pytest.raises(ValueError, match="not a PEFT adapter directory"):
        llm.generate(PROMPTS[0], greedy(), use_tqdm=False, lora_request=LoRARequest("none", 3, str(tmp_path)))
    llm.engine.remove_lora(1)
    again = LoRARequest("all-again", 4, str(tiny_llama_adapters["all"]))
    out = llm.generate(PROMPTS[0], greedy(), use_tqdm=False, lora_request=again)[0]
    assert out.outputs[0].token_ids == expected["all"][0]
    assert sorted(llm.engine.runner.lora.adapters) == [2, 4]


def test_bad_adapters_are_refused_by_name(tiny_llama_dir, tiny_llama_adapters, tmp_path):
    adapter = tiny_llama_adapters["all"]
    plain = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="prompt 0: .*LoRA is not enabled"):
        plain.generate("hi", greedy(), use_tqdm=False, lora_request=LoRARequest("all", 1, str(adapter)))
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64, enable_lora=True, max_lora_rank=4)
    with pytest.raises(ValueError, match="rank 8 .* over max_lora_rank=4"):
        llm.generate("hi", greedy(), use_tqdm=False, lora_request=LoRARequest("all", 1, str(adapter)))
    with pytest.raises(ValueError, match="not a PEFT adapter directory"):
        llm.generate("hi", greedy(), use_tqdm=False, lora_request=LoRARequest("none", 1, str(tmp_path)))
    dora = shutil.copytree(tiny_llama_adapters["qv"], tmp_path / "dora")
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA adapters are not supported"):
        llm.generate("hi", greedy(), use_tqdm=False, lora_request=LoRARequest("dora", 1, str(dora)))
    llm.generate("hi", greedy(), use_tqdm=False, lora_request=LoRARequest("qv", 2, str(tiny_llama_adapters["qv"])))
    with pytest.raises(ValueError, match="lora_int_id 2 is already adapter 'qv'"):
        llm.generate("hi", greedy(), use_tqdm=False, lora_request=LoRARequest("all", 2, str(adapter)))
    with pytest.raises(ValueError, match="lora_int_id must be an int >= 1"):
        LoRARequest("zero", 0, str(adapter))
    assert not llm.engine.has_unfinished_requests()  # nothing refused was queued


def test_adapter_of_another_shape_is_refused(tiny_llama_adapters, tiny_mistral_dir):
    """An adapter trained for another model says which shapes it has and which it needs."""
    llm = LLM(str(tiny_mistral_dir), dtype="float32", num_gpu_blocks_override=64, enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match=r"k_proj pair has shapes .* B \[64, rank\]"):
        llm.generate("hi", greedy(), use_tqdm=False, lora_request=LoRARequest("all", 1, str(tiny_llama_adapters["all"])))


def test_adapters_survive_preemption_and_share_prompts_across_n(tiny_llama_dir, tiny_llama_adapters, expected):
    """A KV pool too small for the batch preempts requests, which recompute with their own
    adapter; n=2 siblings share the prompt's blocks and the adapter."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=12, max_model_len=192,
              enable_lora=True, max_loras=2)
    requests = lora_requests(tiny_llama_adapters)
    names = [name for name in ("all", "qv", None) for _ in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, n=2)
    outs = llm.generate(PROMPTS * 3, params, use_tqdm=False, lora_request=[requests[n] for n in names])
    for i, (name, out) in enumerate(zip(names, outs, strict=True)):
        assert [c.token_ids for c in out.outputs] == [expected[name][i % len(PROMPTS)]] * 2, name
    assert llm.engine.scheduler.num_preemptions > 0


def test_adapters_with_speculative_decoding(tiny_llama_dir, tiny_llama_adapters, expected):
    """Guessed tokens are checked under the request's own adapter: outputs stay PEFT's."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=256, enable_lora=True, max_loras=2,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    requests = lora_requests(tiny_llama_adapters)
    names = [name for name in ("all", "qv", None) for _ in PROMPTS]
    outs = llm.generate(PROMPTS * 3, greedy(), use_tqdm=False, lora_request=[requests[n] for n in names])
    for i, (name, out) in enumerate(zip(names, outs, strict=True)):
        assert out.outputs[0].token_ids == expected[name][i % len(PROMPTS)], name
    assert llm.engine.speculator.stats.num_drafts > 0


def test_everything_at_once_equals_plain_decoding(tiny_llama_dir, tiny_llama_adapters):
    """Adapters, guided JSON and regex, logprobs, penalties, seeded sampling, n=2 and
    preemption in one batch, with speculation on: each request's output is what the same
    engine gives it without speculation. (The tiny model seldom repeats itself, so guesses
    are rare here; test_spec_decode checks them where they are kept.)"""
    requests = lora_requests(tiny_llama_adapters)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "d": {"type": "string", "format": "date"}},
              "required": ["a", "d"]}
    cases = [
        ("all", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)),
        ("qv", SamplingParams(temperature=0.0, max_tokens=40, guided_decoding={"json_schema": schema})),
        (None, SamplingParams(temperature=0.0, max_tokens=12, guided_decoding={"regex": r"\d{2}:\d{2}( [AP]M)?"})),
        ("all", SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.2, n=2, ignore_eos=True)),
        ("qv", SamplingParams(temperature=0.9, seed=5, max_tokens=16, n=2, ignore_eos=True)),
        (None, SamplingParams(temperature=0.0, max_tokens=24, stop=["a"], ignore_eos=True)),
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(cases))] * 2
    loras = [requests[name] for name, _ in cases] * 2
    params = [p for _, p in cases] * 2

    def run(spec):
        llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=20, max_model_len=192,
                  enable_lora=True, max_loras=2, speculative_config={"method": "ngram", "num_speculative_tokens": 3}
                  if spec else None)
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        return llm, [[(c.token_ids, c.finish_reason, [e.token_id for e in c.logprobs or []]) for c in o.outputs]
                     for o in outs]

    spec_llm, spec = run(True)
    _, plain = run(False)
    assert spec == plain
    assert spec_llm.engine.scheduler.num_preemptions > 0


def test_adapter_on_fused_projections_matches_peft(tiny_phi3_adapter, default_model_dir):
    """Phi-3's checkpoints fuse q/k/v and gate/up, so its adapters do too: one pair over
    the whole projection, served as a shared A and B's rows split among the shards."""
    from transformers import AutoTokenizer

    model_dir, adapter_dir = tiny_phi3_adapter
    ids = [AutoTokenizer.from_pretrained(default_model_dir).encode(p) for p in PROMPTS]
    expected = peft_greedy(model_dir, adapter_dir, ids)
    assert expected != peft_greedy(model_dir, None, ids)
    llm = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=64, enable_lora=True, max_lora_rank=8)
    outs = llm.generate(PROMPTS, greedy(), lora_request=LoRARequest("phi", 1, str(adapter_dir)), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_adapter_on_reordered_q_and_k_matches_peft(tiny_ernie_adapter, default_model_dir):
    """Ernie 4.5's q and k rows are reordered at load (its RoPE rotates interleaved pairs):
    an adapter's B rows for q and k are reordered alike, or its scores would be wrong."""
    from transformers import AutoTokenizer

    model_dir, adapter_dir = tiny_ernie_adapter
    ids = [AutoTokenizer.from_pretrained(default_model_dir).encode(p) for p in PROMPTS[:4]]
    expected = peft_greedy(model_dir, adapter_dir, ids)
    assert expected != peft_greedy(model_dir, None, ids)
    llm = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=64, enable_lora=True, max_lora_rank=8)
    outs = llm.generate(PROMPTS[:4], greedy(), lora_request=LoRARequest("ernie", 1, str(adapter_dir)), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


STATE_TARGETS = {  # every projection of the layers with states, and those of attention and MLP
    "qwen3_5": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
                "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"],
    "granitemoehybrid_dense": ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj", "input_linear",
                               "output_linear"],
    "nemotron_h": ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "up_proj", "down_proj"],  # (PEFT refuses out_proj)
    # (up_proj and down_proj: the dense MLP's and each layer of experts' shared expert's)
    "nemotron_3_latent": ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "up_proj", "down_proj"],
}


# tp 2: each rank its share of the adapter, as its heads' (shard_adapter); split for Gated
# DeltaNet's projections and for Mamba2's beside shared experts (Nemotron-H's Mamba2 is that one's).
# Qwen3.5 and Nemotron 3 run split only: one rank's share is the whole adapter, as Granite's tp 1 shows.
SPLIT_ONLY = {"qwen3_5", "nemotron_3_latent"}


@pytest.mark.parametrize("family, tp", [(family, 1) for family in STATE_TARGETS if family not in SPLIT_ONLY]
                         + [("qwen3_5", 2), ("granitemoehybrid_dense", 2), ("nemotron_3_latent", 2)])
def test_adapters_on_models_with_states_match_peft(family, tp, tiny_adapter, default_model_dir):
    """Qwen3.5 (Gated DeltaNet layers beside gated attention), Granite 4.0-H (Mamba2 beside
    attention, its shared MLP) and Nemotron-H (one-part layers, its MLPs without a gate, under
    `backbone.layers.N.mixer`): an adapter on every projection, the state layers' too, in a batch beside
    requests without it, chunked prefill and a prefix served from a kept state: greedy tokens
    equal PEFT's, and the base model's rows stay the base model's."""
    from transformers import AutoTokenizer

    model_dir, adapter_dir = tiny_adapter(family, 6, STATE_TARGETS[family])
    ids = [AutoTokenizer.from_pretrained(default_model_dir).encode(p) for p in PROMPTS]
    llm = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=64, enable_lora=True, max_lora_rank=8,
              max_num_batched_tokens=24, mamba_block_size=16, num_state_snapshots=64, tensor_parallel_size=tp,
              num_threads=1 if tp > 1 else None)
    adapter = LoRARequest("states", 1, str(adapter_dir))
    prompts = [{"prompt_token_ids": p} for p in ids]
    outs = llm.generate(prompts * 2, greedy(), lora_request=[adapter] * len(ids) + [None] * len(ids),
                        use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    adapted, base = tokens[:len(ids)], tokens[len(ids):]
    # PEFT's greedy choices along our tokens (teacher forcing: transformers' Nemotron-H decodes
    # from its cache otherwise than its full forward computes)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert base == greedy_along(model, ids, base)
    assert adapted == greedy_along(PeftModel.from_pretrained(model, adapter_dir), ids, adapted)
    assert all(a != b for a, b in zip(adapted, base, strict=True))
    [again] = llm.generate(prompts[2], greedy(), lora_request=adapter, use_tqdm=False)  # from its kept state
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == adapted[2]


def test_an_adapter_for_the_other_layer_kind_is_refused(tiny_adapter):
    """A linear-attention projection named in a full-attention layer (or the other way round)
    is refused by name, not silently dropped."""
    _refused_once_moved(tiny_adapter("qwen3_5", 7, ["in_proj_z"]), "layers.0.linear_attn", "layers.1.linear_attn",
                        "adapts in_proj_z in layer 1, which has none: its projections are q_proj, k_proj, v_proj, o_proj")


def _refused_once_moved(model_and_adapter: tuple, old: str, new: str, error: str) -> None:
    """The adapter with `old` replaced by `new` in its tensors' names is refused with `error`."""
    from safetensors.torch import load_file, save_file

    model_dir, adapter_dir = model_and_adapter
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    save_file({key.replace(old, new): t for key, t in tensors.items()}, str(adapter_dir / "adapter_model.safetensors"))
    llm = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=16, max_model_len=128, enable_lora=True,
              max_lora_rank=8)
    with pytest.raises(ValueError, match=error):
        llm.generate("Hello", greedy(), lora_request=LoRARequest("moved", 1, str(adapter_dir)), use_tqdm=False)


SHARED_TARGETS = {"qwen2_moe": ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
                  "granitemoehybrid": ["q_proj", "v_proj", "in_proj", "input_linear", "output_linear"]}


@pytest.mark.parametrize("family, tp", [("qwen2_moe", 2), ("granitemoehybrid", 1)])
def test_adapters_on_shared_experts_match_peft(tiny_adapter, default_model_dir, family, tp):
    """Qwen2-MoE: PEFT's gate_proj, up_proj and down_proj adapt each layer of experts' shared
    expert (its routed experts are not modules PEFT adapts), applied as to a dense MLP of the
    shared expert's width, beside its gate and the routed experts' sum; Granite 4.0-H's
    shared_mlp likewise (input_linear, output_linear). Greedy tokens equal PEFT's, on one
    rank and split over two."""
    from transformers import AutoTokenizer

    model_dir, adapter_dir = tiny_adapter(family, 9, SHARED_TARGETS[family])
    ids = [AutoTokenizer.from_pretrained(default_model_dir).encode(p) for p in PROMPTS[:4]]
    llm = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=64, enable_lora=True, max_lora_rank=8,
              tensor_parallel_size=tp, num_threads=1 if tp > 1 else None)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], greedy(),
                        lora_request=LoRARequest("shared", 1, str(adapter_dir)), use_tqdm=False)
    adapted = [o.outputs[0].token_ids for o in outs]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert adapted == greedy_along(PeftModel.from_pretrained(model, adapter_dir), ids, adapted)
    assert adapted != greedy_along(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), ids, adapted)


def test_an_adapter_on_routed_experts_is_refused(tiny_adapter):
    """A pair on one of Nemotron 3's routed experts (PEFT's own targets reach only the shared
    one): genq adapts no routed expert, and says so rather than drop those tensors."""
    _refused_once_moved(tiny_adapter("nemotron_3_latent", 7, ["up_proj"]), "layers.1.mixer.shared_experts.",
                        "layers.1.mixer.experts.0.",
                        r"model\.layers\.1\.mixer\.experts\.0\.up_proj\.lora_A\.weight' adapts the experts of layer 1")


@pytest.mark.parametrize("tiny_image_text_dir", ["qwen3_5", "gemma3"], indirect=True)
def test_adapter_on_an_image_text_models_language_model_matches_peft(tiny_image_text_dir, default_model_dir, tmp_path):
    """Qwen3.5 and Gemma 3 ship as image-text models: an adapter trained on one names its
    language model's projections under `model.language_model.`; served on text, its greedy
    tokens equal PEFT's on transformers' image-text model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    torch.manual_seed(8)
    hf = AutoModelForImageTextToText.from_pretrained(tiny_image_text_dir, dtype=torch.float32)
    targets = r".*language_model.*\.(q_proj|v_proj|o_proj|in_proj_qkv|out_proj|gate_proj|down_proj)"
    peft = get_peft_model(hf, LoraConfig(init_lora_weights=False, r=8, lora_alpha=16, target_modules=targets))
    peft.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    keys = list(load_file(str(tmp_path / "adapter_model.safetensors")))
    assert keys and all(".language_model.layers." in key for key in keys)
    ids = [AutoTokenizer.from_pretrained(default_model_dir).encode(p) for p in PROMPTS[:2]]
    expected = greedy_of(peft, ids)
    llm = LLM(str(tiny_image_text_dir), dtype="float32", num_gpu_blocks_override=64, enable_lora=True, max_lora_rank=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], greedy(),
                        lora_request=LoRARequest("vl", 1, str(tmp_path)), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    base = llm.generate([{"prompt_token_ids": p} for p in ids], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in base] != expected
