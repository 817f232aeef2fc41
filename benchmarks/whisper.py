"""Whisper transcription throughput: the engine (`LLM.generate` with a clip per prompt) against
transformers' WhisperForConditionalGeneration on the same clips and the same CPU, in one
process.

    python benchmarks/whisper.py [--clips 32] [--tokens 32] [--dtype bfloat16] [--hf-batch 16]

The checkpoint is random, shaped as whisper-tiny (4 + 4 layers of width 384, 80 mel bins, the
30 s window), with the default model's tokenizer and Whisper's special tokens added (weights
are seeded; nothing is downloaded). Clips are 5 to 30 s of tones and noise (seed 0). Every
request decodes `--tokens` tokens greedily after `<|startoftranscript|><|en|><|transcribe|>
<|notimestamps|>` (no end: the random model's eos is ignored). The baseline runs batches of
`--hf-batch` clips: the encoder, then the decoder with transformers' KV cache a token at a
time, argmax. It prints generated tokens per second of each, their ratio, and the share of
requests whose tokens agree (a check, not a target: bfloat16 roundings differ). Then the engine
on two other sets of clips (the caches would serve the same), plainly and with token timestamps
asked for (extra_args, whisper-tiny's alignment heads: the word timestamps' cost), and their
ratio.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from worker import LLM, SamplingParams
from worker.model_executor.model_loader import resolve_model_path

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
RATE = 16_000
TOKENS = ("<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|translate|>", "<|notimestamps|>", "<|startofprev|>")


def build_checkpoint(out: Path) -> list[int]:
    """A random whisper-tiny in `out`; the decoder prompt's token ids."""
    from transformers import (
        AutoTokenizer,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
    )

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(None))
    tokenizer.add_special_tokens({"additional_special_tokens": list(TOKENS)})
    tokenizer.chat_template = None
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    torch.manual_seed(0)
    config = WhisperConfig(vocab_size=len(tokenizer), num_mel_bins=80, d_model=384, encoder_layers=4, decoder_layers=4,
                           encoder_attention_heads=6, decoder_attention_heads=6, encoder_ffn_dim=1536,
                           decoder_ffn_dim=1536, max_source_positions=1500, max_target_positions=448,
                           decoder_start_token_id=tokenizer.convert_tokens_to_ids(TOKENS[0]),
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    WhisperForConditionalGeneration(config).save_pretrained(out)
    WhisperFeatureExtractor(feature_size=80).save_pretrained(out)
    generation = json.loads((out / "generation_config.json").read_text())
    heads = [[2, 2], [3, 0], [3, 2], [3, 3], [3, 4], [3, 5]]  # whisper-tiny's
    (out / "generation_config.json").write_text(json.dumps({**generation, "alignment_heads": heads}))
    return tokenizer.encode("<|startoftranscript|><|en|><|transcribe|><|notimestamps|>", add_special_tokens=False)


def clips_of(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = np.arange(int(rng.uniform(5, 30) * RATE)) / RATE
        tones = sum(rng.uniform(0.1, 0.3) * np.sin(2 * np.pi * rng.uniform(100, 3000) * t) for _ in range(3))
        out.append((tones + rng.normal(0, 0.02, t.shape)).astype(np.float32))
    return out


def hf_greedy(model_dir: Path, prompt: list[int], clips: list[np.ndarray], tokens: int, batch: int,
              dtype: torch.dtype) -> tuple[list[list[int]], float]:
    """transformers' greedy tokens for each clip, and the seconds they took (features included)."""
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    extractor = WhisperFeatureExtractor.from_pretrained(model_dir)
    model = WhisperForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).eval()
    out: list[list[int]] = []
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(clips), batch):
            chunk = clips[first : first + batch]
            features = extractor(chunk, sampling_rate=RATE, return_tensors="pt")["input_features"].to(dtype)
            encoded = model.model.encoder(features).last_hidden_state
            ids = torch.tensor([prompt] * len(chunk))
            step = model(encoder_outputs=(encoded,), decoder_input_ids=ids, use_cache=True)
            generated = [step.logits[:, -1].argmax(-1)]
            for _ in range(tokens - 1):
                step = model(encoder_outputs=(encoded,), decoder_input_ids=generated[-1][:, None],
                             past_key_values=step.get("cache", step.get("past_key_values")), use_cache=True)
                generated.append(step.logits[:, -1].argmax(-1))
            out += torch.stack(generated, dim=1).tolist()
    return out, time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clips", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--hf-batch", type=int, default=16)
    args = ap.parse_args()
    clips = clips_of(args.clips)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        prompt = build_checkpoint(model_dir)
        llm = LLM(str(model_dir), dtype=args.dtype, max_num_seqs=args.clips)
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        requests = [{"prompt_token_ids": prompt, "multi_modal_data": {"audio": (c, RATE)}} for c in clips]
        llm.generate(requests[:2], params, use_tqdm=False)  # warm up
        start = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        engine_s = time.perf_counter() - start
        # other clips (the same would be served by the prefix and encoder caches), plain then timed
        timed = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True,
                               extra_args={"token_timestamps": True})
        laps = []
        for seed, run in ((1, params), (2, timed)):
            others = [{"prompt_token_ids": prompt, "multi_modal_data": {"audio": (c, RATE)}}
                      for c in clips_of(args.clips, seed)]
            start = time.perf_counter()
            llm.generate(others, run, use_tqdm=False)
            laps.append(time.perf_counter() - start)
        del llm
        expected, hf_s = hf_greedy(model_dir, prompt, clips, args.tokens, args.hf_batch, DTYPES[args.dtype])
    total = args.clips * args.tokens
    agree = sum(o.outputs[0].token_ids == e for o, e in zip(outputs, expected, strict=True)) / args.clips
    print(f"engine: {total / engine_s:.1f} tokens/s ({engine_s:.2f} s); transformers (batches of {args.hf_batch}): "
          f"{total / hf_s:.1f} tokens/s ({hf_s:.2f} s)")
    print(f"engine / transformers: {hf_s / engine_s:.2f}x; requests whose tokens agree: {agree:.0%}")
    print(f"engine on other clips: {total / laps[0]:.1f} tokens/s plain, {total / laps[1]:.1f} with token timestamps "
          f"({laps[0] / laps[1]:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
