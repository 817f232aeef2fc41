"""Images (and audio clips) in prompts (vLLM's `multi_modal_data`): an image-text model's
vision encoder turns each image into embeddings that take the place of its placeholder tokens
in the prompt; an audio-text model's audio encoder does so with each clip.

Supported:

- Gemma 3 (4B, 12B, 27B: SigLIP and Gemma 3's pooling projector). Each <start_of_image>
  is widened into itself, the image's tokens and <end_of_image>, set off by blank lines,
  and an image's tokens attend to each other both ways: the scheduler never ends a
  prefill chunk inside an image, and attention lets those rows see to the image's end.
- Mistral 3 (Mistral Small 3.1 and 3.2: Pixtral's vision encoder and Mistral 3's
  projector). Each image token (`[IMG]`) is widened into the image's rows of `[IMG]`
  tokens, each row ended by `[IMG_BREAK]` and the last by `[IMG_END]`.
- Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5, dense and MoE (their vision transformers and patch mergers; Qwen3-VL's
  deepstack embeddings too, added to its first layers' output). Each image token
  (`<|image_pad|>`, which the chat template puts between `<|vision_start|>` and
  `<|vision_end|>`) is widened into one per merged patch, and the prompt's positions become
  M-RoPE's three streams: an image's tokens are placed by their row and column, and the
  text after it goes on from the image's largest position, so a sequence's rotary
  positions run behind its length by a fixed delta from its last image on.

- Qwen2-Audio takes audio clips instead (vLLM's `multi_modal_data={"audio": ...}`; chat
  parts `input_audio`, `audio_url`, `audio`): each clip (producer.audio reads WAV bytes, data
  URLs or samples, resampled to 16 kHz) becomes its Whisper log-mel features, in the
  encoder's 30 s window, and its <|AUDIO|> one token per two encoder frames that hold sound.
  The same machinery carries them as it does images: a clip is an item of the prompt, its
  features its "pixels", its mel frames its size.

A prompt names each image (or clip) where it goes with the model's image (or audio) token,
one per item in order, as the processors of transformers do. Chat messages carry images as content parts
(api and LLM.chat), which the chat template turns into that token.

Images are resized and normalized by the checkpoint's own image processor (transformers', on
PIL), and encoded once, by transformers' vision modules over the checkpoint's weights, when
a step first computes the image's tokens (ImageEmbeddings): an image costs a fraction of
the language model's time, which genq's own runner spends. The embeddings stay with the
request until it ends (chunked prefill and recomputation after preemption read them
again), in host memory, from which each step copies the rows it computes; the embeddings
of the images encoded lately are kept on the device by their pixels' digest, in memory the
KV cache sizing sets aside, so a conversation that sends its image again with every turn
has it encoded once. Each image's pixels are hashed into the
prefix-cache keys of the blocks its tokens fill, so equal text around another image shares
nothing it should not.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import logging
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from producer.data_urls import bytes_if_data_url, image_url_of, is_data_url
from worker.model_executor.model_loader import iter_safetensors
from worker.model_executor.models.config import architecture_of

logger = logging.getLogger(__name__)


def takes_images(model_path: Path, hf_config: Any) -> bool:
    """An image-text checkpoint genq encodes images for, with its image processor's config
    (without one it serves text alone, as other image-text models do)."""
    arch = architecture_of(hf_config)
    if arch not in IMAGE_ARCHITECTURES:
        return False
    if not (model_path / "preprocessor_config.json").exists():
        logger.warning("%s has no preprocessor_config.json: serving text alone, no images", model_path)
        return False
    return True


@dataclass(frozen=True)
class ImageSpan:
    """Where one image's tokens lie in the prompt, and what its pixels hash to."""

    offset: int
    length: int  # its tokens, row breaks and end included
    digest: int


@dataclass(frozen=True)
class PreparedImages:
    """A prompt's images as the encoder takes them, before the prompt's tokens are known."""

    pixel_values: list[torch.Tensor]  # per image, as the model's image processor lays them out
    image_sizes: torch.Tensor  # [num_images, 2]: (height, width) as resized; [num_images, 3]: Qwen's patch grid
    digests: list[int]  # of each image's pixels


@dataclass
class ImageInputs:
    """A prompt's images, processed: pixels for the encoder and where their tokens go."""

    pixel_values: list[torch.Tensor]  # per image
    image_sizes: torch.Tensor  # [num_images, 2 or 3]
    spans: list[ImageSpan]
    positions: list[int]  # the prompt positions the images' embeddings fill (image tokens), in order
    num_embeds: list[int]  # of those, each image's
    # M-RoPE: the prompt's rotary positions in three streams ([3, prompt length]), and what
    # the positions after the prompt add to their index; None where positions are plain
    rope_positions: torch.Tensor | None = None
    rope_delta: int = 0

    def span_keys(self) -> list[tuple[int, int, int]]:
        """(offset, length, digest) per image: plain data for the block manager's hashes."""
        return [(s.offset, s.length, s.digest) for s in self.spans]

    def embed_ranges(self) -> list[tuple[int, int]]:
        """[first, last + 1) of each image's embedding positions (contiguous where images
        attend both ways)."""
        ranges, k = [], 0
        for n in self.num_embeds:
            ranges.append((self.positions[k], self.positions[k + n - 1] + 1))
            k += n
        return ranges


class ImageProcessor:
    """Turns a prompt's placeholders and images into its token ids and ImageInputs (CPU).
    A model's subclass says how many tokens an image takes and which they are."""

    # an image's tokens attend to each other both ways (Gemma 3): each is computed in one chunk
    both_ways = False
    modality = "image"  # what the model's prompts carry: "image", or "audio" (clips: AudioClips)
    # the media go to an encoder whose output the decoder cross-attends (Whisper), not into the
    # prompt's rows; the prompt's text is the decoder's, tokenized as it is written
    encoder_decoder = False

    def __init__(self, model_path: Path, hf_config: Any, tokenizer: Any, overrides: dict[str, Any] | None = None):
        from transformers import AutoImageProcessor

        self.images = AutoImageProcessor.from_pretrained(model_path, backend="pil")
        if overrides:
            _check_overrides(self.images, overrides)
            self.images = AutoImageProcessor.from_pretrained(model_path, backend="pil", **overrides)
        # the token whose rows take the image's embeddings, and the one a prompt writes per image
        self.image_token_id = int(getattr(hf_config, "image_token_index", None) or hf_config.image_token_id)
        self.placeholder_id = self.image_token_id

    def expand_text(self, text: str) -> str:
        """A text prompt as the model's processor writes it around each placeholder before
        tokenizing (so that the text beside an image tokenizes as it does there)."""
        return text

    def prepare(self, images: list[Any]) -> PreparedImages:
        """Images read, resized and normalized, and their pixels hashed: the costly part, which
        holds no state, so a thread other than the engine's may do it (worker.queue.engine_thread)."""
        return self._prepare([self._read(image, i) for i, image in enumerate(images)])

    def _read(self, item: Any, index: int) -> Any:
        """One image of a prompt as `_prepare` takes it."""
        return _as_image(item, index)

    def _prepare(self, pictures: list[Any]) -> PreparedImages:
        raise NotImplementedError

    def _tokens(self, size: torch.Tensor) -> tuple[list[int], int]:
        """An image's tokens, and how many of them take its embeddings."""
        raise NotImplementedError

    def process(self, prompt_ids: list[int], images: list[Any] | PreparedImages) -> tuple[list[int], ImageInputs]:
        """The prompt with each image token widened to its image's tokens; ValueError when the
        placeholders and images do not pair up."""
        found = prompt_ids.count(self.placeholder_id)
        count = len(images.digests) if isinstance(images, PreparedImages) else len(images)
        if found != count:
            kind = self.modality
            raise ValueError(f"the prompt has {found} {kind} placeholder(s) (token id {self.placeholder_id}) "
                             f"but {count} {kind} item(s) were given: put one placeholder where each goes")
        prepared = images if isinstance(images, PreparedImages) else self.prepare(images)
        ids: list[int] = []
        spans: list[ImageSpan] = []
        positions: list[int] = []
        num_embeds: list[int] = []
        for token in prompt_ids:
            if token != self.placeholder_id:
                ids.append(token)
                continue
            k = len(spans)
            tokens, embeds = self._tokens(prepared.image_sizes[k])
            positions += [len(ids) + i for i, t in enumerate(tokens) if t == self.image_token_id]
            num_embeds.append(embeds)
            spans.append(ImageSpan(len(ids), len(tokens), prepared.digests[k]))
            ids += tokens
        inputs = ImageInputs(prepared.pixel_values, prepared.image_sizes, spans, positions, num_embeds)
        return ids, self._placed(ids, inputs)

    def _placed(self, ids: list[int], inputs: ImageInputs) -> ImageInputs:
        """The inputs with the prompt's rotary positions, where the model places images by them."""
        return inputs


class Mistral3Images(ImageProcessor):
    """Pixtral's patches, two merged each way: a row of [IMG] per row of merged patches, each
    row ended by [IMG_BREAK], the last by [IMG_END] (PixtralProcessor.replace_image_token)."""

    def __init__(self, model_path: Path, hf_config: Any, tokenizer: Any, overrides: dict[str, Any] | None = None):
        super().__init__(model_path, hf_config, tokenizer, overrides)
        processor = _read_json(model_path / "processor_config.json")
        self.break_token_id = tokenizer.convert_tokens_to_ids(processor.get("image_break_token", "[IMG_BREAK]"))
        self.end_token_id = tokenizer.convert_tokens_to_ids(processor.get("image_end_token", "[IMG_END]"))
        self.patch = int(hf_config.vision_config.patch_size) * int(getattr(hf_config, "spatial_merge_size", 1))

    def _prepare(self, pictures: list[Any]) -> PreparedImages:
        batch = self.images(images=pictures, patch_size=self.patch, return_tensors="pt")
        pixels, sizes = batch["pixel_values"], batch["image_sizes"]  # padded to the largest; [n, 2]
        digests = [_digest(pixels[k][:, : int(sizes[k][0]), : int(sizes[k][1])], sizes[k]) for k in range(len(pictures))]
        return PreparedImages(list(pixels), sizes, digests)

    def _tokens(self, size: torch.Tensor) -> tuple[list[int], int]:
        rows, cols = (int(n) // self.patch for n in size)
        tokens = ([self.image_token_id] * cols + [self.break_token_id]) * rows
        tokens[-1] = self.end_token_id
        return tokens, rows * cols


class Gemma3Images(ImageProcessor):
    """Gemma 3: each image resized to the vision tower's square (no pan and scan), and its
    <start_of_image> widened to itself, mm_tokens_per_image image tokens and <end_of_image>,
    with a blank line before and after in a text prompt (Gemma3Processor's
    full_image_sequence). The image tokens attend to each other both ways."""

    both_ways = True

    def __init__(self, model_path: Path, hf_config: Any, tokenizer: Any, overrides: dict[str, Any] | None = None):
        if (overrides or {}).get("do_pan_and_scan"):
            raise ValueError("mm_processor_kwargs: Gemma 3's pan and scan (do_pan_and_scan) is not supported")
        super().__init__(model_path, hf_config, tokenizer, overrides)
        if getattr(self.images, "do_pan_and_scan", False):
            logger.warning("%s asks for pan and scan, which genq does not do: each image is resized whole", model_path)
        self.placeholder_id = int(hf_config.boi_token_index)
        self.end_token_id = int(hf_config.eoi_token_index)
        self.num_tokens = int(hf_config.mm_tokens_per_image)
        self.placeholder = tokenizer.convert_ids_to_tokens(self.placeholder_id)

    def expand_text(self, text: str) -> str:
        return text.replace(self.placeholder, f"\n\n{self.placeholder}\n\n")

    def _prepare(self, pictures: list[Any]) -> PreparedImages:
        pixels = self.images(images=pictures, do_pan_and_scan=False, return_tensors="pt")["pixel_values"]
        sizes = torch.tensor([list(p.shape[-2:]) for p in pixels])  # [n, 2], all the tower's square
        return PreparedImages(list(pixels), sizes, [_digest(p, size) for p, size in zip(pixels, sizes, strict=True)])

    def _tokens(self, size: torch.Tensor) -> tuple[list[int], int]:
        return [self.placeholder_id, *[self.image_token_id] * self.num_tokens, self.end_token_id], self.num_tokens


class QwenVLImages(ImageProcessor):
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL: an image token per merged patch, and M-RoPE positions for the prompt
    (transformers' Qwen2_5_VLModel.get_rope_index, for still images; Qwen2-VL's and Qwen3-VL's are the same)."""

    def __init__(self, model_path: Path, hf_config: Any, tokenizer: Any, overrides: dict[str, Any] | None = None):
        super().__init__(model_path, hf_config, tokenizer, overrides)
        self.merge = int(hf_config.vision_config.spatial_merge_size)

    def _prepare(self, pictures: list[Any]) -> PreparedImages:
        batch = self.images(images=pictures, return_tensors="pt")
        grids = batch["image_grid_thw"]  # [n, 3]: each image's patches, in time, height and width
        pixels = list(batch["pixel_values"].split(grids.prod(-1).tolist()))  # [patches, channels x patch] each
        return PreparedImages(pixels, grids, [_digest(p, g) for p, g in zip(pixels, grids, strict=True)])

    def _tokens(self, size: torch.Tensor) -> tuple[list[int], int]:
        count = int(size.prod()) // self.merge**2
        return [self.image_token_id] * count, count

    def _placed(self, ids: list[int], inputs: ImageInputs) -> ImageInputs:
        """Text tokens count on one by one in all three streams; an image's tokens sit at the
        position it starts at, plus their (time, row, column) among its merged patches, and
        the text after it goes on from that position plus its larger side."""
        rope = torch.empty(3, len(ids), dtype=torch.long)
        at, done = 0, 0  # the next text position; the tokens placed so far
        for span, grid in zip(inputs.spans, inputs.image_sizes.tolist(), strict=True):
            rope[:, done : span.offset] = torch.arange(at, at + span.offset - done)
            at += span.offset - done
            t, h, w = grid[0], grid[1] // self.merge, grid[2] // self.merge
            grid_positions = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w),
                                                        indexing="ij")).reshape(3, -1)
            rope[:, span.offset : span.offset + span.length] = grid_positions + at
            at += max(h, w)
            done = span.offset + span.length
        rope[:, done:] = torch.arange(at, at + len(ids) - done)
        inputs.rope_positions = rope
        inputs.rope_delta = int(rope.max()) + 1 - len(ids) if len(ids) else 0
        return inputs


class AudioClips(ImageProcessor):
    """Qwen2-Audio: each clip's log-mel features (its checkpoint's Whisper feature extractor,
    padded to the encoder's 30 s window), and its <|AUDIO|> widened to one token per two
    encoder frames that hold sound (Qwen2AudioProcessor's count). The clip's length in mel
    frames is its `size`; a clip longer than the window is refused, not cut."""

    modality = "audio"

    def __init__(self, model_path: Path, hf_config: Any, tokenizer: Any, overrides: dict[str, Any] | None = None):
        from transformers import WhisperFeatureExtractor

        if overrides:
            raise ValueError(f"mm_processor_kwargs: audio models take none, got {sorted(overrides)}")
        self.features = WhisperFeatureExtractor.from_pretrained(model_path)
        self.image_token_id = self.placeholder_id = int(hf_config.audio_token_index)

    def _read(self, item: Any, index: int) -> Any:
        from producer.audio import read_clip

        clip = read_clip(item, f"audio {index}", self.features.sampling_rate)
        if len(clip) > self.features.n_samples:
            raise ValueError(f"audio {index} lasts {len(clip) / self.features.sampling_rate:.1f} s, longer than "
                             f"the model's window of {self.features.chunk_length} s: split it")
        return clip

    def _prepare(self, pictures: list[Any]) -> PreparedImages:
        batch = self.features(pictures, sampling_rate=self.features.sampling_rate, return_attention_mask=True,
                              padding="max_length", return_tensors="pt")
        features, lengths = batch["input_features"], batch["attention_mask"].sum(-1)
        sizes = lengths[:, None]  # [n, 1]: each clip's mel frames
        for k, size in enumerate(sizes):
            if self._tokens(size)[1] < 1:
                raise ValueError(f"audio {k} lasts {1000 * len(pictures[k]) / self.features.sampling_rate:.0f} ms, "
                                 "too short to make a single audio token")
        digests = [_digest(f[:, : int(n)], n) for f, n in zip(features, sizes, strict=True)]
        return PreparedImages(list(features), sizes, digests)

    def _tokens(self, size: torch.Tensor) -> tuple[list[int], int]:
        frames = (int(size[0]) - 1) // 2 + 1  # after the encoder's strided convolution
        count = (frames - 2) // 2 + 1  # after its pooling
        return [self.image_token_id] * count, count


class WhisperClips(AudioClips):
    """Whisper: the prompt is the decoder's (`<|startoftranscript|><|en|><|transcribe|>...`),
    written with no placeholder, and its one clip goes to the encoder, whose output every
    decoder layer's cross-attention reads (worker.model_executor.models.whisper). The clip's digest keys the
    prompt's blocks in the prefix cache: the same prompt over other audio shares nothing."""

    encoder_decoder = True

    def __init__(self, model_path: Path, hf_config: Any, tokenizer: Any, overrides: dict[str, Any] | None = None):
        from transformers import WhisperFeatureExtractor

        if overrides:
            raise ValueError(f"mm_processor_kwargs: audio models take none, got {sorted(overrides)}")
        self.features = WhisperFeatureExtractor.from_pretrained(model_path)
        self.image_token_id = self.placeholder_id = -1

    def process(self, prompt_ids: list[int], images: list[Any] | PreparedImages) -> tuple[list[int], ImageInputs]:
        count = len(images.digests) if isinstance(images, PreparedImages) else len(images)
        if count != 1:
            raise ValueError(f"a Whisper prompt takes exactly one audio clip, got {count}")
        prepared = images if isinstance(images, PreparedImages) else self.prepare(images)
        span = ImageSpan(0, len(prompt_ids), prepared.digests[0])
        return prompt_ids, ImageInputs(prepared.pixel_values, prepared.image_sizes, [span], [], [0])

    def _tokens(self, size: torch.Tensor) -> tuple[list[int], int]:
        return [], 1  # (no tokens in the prompt; any clip of a sample or more is taken)


class ImageEncoder(nn.Module):
    """A model's vision modules (transformers') over the checkpoint's weights: images in,
    one embedding per image token out. `prefixes`: the weights' names it loads."""

    prefixes: tuple[str, ...] = ()

    @classmethod
    def load(cls, model_path: Path, hf_config: Any, dtype: torch.dtype, device: torch.device,
             dummy: bool = False) -> ImageEncoder:
        """The checkpoint's encoder; `dummy`: seeded random weights (transformers' own init,
        drawn on the CPU, so every device starts from the same values), no checkpoint read."""
        if dummy:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                encoder = cls(hf_config)
                with torch.no_grad():  # matrices transformers starts at zeros (Gemma 3's projection) would make
                    for param in encoder.parameters():  # every image the same
                        if param.dim() >= 2 and not param.any():
                            param.normal_(0.0, param.shape[0] ** -0.5)
                return encoder.to(device=device, dtype=dtype).eval()
        encoder = cls(hf_config)
        vision = iter_safetensors(model_path, keep=lambda name: name.removeprefix("model.").startswith(cls.prefixes))
        encoder.load_state_dict({name.removeprefix("model."): tensor for name, tensor in vision}, strict=True)
        return encoder.to(device=device, dtype=dtype).eval()

    def _placement(self) -> tuple[torch.device, torch.dtype]:
        weight = next(self.parameters())
        return weight.device, weight.dtype


class Mistral3Encoder(ImageEncoder):
    """Mistral 3's vision tower (Pixtral) and projector."""

    prefixes = ("vision_tower.", "multi_modal_projector.")

    def __init__(self, hf_config: Any):
        super().__init__()
        from transformers import AutoModel
        from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector

        self.config = hf_config
        self.vision_tower = AutoModel.from_config(hf_config.vision_config)
        self.multi_modal_projector = Mistral3MultiModalProjector(hf_config)

    @torch.inference_mode()
    def forward(
        self, pixel_values: list[torch.Tensor], image_sizes: torch.Tensor  # [3, H, W] each (padded alike), [n, 2]
    ) -> torch.Tensor:  # [the images' image tokens, hidden], image after image
        device, dtype = self._placement()
        sizes = image_sizes.to(device)
        out = self.vision_tower(torch.stack(pixel_values).to(device=device, dtype=dtype), image_sizes=sizes,
                                output_hidden_states=True, return_dict=True)
        layer = self.config.vision_feature_layer
        layers = [layer] if isinstance(layer, int) else list(layer)
        features = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
        return self.multi_modal_projector(features.squeeze(0), sizes)


class Gemma3Encoder(ImageEncoder):
    """Gemma 3's vision tower (SigLIP) and projector (average-pooled to mm_tokens_per_image,
    normed, projected)."""

    prefixes = ("vision_tower.", "multi_modal_projector.")

    def __init__(self, hf_config: Any):
        super().__init__()
        from transformers import AutoModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        self.vision_tower = AutoModel.from_config(hf_config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(hf_config)

    @torch.inference_mode()
    def forward(
        self, pixel_values: list[torch.Tensor], image_sizes: torch.Tensor  # [3, H, W] each
    ) -> torch.Tensor:  # [the images' image tokens, hidden], image after image
        device, dtype = self._placement()
        features = self.vision_tower(pixel_values=torch.stack(pixel_values).to(device=device, dtype=dtype)).last_hidden_state
        embeds = self.multi_modal_projector(features)  # [n, mm_tokens_per_image, hidden]
        return embeds.reshape(-1, embeds.shape[-1])


class QwenVLEncoder(ImageEncoder):
    """Qwen2-VL's, Qwen2.5-VL's or Qwen3-VL's vision transformer, whose patch merger ends in
    the language model's width. Qwen3-VL's deepstack mergers give more embeddings per image
    token, from earlier blocks, which the language model adds to its first layers' output."""

    prefixes = ("visual.",)

    def __init__(self, hf_config: Any):
        super().__init__()
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
        from transformers.models.qwen2_vl import modeling_qwen2_vl
        from transformers.models.qwen3_5 import modeling_qwen3_5
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
        from transformers.models.qwen3_vl import modeling_qwen3_vl
        from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe

        vision: Any = {"qwen2_vl": modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel,
                       "qwen2_5_vl": modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel,
                       "qwen3_vl": modeling_qwen3_vl.Qwen3VLVisionModel,
                       "qwen3_vl_moe": modeling_qwen3_vl_moe.Qwen3VLMoeVisionModel,
                       "qwen3_5": modeling_qwen3_5.Qwen3_5VisionModel,
                       "qwen3_5_moe": modeling_qwen3_5_moe.Qwen3_5MoeVisionModel}[hf_config.model_type]
        self.visual = vision._from_config(hf_config.vision_config)

    @torch.inference_mode()
    def forward(
        self, pixel_values: list[torch.Tensor], image_sizes: torch.Tensor  # [patches, C x patch] each, [n, 3]
    ) -> torch.Tensor:  # [the images' image tokens, hidden] image after image; [.., 1 + deepstack, hidden]
        device, dtype = self._placement()
        out = self.visual(torch.cat(pixel_values).to(device=device, dtype=dtype), grid_thw=image_sizes.to(device))
        deepstack = getattr(out, "deepstack_features", None)
        return torch.stack([out.pooler_output, *deepstack], dim=1) if deepstack else out.pooler_output


class Qwen2AudioEncoder(ImageEncoder):
    """Qwen2-Audio's audio tower (Whisper's encoder, then pooled two to one) and projector:
    each clip's features in, one embedding per frame that holds sound out (the padding's are
    masked in the tower's attention, and dropped)."""

    prefixes = ("audio_tower.", "multi_modal_projector.")

    def __init__(self, hf_config: Any):
        super().__init__()
        from transformers.models.qwen2_audio import modeling_qwen2_audio

        self.audio_tower = modeling_qwen2_audio.Qwen2AudioEncoder._from_config(hf_config.audio_config)
        self.multi_modal_projector = modeling_qwen2_audio.Qwen2AudioMultiModalProjector(hf_config)

    @torch.inference_mode()
    def forward(
        self, features: list[torch.Tensor], sizes: torch.Tensor  # [mels, window] each, [n, 1] frames
    ) -> torch.Tensor:  # [the clips' audio tokens, hidden] clip after clip
        device, dtype = self._placement()
        batch = torch.stack(features).to(device=device, dtype=dtype)
        lengths = sizes[:, 0].to(device)
        frames = (lengths - 1) // 2 + 1  # the tower's positions that hold sound
        positions = (batch.shape[-1] - 2) // 2 + 1
        valid = torch.arange(positions, device=device)[None, :] < frames[:, None]  # [n, positions]
        mask = torch.zeros(valid.shape, device=device, dtype=dtype).masked_fill(~valid, torch.finfo(dtype).min)
        hidden = self.audio_tower(batch, attention_mask=mask[:, None, None, :]).last_hidden_state
        embeds = self.multi_modal_projector(hidden)  # [n, positions / 2, hidden]
        counts = (frames - 2) // 2 + 1
        return torch.cat([e[: int(c)] for e, c in zip(embeds, counts, strict=True)])


class WhisperEncoder(ImageEncoder):
    """Whisper's encoder (transformers' module): each clip's features in, its encoder output
    ([clips, positions, hidden]) out, which the decoder's cross_kv turns into keys and values."""

    prefixes = ("encoder.",)

    def __init__(self, hf_config: Any):
        super().__init__()
        from transformers.models.whisper import modeling_whisper

        self.encoder = modeling_whisper.WhisperEncoder._from_config(hf_config)

    @torch.inference_mode()
    def forward(self, features: list[torch.Tensor], sizes: torch.Tensor) -> torch.Tensor:
        device, dtype = self._placement()
        return self.encoder(torch.stack(features).to(device=device, dtype=dtype)).last_hidden_state


# an image-text architecture genq encodes images for -> how its prompts and pixels are made, and its encoder
IMAGE_ARCHITECTURES: dict[str, tuple[type[ImageProcessor], type[ImageEncoder]]] = {
    "Gemma3ForConditionalGeneration": (Gemma3Images, Gemma3Encoder),
    "Mistral3ForConditionalGeneration": (Mistral3Images, Mistral3Encoder),
    "Qwen2VLForConditionalGeneration": (QwenVLImages, QwenVLEncoder),
    "Qwen2_5_VLForConditionalGeneration": (QwenVLImages, QwenVLEncoder),
    "Qwen3VLForConditionalGeneration": (QwenVLImages, QwenVLEncoder),
    "Qwen3VLMoeForConditionalGeneration": (QwenVLImages, QwenVLEncoder),
    "Qwen3_5ForConditionalGeneration": (QwenVLImages, QwenVLEncoder),  # Qwen3-VL's, without deepstack
    "Qwen3_5MoeForConditionalGeneration": (QwenVLImages, QwenVLEncoder),
    "Qwen2AudioForConditionalGeneration": (AudioClips, Qwen2AudioEncoder),  # audio clips, not images
    "WhisperForConditionalGeneration": (WhisperClips, WhisperEncoder),  # an encoder-decoder's clip
}


def image_processor(model_path: Path, hf_config: Any, tokenizer: Any,
                    overrides: dict[str, Any] | None = None) -> ImageProcessor:
    """The model's ImageProcessor; `overrides`: settings of the checkpoint's image processor
    replaced (vLLM's mm_processor_kwargs), ValueError for one it does not take."""
    return IMAGE_ARCHITECTURES[hf_config.architectures[0]][0](model_path, hf_config, tokenizer, overrides)


def load_image_encoder(model_path: Path, hf_config: Any, dtype: torch.dtype, device: torch.device,
                       dummy: bool = False) -> ImageEncoder:
    return IMAGE_ARCHITECTURES[hf_config.architectures[0]][1].load(model_path, hf_config, dtype, device, dummy)


# the embeddings of images encoded lately, kept by their pixels' digest so that a conversation
# sending its image again (every turn does) encodes it once
IMAGE_CACHE_BYTES = 512 << 20


class ImageEmbeddings:
    """The images of the requests that have them, by request id, and the rows of a step's
    flat batch their embeddings fill; and the embeddings of the images encoded lately
    (IMAGE_CACHE_BYTES, least recently used first out).

    An image is encoded when a step first computes one of its tokens, as vLLM's encoder
    runs within the scheduler's token budget: a burst of requests with images does not
    stall the running ones for all of their encodes at once, and an image whose tokens the
    prefix cache holds is not encoded (unless the request, preempted, recomputes them). Until then the request keeps its pixels; after,
    its embeddings, on the host (`host`), from which each step copies the rows it computes
    (chunked prefill and recomputation after preemption read them again). Only the lately
    encoded ones stay on the device, in memory the KV cache sizing sets aside."""

    def __init__(self, max_cache_bytes: int = IMAGE_CACHE_BYTES, host: torch.device | str = "cpu") -> None:
        self.host = torch.device(host)
        self._held: dict[str, _Held] = {}
        self._cache: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._cache_bytes = 0
        self.max_cache_bytes = max_cache_bytes
        self.num_encoded = 0  # images the encoder ran on
        self.num_reused = 0  # images whose embeddings came from the cache

    def _encode(self, images: list[_Image], encode: Encode) -> None:
        """Give each of one prompt's images its embeddings: from the cache where it was
        encoded lately, the others encoded now, in one batch."""
        found = [self._cache.get(image.digest) for image in images]
        for image, embeds in zip(images, found, strict=True):
            if embeds is not None:
                self._cache.move_to_end(image.digest)
        missing = [k for k, embeds in enumerate(found) if embeds is None]
        if missing:
            pixels = [images[k].pixels for k in missing]
            new = encode([p for p in pixels if p is not None], torch.stack([images[k].size for k in missing]))
            for k, embeds in zip(missing, new.split([len(images[k].positions) for k in missing]), strict=True):
                found[k] = embeds
                self._remember(images[k].digest, embeds)
        for image, embeds in zip(images, found, strict=True):
            assert embeds is not None
            image.embeds, image.pixels = embeds.to(self.host), None
        self.num_encoded += len(missing)
        self.num_reused += len(images) - len(missing)

    def encoded(self, digest: int, encode: Callable[[], torch.Tensor]) -> torch.Tensor:
        """One item's encoder output, from the cache where it was encoded lately (by its
        digest), else `encode()`'s, kept: for an encoder whose output no prompt rows take
        (Whisper's clips, whose language is asked first and then transcribed)."""
        found = self._cache.get(digest)
        if found is not None:
            self._cache.move_to_end(digest)
            self.num_reused += 1
            return found
        out = encode()
        self._remember(digest, out)
        self.num_encoded += 1
        return out

    def _remember(self, digest: int, embeds: torch.Tensor) -> None:
        size = embeds.numel() * embeds.element_size()
        if digest in self._cache or size > self.max_cache_bytes:
            return
        self._cache[digest] = embeds
        self._cache_bytes += size
        while self._cache_bytes > self.max_cache_bytes:
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= old.numel() * old.element_size()

    def add(self, request_ids: list[str], inputs: ImageInputs) -> None:
        """A prompt's images, for its requests (the samples of one prompt share them)."""
        images, k = [], 0
        for span, n, pixels, size in zip(inputs.spans, inputs.num_embeds, inputs.pixel_values, inputs.image_sizes,
                                         strict=True):
            images.append(_Image(inputs.positions[k : k + n], span.digest, size, pixels))
            k += n
        held = _Held(images, inputs.positions, inputs.rope_positions, inputs.rope_delta)
        for request_id in request_ids:
            self._held[request_id] = held

    def add_given(self, request_ids: list[str], embeds: torch.Tensor, digest: int) -> None:
        """A prompt given as embeddings: one "image" over all its positions, encoded already."""
        image = _Image(list(range(len(embeds))), digest, torch.zeros(0), None, embeds.to(self.host))
        held = _Held([image], image.positions, None, 0)
        for request_id in request_ids:
            self._held[request_id] = held

    def remove(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    def forget_encoded(self) -> None:
        """Empty the cache of lately encoded images (the encoder's weights changed); a running
        request's images that are encoded already keep their embeddings."""
        self._cache.clear()
        self._cache_bytes = 0

    def __bool__(self) -> bool:
        return bool(self._held)

    def encode(self, request_id: str, start: int, end: int, encode: Encode) -> None:
        """Encode the request's images with tokens in positions [start, end) that are not
        encoded yet (raises what the encoder raised, leaving them so)."""
        held = self._held.get(request_id)
        if held is None:
            return
        pending = [image for image in self._reached(held, start, end) if image.embeds is None]
        if pending:
            self._encode(pending, encode)

    def rows(self, request_id: str, start: int, end: int, row_start: int) -> tuple[list[int], torch.Tensor] | None:
        """The flat-batch rows (the request's positions [start, end) begin at `row_start`)
        that take image embeddings, and those embeddings (on the host); None when there are
        none. Their images must be encoded (`encode`)."""
        held = self._held.get(request_id)
        if held is None or bisect_left(held.positions, start) == bisect_left(held.positions, end):
            return None
        rows: list[int] = []
        embeds = []
        for image in self._reached(held, start, end):
            if image.embeds is None:
                raise ValueError(f"request {request_id!r}: an image in positions [{start}, {end}) is not encoded")
            lo, hi = bisect_left(image.positions, start), bisect_left(image.positions, end)
            rows += [row_start + p - start for p in image.positions[lo:hi]]
            embeds.append(image.embeds[lo:hi])
        return rows, torch.cat(embeds)

    @staticmethod
    def _reached(held: _Held, start: int, end: int) -> list[_Image]:
        """The images with tokens in positions [start, end)."""
        return [image for image in held.images if image.positions[0] < end and image.positions[-1] >= start]

    def rope_positions(self, request_id: str, start: int, end: int) -> list[int] | torch.Tensor | None:
        """The rotary positions of the request's positions [start, end): None where they are
        those positions, a list where the three M-RoPE streams agree (past the prompt, the
        index plus the delta), else [3, end - start]."""
        held = self._held.get(request_id)
        if held is None or held.rope_positions is None:
            return None
        length = held.rope_positions.shape[1]
        if start >= length:
            return list(range(start + held.rope_delta, end + held.rope_delta))
        rows = held.rope_positions[:, start:end]
        if end > length:
            rows = torch.cat((rows, torch.arange(length, end).expand(3, -1) + held.rope_delta), dim=1)
        return rows


class ShiftedEmbeddings(ImageEmbeddings):
    """A target's given rows (images' embeddings, prompt embeddings) as a draft layer that reads
    the target's hidden states reads them (worker.spec_decode.draft_model): its row at position q takes the
    token at q + 1, so the embeddings of position q + 1. An image the target has not reached
    yet (a prefill chunk that ends just before it) leaves its placeholder's embedding in that
    one row. Rotary positions stay plain: the draft layers rotate by position."""

    def __init__(self, source: ImageEmbeddings) -> None:
        super().__init__(0, source.host)
        self.source = source

    def __bool__(self) -> bool:
        return bool(self.source)

    def rows(self, request_id: str, start: int, end: int, row_start: int) -> tuple[list[int], torch.Tensor] | None:
        for stop in (end + 1, end):  # (the last row's token may lie in an image not encoded yet)
            try:
                return self.source.rows(request_id, start + 1, stop, row_start)
            except ValueError:
                continue
        return None

    def rope_positions(self, request_id: str, start: int, end: int) -> list[int] | torch.Tensor | None:
        return None


# the encoder: one prompt's images' pixels and sizes in, their embeddings out, image after image
Encode = Callable[[list[torch.Tensor], torch.Tensor], torch.Tensor]


@dataclass
class _Image:
    """One image of a request: its pixels until it is encoded, its embeddings after."""

    positions: list[int]  # the prompt positions its embeddings fill
    digest: int
    size: torch.Tensor  # its row of image_sizes
    pixels: torch.Tensor | None  # None once encoded
    embeds: torch.Tensor | None = None  # [len(positions), hidden] (or [.., 1 + deepstack, hidden]), on the host


@dataclass(frozen=True)
class _Held:
    """A request's images as its steps read them."""

    images: list[_Image]
    positions: list[int]  # all their embedding positions, in order
    rope_positions: torch.Tensor | None  # ImageInputs'
    rope_delta: int


def images_of(prompt: Any, modality: str = "image") -> list[Any] | PreparedImages:
    """The images (or audio clips, for `modality` "audio") a prompt dict carries
    (`multi_modal_data`: {"image": one, a list, or them prepared already}; {"audio": one clip,
    a list of them, or them prepared}); ValueError for another kind than the model takes."""
    if not isinstance(prompt, dict) or not prompt.get("multi_modal_data"):
        return []
    data = prompt["multi_modal_data"]
    unknown = sorted(set(data) - {modality})
    if unknown:
        raise ValueError(f"multi_modal_data of kind {unknown[0]!r} is not supported by this model; it takes: {modality}")
    items = data.get(modality)
    if isinstance(items, PreparedImages):
        return items
    one_pair = isinstance(items, tuple) and len(items) == 2 and isinstance(items[1], (int, float))
    if modality == "audio" and one_pair:  # vLLM's (samples, sampling rate): one clip
        return [items]
    return list(items) if isinstance(items, (list, tuple)) else [items]


_IMAGE_PARTS = ("image_url", "image_pil", "image")
_AUDIO_PARTS = ("input_audio", "audio_url", "audio")


def chat_media(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any], str]:
    """Chat messages with their image parts (OpenAI's `image_url` with a data URL, vLLM's
    `image_pil`, or `image`) as the chat template's `{"type": "image"}`, or their audio parts
    (OpenAI's `input_audio` with base64 WAV data, vLLM's `audio_url` with a data URL, or
    `audio`) as `{"type": "audio", "audio": None}`; the images or clips in order, for the
    prompt's `multi_modal_data`; and which they are ("image" when there are none). ValueError
    when one conversation holds both."""
    items: list[Any] = []
    kinds = set()
    out = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _IMAGE_PARTS:
                kinds.add("image")
                items.append(_part_image(part, kind, len(items)))
                part = {"type": "image"}
            elif kind in _AUDIO_PARTS:
                kinds.add("audio")
                items.append(_part_audio(part, kind, len(items)))
                part = {"type": "audio", "audio": None}
            parts.append(part)
        out.append({**message, "content": parts})
    if len(kinds) > 1:
        raise ValueError("the messages hold both images and audio; a model takes one or the other")
    return out, items, kinds.pop() if kinds else "image"


def _part_audio(part: dict[str, Any], kind: str, index: int) -> Any:
    value = part.get(kind)
    if kind == "input_audio":  # OpenAI's: {"data": base64, "format": "wav" | "mp3"}
        if not isinstance(value, dict) or not isinstance(value.get("data"), str):
            raise ValueError(f"audio {index}: an input_audio part needs {{'data': base64 audio, 'format': 'wav'}}")
        if value.get("format", "wav") != "wav":
            raise ValueError(f"audio {index}: input_audio format {value.get('format')!r} is not read here: send wav")
        try:
            return base64.b64decode(value["data"], validate=True)
        except binascii.Error:
            raise ValueError(f"audio {index}: its input_audio data is not valid base64") from None
    if kind == "audio_url":
        value = value.get("url") if isinstance(value, dict) else value
        if not is_data_url(value):
            raise ValueError(f"audio {index}: only data URLs (data:audio/wav;base64,...) are read here, "
                             f"got {str(value)[:40]!r}")
    if value is None:
        raise ValueError(f"audio {index}: a {kind!r} part needs its {kind!r} field")
    return value


def _part_image(part: dict[str, Any], kind: str, index: int) -> Any:
    value = image_url_of(part) if kind == "image_url" else part.get(kind)
    if kind == "image_url" and not is_data_url(value):
        raise ValueError(f"image {index}: only data URLs (data:image/png;base64,...) are read here, "
                         f"got {str(value)[:40]!r}")
    if value is None:
        raise ValueError(f"image {index}: a {kind!r} part needs its {kind!r} field")
    return value


def _as_image(image: Any, index: int) -> Any:
    """A PIL image from one, from encoded bytes, or from a data URL (base64)."""
    from PIL import Image, UnidentifiedImageError
    from PIL.Image import DecompressionBombError

    if isinstance(image, Image.Image):
        return image
    image = bytes_if_data_url(image, f"image {index}")
    if isinstance(image, (bytes, bytearray)):
        try:
            picture = Image.open(io.BytesIO(image))
            picture.load()
            return picture
        except DecompressionBombError as e:  # pixels past PIL's limit: refused before they are decoded
            raise ValueError(f"image {index} is too large: {e}") from None
        except (UnidentifiedImageError, OSError) as e:
            raise ValueError(f"image {index} is not an image PIL can read: {e}") from None
    raise ValueError(f"image {index} must be a PIL image, image bytes or a data URL, got {type(image).__name__}")


def _digest(pixels: torch.Tensor, size: torch.Tensor) -> int:
    """One image's pixels (without padding) and their shape, hashed."""
    data = pixels.contiguous().numpy().tobytes() + size.numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _check_overrides(processor: Any, overrides: dict[str, Any]) -> None:
    """transformers drops settings an image processor does not take without a word: refuse
    them (those it takes: its valid_kwargs, a TypedDict, and its bases')."""
    known = {key for cls in processor.valid_kwargs.__mro__ for key in getattr(cls, "__annotations__", {})}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"mm_processor_kwargs: {type(processor).__name__} takes no {unknown[0]!r}; "
                         f"it takes {', '.join(sorted(known))}")


def _read_json(path: Path) -> dict[str, Any]:
    import json

    return json.loads(path.read_text()) if path.exists() else {}
