"""Linear attention (Qwen3.5's Gated DeltaNet, worker.model_executor.models.linear_attention) at a real
layer's size, in one run:

1. a prefill through the gated delta rule, solved 64 tokens at a time in closed form, against
   transformers' token-by-token recurrence (the reference it is tested against);
2. a step's decodes through one layer: together (their states gathered from their slots,
   one recurrence step by matmul), against one request at a time (the prefill path with
   chunks of one token).

    python benchmarks/linear_attention.py [--tokens 512] [--decodes 32] [--threads 2]

Random weights and inputs, float32, on the CPU. Prints each pair's milliseconds and ratio.

On a CUDA machine, `--paths` times one layer's steps on the torch path (chunks of 64 in closed
form, request by request; decodes by gather and matmul) against the kernel path (Triton: the
rule over every request's rows in one launch, the decodes' convolution in another), the same
layer and states: a 4096-token prompt, 16 prompts of 256 tokens, 128 decodes
(`benchmarks/gpu_check.py` runs it).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from worker.model_executor.models.config import LinearAttentionConfig
from worker.model_executor.models.linear_attention import (
    GatedDeltaNet,
    LinearStates,
    gated_delta_rule,
)

# Qwen3.5's linear layers at 2B..9B: 16 key heads and 32 value heads of 128, hidden 2048
SHAPE = LinearAttentionConfig(num_key_heads=16, num_value_heads=32, key_head_dim=128, value_head_dim=128,
                              conv_kernel=4)
HIDDEN = 2048


def ms(fn: Callable[[], object], repeats: int, cuda: bool = False) -> float:
    fn()  # warm-up
    sync = torch.cuda.synchronize if cuda else lambda: None
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats * 1000


def prefill(tokens: int) -> tuple[float, float]:
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    heads, dk, dv = SHAPE.num_value_heads, SHAPE.key_head_dim, SHAPE.value_head_dim
    q, k = torch.nn.functional.normalize(torch.randn(2, tokens, heads, dk), dim=-1).unbind(0)
    v, g, beta = torch.randn(tokens, heads, dv), -torch.rand(tokens, heads), torch.rand(tokens, heads)
    state = torch.zeros(heads, dk, dv)
    chunked = ms(lambda: gated_delta_rule(q * dk**-0.5, k, v, g, beta, state.clone()), 3)
    recurrent = ms(lambda: torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=state[None].clone(), output_final_state=True), 3)
    return chunked, recurrent


def decodes(count: int) -> tuple[float, float]:
    layer = GatedDeltaNet(SHAPE, HIDDEN, 1e-6, 0).eval()
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.02)
    states = LinearStates(SHAPE, 1, count, torch.float32, torch.device("cpu"))
    x = torch.randn(count, HIDDEN)
    together = states.for_step([(f"r{i}", 0, 1, None, (), 0) for i in range(count)])
    one_by_one = states.for_step([(f"r{i}", 1, 1, None, (), 0) for i in range(count)])
    one_by_one.num_decodes = 0  # the same requests' rows, each through the per-request path
    return ms(lambda: layer(x, None, None, together), 5), ms(lambda: layer(x, None, None, one_by_one), 5)


def paths(device: torch.device) -> list[str]:
    """One layer's steps on the torch path and on the kernel path, a line each."""
    layers = [GatedDeltaNet(SHAPE, HIDDEN, 1e-6, 0, use_kernels=kernel).to(device).eval() for kernel in (False, True)]
    for param in layers[0].parameters():
        torch.nn.init.normal_(param, std=0.02)
    layers[1].load_state_dict(layers[0].state_dict())
    lines = []
    for what, requests, tokens in (("a 4096-token prompt", 1, 4096), ("16 prompts of 256 tokens", 16, 256),
                                   ("128 decodes", 128, 1)):
        x = torch.randn(requests * tokens, HIDDEN, device=device)
        step = [(f"r{i}", 0, tokens, None, (), 0) for i in range(requests)]
        times = []
        for layer in layers:
            meta = LinearStates(SHAPE, 1, requests, torch.float32, device).for_step(step)
            times.append(ms(lambda layer=layer, meta=meta, x=x: layer(x, None, None, meta), 5, device.type == "cuda"))
        lines.append(f"one linear-attention layer, {what}: torch path {times[0]:.2f} ms, kernel path {times[1]:.2f} ms "
                     f"({times[0] / times[1]:.1f}x)")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--decodes", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--paths", action="store_true", help="torch path against kernel path, on CUDA")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.paths:
        with torch.inference_mode():
            print("\n".join(paths(torch.device("cuda"))))
        return
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        chunked, recurrent = prefill(args.tokens)
        together, alone = decodes(args.decodes)
    heads = f"{SHAPE.num_value_heads} heads of {SHAPE.key_head_dim}x{SHAPE.value_head_dim}"
    print(f"prefill of {args.tokens} tokens through the delta rule ({heads}): chunks of 64 {chunked:.0f} ms, "
          f"token by token {recurrent:.0f} ms ({recurrent / chunked:.1f}x)")
    print(f"{args.decodes} decodes through one linear-attention layer (hidden {HIDDEN}): together {together:.0f} ms, "
          f"one request at a time {alone:.0f} ms ({alone / together:.2f}x)")


if __name__ == "__main__":
    main()
