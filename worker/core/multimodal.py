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
a step first computes the image's tokens (ImageEmbeddings, worker/model_executor/image_encoders.py): an image costs a fraction of
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from producer.data_urls import bytes_if_data_url, image_url_of, is_data_url
from worker.model_executor.models.config import architecture_of

logger = logging.getLogger(__name__)


def takes_images(model_path: Path, hf_config: Any) -> bool:
    """An image-text checkpoint genq encodes images for, with its image processor's config
    (without one it serves text alone, as other image-text models do)."""
    arch = architecture_of(hf_config)
    if arch not in IMAGE_PROCESSORS:
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


# an image-text architecture genq encodes images for -> how its prompts and pixels are made (its
# encoder: worker.model_executor.image_encoders.ENCODER_OF, by the processor)
IMAGE_PROCESSORS: dict[str, type[ImageProcessor]] = {
    "Gemma3ForConditionalGeneration": Gemma3Images,
    "Mistral3ForConditionalGeneration": Mistral3Images,
    "Qwen2VLForConditionalGeneration": QwenVLImages,
    "Qwen2_5_VLForConditionalGeneration": QwenVLImages,
    "Qwen3VLForConditionalGeneration": QwenVLImages,
    "Qwen3VLMoeForConditionalGeneration": QwenVLImages,
    "Qwen3_5ForConditionalGeneration": QwenVLImages,  # Qwen3-VL's, without deepstack
    "Qwen3_5MoeForConditionalGeneration": QwenVLImages,
    "Qwen2AudioForConditionalGeneration": AudioClips,  # audio clips, not images
    "WhisperForConditionalGeneration": WhisperClips,  # an encoder-decoder's clip
}


def image_processor(model_path: Path, hf_config: Any, tokenizer: Any,
                    overrides: dict[str, Any] | None = None) -> ImageProcessor:
    """The model's ImageProcessor; `overrides`: settings of the checkpoint's image processor
    replaced (vLLM's mm_processor_kwargs), ValueError for one it does not take."""
    return IMAGE_PROCESSORS[hf_config.architectures[0]](model_path, hf_config, tokenizer, overrides)


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
