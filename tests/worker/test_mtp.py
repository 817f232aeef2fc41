"""Speculative decoding with the model's own multi-token-prediction layer
(`speculative_config={"method": "mtp"}`): every guess is the one transformers' `MtpModel`
makes from the same tokens (its first guess from the target's hidden states, each further one
from the layer's own output), and outputs stay plain decoding's.

The tiny checkpoints get an MTP layer of random weights, stored under the names each family's
checkpoints use: DeepSeek's (`model.layers.<num_hidden_layers>.*`, with copies of the
embedding and head) and Qwen3-Next's (`mtp.*`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.modeling_layers import MtpModel

from producer.sampling_params import SamplingParams
from worker import LLM
from worker.spec_decode.speculative import SpeculativeConfig

FAMILIES = ["deepseek_v3", "qwen3_next"]  # (and GLM-4.5, DeepSeek's layout, where a test's guesses are checked)
PROMPTS = [list(range(100, 131)), [7, 3000, 41, 999, 12, 5, 8000, 77, 300]]


def _with_mtp_config(main, family: str) -> None:
    """What transformers needs to build Qwen3-Next's MTP layer (its config names none), and the
    checkpoint keys of a DeepSeek one this small (transformers looks for layer 61's)."""
    if family == "qwen3_next":
        main.config.num_mtp_layers, main.config.mtp_layer_types = 1, ["full_attention"]
    else:
        main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{main.config.num_hidden_layers}\..*"]


def build_mtp_checkpoint(base: Path, out: Path, family: str, zero_norms: bool = False, seed: int = 1) -> Path:
    """`base` (a tiny checkpoint) again at `out`, with an MTP layer of random weights (drawn
    from `seed`) in its family's layout. `zero_norms`: the target's final norm and the layer's
    are zeros, so both always pick token 0 (every guess right)."""
    shutil.copytree(base, out)
    main = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    _with_mtp_config(main, family)
    mtp = MtpModel(main, 1)
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(out / "model.safetensors")
    offset = 1.0 if family == "qwen3_next" else 0.0  # (1 + w) norms
    for name, param in mtp.state_dict().items():
        if name in ("embed_tokens.weight", "shared_head.weight"):
            continue
        if name.endswith("norm.weight"):
            param = torch.rand(param.shape, generator=generator) + 0.5 - offset
        elif name.endswith("e_score_correction_bias"):
            param = torch.rand(param.shape, generator=generator) * 0.4 - 0.2
        else:  # attention weighs heavily, so a wrong position or a hole in its cache shows
            param = torch.randn(param.shape, generator=generator) * (0.5 if "self_attn" in name else 0.1)
        if zero_norms and name.endswith("post_norm.weight"):
            param = torch.full(param.shape, -offset)
        tensors.update(_checkpoint_names(name, param, main.config, family))
    if zero_norms:
        tensors["model.norm.weight"] = torch.full_like(tensors["model.norm.weight"], -offset)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    if family == "qwen3_next":
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    else:
        tensors = load_file(out / "model.safetensors")  # the copies DeepSeek's checkpoints keep
        layer = f"model.layers.{main.config.num_hidden_layers}."
        tensors[layer + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[layer + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _checkpoint_names(name: str, tensor: torch.Tensor, config, family: str) -> dict[str, torch.Tensor]:
    """One of MtpModel's tensors as the family's checkpoints store it (experts one by one)."""
    name = name.removeprefix("layers.0.")
    if family == "qwen3_next":
        renamed = {"eh_proj.weight": "fc.weight", "enorm.weight": "pre_fc_norm_embedding.weight",
                   "hnorm.weight": "pre_fc_norm_hidden.weight", "post_norm.weight": "norm.weight"}
        prefix = "mtp." if name in renamed else "mtp.layers.0."
    else:
        renamed = {"post_norm.weight": "shared_head.norm.weight"}
        prefix = f"model.layers.{config.num_hidden_layers}."
    name = prefix + renamed.get(name, name).removeprefix("mtp_block.")
    if name.endswith("experts.gate_up_proj"):
        gate, up = tensor.chunk(2, dim=1)
        base = name.removesuffix("gate_up_proj")
        return {**{f"{base}{e}.gate_proj.weight": gate[e].contiguous() for e in range(len(tensor))},
                **{f"{base}{e}.up_proj.weight": up[e].contiguous() for e in range(len(tensor))}}
    if name.endswith("experts.down_proj"):
        base = name.removesuffix("down_proj")
        return {f"{base}{e}.down_proj.weight": tensor[e].contiguous() for e in range(len(tensor))}
    return {name: tensor.contiguous()}


@pytest.fixture(scope="module", params=[*FAMILIES, "glm4_moe"])
def mtp_model(request, tiny_family, tmp_path_factory) -> tuple[str, Path]:
    family = request.param
    return family, build_mtp_checkpoint(tiny_family(family), tmp_path_factory.mktemp(f"{family}_mtp") / "m", family)


class HfMtp:
    """transformers' target model and its MtpModel, loaded from the checkpoint."""

    def __init__(self, model_dir: Path, family: str):
        self.main = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        _with_mtp_config(self.main, family)
        self.mtp = MtpModel.from_pretrained(self.main).eval()

    given: torch.Tensor | None = None  # a prompt given as embeddings: its first positions' inputs

    @torch.inference_mode()
    def guesses(self, token_ids: list[int], num: int) -> tuple[list[int], torch.Tensor]:
        """The layer's `num` greedy guesses after `token_ids`: the first from the target's
        final hidden states at every position before the last token (as transformers'
        MTPCandidateGenerator reads them), each further one from the layer's own output; and
        the layer's output the first was read from. With `given`, the first positions' inputs
        are those embeddings (their ids placeholders), for the target and the layer alike."""
        embed = self.main.get_input_embeddings()
        inputs = embed(torch.tensor(token_ids))
        if self.given is not None:
            inputs[: len(self.given)] = self.given
        hidden = self.main(inputs_embeds=inputs[None, :-1], output_hidden_states=True).hidden_states[-1]
        layer_inputs = inputs[1:]
        guesses: list[int] = []
        for _ in range(num):
            positions = torch.arange(1, len(layer_inputs) + 1)[None]
            out = self.mtp.forward_layer(0, hidden, positions, None, inputs_embeds=layer_inputs[None])
            guesses.append(int(self.mtp._project_to_logits(out[:, -1]).argmax(-1)))
            layer_inputs = torch.cat([layer_inputs, embed(torch.tensor([guesses[-1]]))])
            hidden = torch.cat([hidden, out[:, -1:]], dim=1)
        return guesses, hidden[0, len(token_ids) - 1]


def run_checking_guesses(llm: LLM, hf: HfMtp, prompts: list[list[int]] | list[dict], params: SamplingParams,
                         together: bool = False) -> list[list[int]]:
    """Run the prompts (one after another, each to its end, or `together`; where `params.n` >
    1: siblings), checking at every step that each running request's guesses are transformers' from its
    tokens so far, and the layer's output its first guess is read from (every entry of its
    cache weighs in that); each request's output tokens."""
    engine, outputs, checked = llm.engine, {}, 0
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt if isinstance(prompt, dict) else {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests() and not (together and i < len(prompts) - 1):
            for out in engine.step():  # (each step's new tokens)
                for completion in out.outputs:
                    outputs.setdefault((out.request_id, completion.index), []).extend(completion.token_ids)
            for request in engine.scheduler.running:
                if request.spec_token_ids:
                    expected, state = hf.guesses(request.all_token_ids, len(request.spec_token_ids))
                    assert request.spec_token_ids == expected, (request.request_id, request.all_token_ids)
                    torch.testing.assert_close(engine.speculator.proposer._first[request.request_id][2], state,
                                               atol=1e-4, rtol=1e-4)
                    checked += 1
    assert checked >= 2 * len(prompts)
    proposer = engine.speculator.proposer  # its private and scratch blocks come back as requests end
    assert not (proposer.scratch.tables or proposer._private or proposer._first or proposer._fed)
    own_blocks = proposer.runner.num_blocks - engine.runner.num_blocks  # (beyond the target's twins)
    assert len(proposer.scratch.free) + len(proposer._private_free) == own_blocks
    return [tokens for _, tokens in sorted(outputs.items())]


def test_mtp_guesses_are_transformers_and_outputs_plain_decodings(mtp_model):
    """Step by step, with prompts prefilled over several steps, each running request's
    guesses are transformers' MTP layer's from its tokens so far; the outputs are the target's
    greedy ones."""
    family, model_dir = mtp_model
    args = dict(dtype="float32", num_gpu_blocks_override=64, max_model_len=128, max_num_batched_tokens=16,
                enable_prefix_caching=False)
    spec = LLM(str(model_dir), speculative_config={"method": "mtp", "num_speculative_tokens": 3}, **args)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = run_checking_guesses(spec, HfMtp(model_dir, family), PROMPTS, greedy)
    assert spec.engine.speculator.stats.num_draft_tokens >= 6
    plain = LLM(str(model_dir), **args).generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
    assert outputs == [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize("mtp_model", ["qwen3_next"], indirect=True)  # (the path is every family's)
def test_a_prompt_given_as_embeddings_feeds_the_layer_them_too(mtp_model):
    """The layer's rows of a prompt given as embeddings read those embeddings (the target's
    given rows, a position on), not its placeholder tokens'."""
    family, model_dir = mtp_model
    llm = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=64, max_model_len=128,
              max_num_batched_tokens=16, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    hf = HfMtp(model_dir, family)
    with torch.no_grad():
        hf.given = hf.main.get_input_embeddings()(torch.tensor(PROMPTS[0])) * 1.5
    run_checking_guesses(llm, hf, [{"prompt_embeds": hf.given}], SamplingParams(temperature=0.0, max_tokens=8,
                                                                                  ignore_eos=True))


def test_a_cached_prefix_and_siblings_have_the_layers_cache_too(mtp_model):
    """The layer's cache mirrors the target's blocks: a prompt whose first blocks come from
    the prefix cache, and the second completion of an n = 2 request (which takes its
    sibling's prompt blocks), guess as if they had computed the prompt themselves."""
    family, model_dir = mtp_model
    llm = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=64, max_model_len=128,
              enable_prefix_caching=True, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    shared = PROMPTS[0] + PROMPTS[1]  # (40 tokens: two full blocks and a part)
    prompts = [shared, shared[:32] + [5, 6, 7, 8, 9]]
    run_checking_guesses(llm, HfMtp(model_dir, family), prompts, SamplingParams(n=2, temperature=0.0, max_tokens=6,
                                                                                 ignore_eos=True))
    assert llm.engine.block_manager.stats.hits >= 32


def test_preempted_requests_guess_as_before(mtp_model):
    """A pool too small for every request at once preempts some; computed again, they guess as
    they would have, and the outputs are plain decoding's."""
    family, model_dir = mtp_model
    args = dict(dtype="float32", num_gpu_blocks_override=12, max_model_len=192, max_num_batched_tokens=32)
    llm = LLM(str(model_dir), speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **args)
    generator = torch.Generator().manual_seed(1)
    prompts = [*PROMPTS, *(torch.randint(3, 49152, (60,), generator=generator).tolist() for _ in range(2))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = run_checking_guesses(llm, HfMtp(model_dir, family), prompts, params, together=True)
    assert llm.engine.scheduler.num_preemptions > 0
    plain = LLM(str(model_dir), **args).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert outputs == [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_layer_that_agrees_has_every_guess_kept(tiny_family, tmp_path, family):
    """Zeroed final norms make the target and the layer both pick token 0 every time: every
    guess is kept, so each step carries the most guesses and keeps them, past block
    boundaries (a model with states computes the kept ones again), and the tokens are plain
    decoding's."""
    model_dir = build_mtp_checkpoint(tiny_family(family), tmp_path / "m", family, zero_norms=True)
    llm = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=64, max_model_len=128,
              speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 3})
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [[0] * 33] * 2
    stats = llm.engine.speculator.stats
    assert stats.acceptance_rate == 1.0 and stats.num_accepted_tokens >= 2 * 24


def test_mtp_is_refused_where_there_is_no_layer(tiny_llama_dir, tiny_family):
    with pytest.raises(ValueError, match="'mtp' needs a model with multi-token-prediction layers; LlamaForCausalLM"):
        LLM(str(tiny_llama_dir), num_gpu_blocks_override=16, speculative_config={"method": "mtp"})
    # DeepSeek-V3's config names a layer (transformers' default) that this checkpoint lacks
    with pytest.raises(ValueError, match=r"holds no multi-token-prediction layer \(no tensors named model\.layers\.2\."):
        LLM(str(tiny_family("deepseek_v3")), num_gpu_blocks_override=16, max_model_len=128,
            speculative_config={"method": "mtp"})


def test_an_mtp_layer_with_an_embedding_of_its_own_is_refused_by_name():
    from transformers import Qwen3NextConfig

    from worker.model_executor.models.mtp import check_has_mtp

    config = Qwen3NextConfig(architectures=["Qwen3NextForCausalLM"], mtp_num_hidden_layers=1)
    check_has_mtp(config)
    config.mtp_use_dedicated_embeddings = True
    with pytest.raises(ValueError, match="has an embedding of its own"):
        check_has_mtp(config)


@pytest.mark.parametrize(("config", "message"), [
    ({"method": "mtp", "model": "x"}, "'mtp' runs the model's own MTP layer: it takes no `model`"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "must be 'ngram', 'draft_model', 'mtp' or 'eagle3', got 'eagle'"),
])
def test_bad_mtp_config_is_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(config)


def test_vllm_names_for_mtp_are_its_method():
    for name in ("mtp", "deepseek_mtp", "qwen3_next_mtp", "glm4_moe_mtp"):
        spec = SpeculativeConfig.from_dict({"method": name})
        assert (spec.method, spec.num_speculative_tokens) == ("mtp", 1)


def test_a_split_targets_mtp_layer_is_whole_beside_rank_0(tiny_family, tmp_path):
    """Tensor parallelism splits the target over two ranks; its MTP layer runs whole in rank
    0's process, on the hidden states rank 0 holds whole, with its embedding and LM head."""
    model_dir = build_mtp_checkpoint(tiny_family("deepseek_v3"), tmp_path / "m", "deepseek_v3", zero_norms=True)
    llm = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=64, max_model_len=128, tensor_parallel_size=2,
              num_threads=1, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert llm.engine.speculator.proposer.runner.model_config.num_attention_heads == 4  # whole: 2 a rank split
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [[0] * 9] * 2
    assert llm.engine.speculator.stats.acceptance_rate == 1.0 and llm.engine.speculator.stats.num_accepted_tokens >= 2 * 4


def test_the_layers_blocks_go_to_the_host_and_back_with_the_targets(tiny_family, tmp_path):
    """With KV offloading, the layer's share of each evicted block (and the hidden state kept
    for it) goes to the host with the target's and comes back with it: a prompt whose prefix
    returns from the host guesses as if computed afresh."""
    family = "deepseek_v3"
    model_dir = build_mtp_checkpoint(tiny_family(family), tmp_path / "m", family)
    llm = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=12, max_model_len=192,
              kv_offloading_size=0.002, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert llm.engine.speculator.proposer.runner.host_pool.shape[2] == llm.engine.runner.num_host_blocks > 0
    generator = torch.Generator().manual_seed(0)
    first, other = (torch.randint(3, 49152, (n,), generator=generator).tolist() for n in (100, 150))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    run_checking_guesses(llm, HfMtp(model_dir, family), [first, other, first[:96] + [11, 12, 13]], params)
    assert llm.engine.block_manager.stats.host_hits >= 32


def test_an_fp8_checkpoints_layer_is_read_as_stored(tiny_family, tmp_path):
    """DeepSeek-V3's FP8 checkpoints store the layer's projections (eh_proj too, in some) in
    fp8 with block scales: the layer guesses as transformers' does on the same weights
    dequantized."""
    from test_quantization import BLOCK, write_fp8_checkpoint

    from worker.model_executor.models.quant import dequantize

    family = "deepseek_v3"
    fp8 = write_fp8_checkpoint(build_mtp_checkpoint(tiny_family(family), tmp_path / "m", family), tmp_path / "fp8",
                               BLOCK)
    tensors = load_file(fp8 / "model.safetensors")
    assert tensors["model.layers.2.eh_proj.weight"].dtype == torch.float8_e4m3fn
    oracle = build_mtp_checkpoint(tiny_family(family), tmp_path / "oracle", family)
    save_file({name: dequantize(tensors[name], tensors[name + "_scale_inv"], BLOCK) if name + "_scale_inv" in tensors
               else tensor for name, tensor in tensors.items() if not name.endswith("_scale_inv")},
              oracle / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(fp8), dtype="float32", num_gpu_blocks_override=64, max_model_len=128,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    run_checking_guesses(llm, HfMtp(oracle, family), PROMPTS, SamplingParams(temperature=0.0, max_tokens=8,
                                                                              ignore_eos=True))


def test_while_guessing_is_off_the_layer_keeps_up_but_makes_no_guess(tiny_family, tmp_path):
    """At disable_by_batch_size requests the layer still computes every row (its cache must
    keep up) but no first guess (its logits would go unused); once fewer run, guesses come at
    once, right."""
    family = "deepseek_v3"
    model_dir = build_mtp_checkpoint(tiny_family(family), tmp_path / "m", family)
    llm = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=64, max_model_len=128,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 2})
    engine, hf, guessed_alone = llm.engine, HfMtp(model_dir, family), 0
    for rid, prompt, max_tokens in (("long", PROMPTS[0], 12), ("short", PROMPTS[1], 4)):
        engine.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                              ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler.running
        if len(running) >= 2:
            assert not engine.speculator.proposer._first and not any(r.spec_token_ids for r in running)
        for request in running:
            if request.spec_token_ids:
                expected, _ = hf.guesses(request.all_token_ids, len(request.spec_token_ids))
                assert request.spec_token_ids == expected
                guessed_alone += 1
    assert guessed_alone >= 2
