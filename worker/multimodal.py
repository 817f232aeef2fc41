"""Images in prompts (vLLM's `multi_modal_data`): an image-text model's vision encoder turns
each image into embeddings that take the place of its placeholder tokens in the prompt.

Supported: Mistral 3 (Mistral Small 3.1 and 3.2: Pixtral's vision encoder and Mistral 3's
projector). A prompt names each image where it goes with the model's image token (`[IMG]`),
one per image in order; genq widens each into the image's rows of `[IMG]` tokens, each row
ended by `[IMG_BREAK]` and the last by `[IMG_END]`, as the model's processor does. Chat
messages carry images as content parts (api and LLM.chat), which the chat template turns
into that token.

Images are resized and normalized by the checkpoint's own image processor (transformers', on
PIL), and encoded once, when the request is added, by transformers' vision modules over the
checkpoint's weights: an image costs a fraction of the language model's time, which genq's
own runner spends. The embeddings stay with the request until it ends (chunked prefill and
recomputation after preemption read them again), and the embeddings of the images encoded
lately are kept by their pixels' digest, so a conversation that sends its image again with
every turn has it encoded once. Each image's pixels are hashed into the
prefix-cache keys of the blocks its tokens fill, so equal text around another image shares
nothing it should not.
"""

from __future__ import annotations

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

from producer.data_urls import decode_data_url, image_url_of, is_data_url
from worker.model_loader import iter_safetensors

logger = logging.getLogger(__name__)

# an image-text architecture genq encodes images for -> its vision weights' prefixes
IMAGE_ARCHITECTURES = {"Mistral3ForConditionalGeneration": ("vision_tower.", "multi_modal_projector.")}


def takes_images(model_path: Path, hf_config: Any) -> bool:
    """An image-text checkpoint genq encodes images for, with its image processor's config
    (without one it serves text alone, as other image-text models do)."""
    arch = (getattr(hf_config, "architectures", None) or [""])[0]
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

    pixel_values: torch.Tensor  # [num_images, 3, height, width], padded to the largest
    image_sizes: torch.Tensor  # [num_images, 2]: each image's (height, width) as resized
    digests: list[int]  # of each image's pixels


@dataclass
class ImageInputs:
    """A prompt's images, processed: pixels for the encoder and where their tokens go."""

    pixel_values: torch.Tensor  # [num_images, 3, height, width], padded to the largest
    image_sizes: torch.Tensor  # [num_images, 2]: each image's (height, width) as resized
    spans: list[ImageSpan]
    positions: list[int]  # the prompt positions the images' embeddings fill ([IMG]), in order
    num_embeds: list[int]  # of those, each image's

    def span_keys(self) -> list[tuple[int, int, int]]:
        """(offset, length, digest) per image: plain data for the block manager's hashes."""
        return [(s.offset, s.length, s.digest) for s in self.spans]


class ImageProcessor:
    """Turns a prompt's placeholders and images into its token ids and ImageInputs (CPU)."""

    def __init__(self, model_path: Path, hf_config: Any, tokenizer: Any):
        from transformers import AutoImageProcessor

        self.images = AutoImageProcessor.from_pretrained(model_path, backend="pil")
        processor = _read_json(model_path / "processor_config.json")
        self.image_token_id = int(hf_config.image_token_index)
        self.break_token_id = tokenizer.convert_tokens_to_ids(processor.get("image_break_token", "[IMG_BREAK]"))
        self.end_token_id = tokenizer.convert_tokens_to_ids(processor.get("image_end_token", "[IMG_END]"))
        self.patch = int(hf_config.vision_config.patch_size) * int(getattr(hf_config, "spatial_merge_size", 1))

    def prepare(self, images: list[Any]) -> PreparedImages:
        """Images read, resized and normalized, and their pixels hashed: the costly part, which
        holds no state, so a thread other than the engine's may do it (worker.queue_engine)."""
        pictures = [_as_image(image, i) for i, image in enumerate(images)]
        batch = self.images(images=pictures, patch_size=self.patch, return_tensors="pt")
        pixels, sizes = batch["pixel_values"], batch["image_sizes"]
        return PreparedImages(pixels, sizes, [_digest(pixels[k], sizes[k]) for k in range(len(pictures))])

    def process(self, prompt_ids: list[int], images: list[Any] | PreparedImages) -> tuple[list[int], ImageInputs]:
        """The prompt with each image token widened to its image's rows; ValueError when the
        placeholders and images do not pair up."""
        found = prompt_ids.count(self.image_token_id)
        count = len(images.digests) if isinstance(images, PreparedImages) else len(images)
        if found != count:
            raise ValueError(f"the prompt has {found} image placeholder(s) (token id {self.image_token_id}) "
                             f"but {count} image(s) were given: put one placeholder where each image goes")
        prepared = images if isinstance(images, PreparedImages) else self.prepare(images)
        sizes = prepared.image_sizes
        ids: list[int] = []
        spans: list[ImageSpan] = []
        positions: list[int] = []
        num_embeds: list[int] = []
        k = 0
        for token in prompt_ids:
            if token != self.image_token_id:
                ids.append(token)
                continue
            rows, cols = (int(n) // self.patch for n in sizes[k])
            tokens = ([self.image_token_id] * cols + [self.break_token_id]) * rows
            tokens[-1] = self.end_token_id
            positions += [len(ids) + i for i, t in enumerate(tokens) if t == self.image_token_id]
            num_embeds.append(rows * cols)
            spans.append(ImageSpan(len(ids), len(tokens), prepared.digests[k]))
            ids += tokens
            k += 1
        return ids, ImageInputs(prepared.pixel_values, sizes, spans, positions, num_embeds)


class ImageEncoder(nn.Module):
    """Mistral 3's vision tower and projector (transformers' modules) over the checkpoint's
    weights: images in, one embedding per [IMG] token out."""

    def __init__(self, hf_config: Any):
        super().__init__()
        from transformers import AutoModel
        from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector

        self.config = hf_config
        self.vision_tower = AutoModel.from_config(hf_config.vision_config)
        self.multi_modal_projector = Mistral3MultiModalProjector(hf_config)

    @classmethod
    def load(cls, model_path: Path, hf_config: Any, dtype: torch.dtype, device: torch.device,
             dummy: bool = False) -> ImageEncoder:
        """The checkpoint's encoder; `dummy`: seeded random weights (transformers' own init,
        drawn on the CPU, so every device starts from the same values), no checkpoint read."""
        if dummy:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                return cls(hf_config).to(device=device, dtype=dtype).eval()
        encoder = cls(hf_config)
        prefixes = IMAGE_ARCHITECTURES[hf_config.architectures[0]]
        vision = iter_safetensors(model_path, keep=lambda name: name.removeprefix("model.").startswith(prefixes))
        encoder.load_state_dict({name.removeprefix("model."): tensor for name, tensor in vision}, strict=True)
        return encoder.to(device=device, dtype=dtype).eval()

    @torch.inference_mode()
    def forward(
        self, pixel_values: torch.Tensor, image_sizes: torch.Tensor  # [n, 3, H, W], [n, 2]
    ) -> torch.Tensor:  # [the images' image tokens, hidden], image after image
        device, dtype = self.multi_modal_projector.linear_1.weight.device, self.multi_modal_projector.linear_1.weight.dtype
        sizes = image_sizes.to(device)
        out = self.vision_tower(pixel_values.to(device=device, dtype=dtype), image_sizes=sizes,
                                output_hidden_states=True, return_dict=True)
        layer = self.config.vision_feature_layer
        layers = [layer] if isinstance(layer, int) else list(layer)
        features = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
        return self.multi_modal_projector(features.squeeze(0), sizes)


# the embeddings of images encoded lately, kept by their pixels' digest so that a conversation
# sending its image again (every turn does) encodes it once
IMAGE_CACHE_BYTES = 512 << 20


class ImageEmbeddings:
    """The embeddings of the requests with images, by request id, and the rows of a step's
    flat batch they fill; and the embeddings of the images encoded lately (IMAGE_CACHE_BYTES,
    least recently used first out)."""

    def __init__(self, max_cache_bytes: int = IMAGE_CACHE_BYTES) -> None:
        self._held: dict[str, tuple[list[int], torch.Tensor]] = {}
        self._cache: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._cache_bytes = 0
        self.max_cache_bytes = max_cache_bytes
        self.num_encoded = 0  # images the encoder ran on
        self.num_reused = 0  # images whose embeddings came from the cache

    def embeddings(self, inputs: ImageInputs, encode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                   ) -> torch.Tensor:  # [len(inputs.positions), hidden]
        """A prompt's image embeddings: each image's from the cache where it was encoded
        lately, the others encoded now, in one batch."""
        found = [self._cache.get(span.digest) for span in inputs.spans]
        missing = [k for k, embeds in enumerate(found) if embeds is None]
        for k, span in enumerate(inputs.spans):
            if found[k] is not None:
                self._cache.move_to_end(span.digest)
        if missing:
            index = torch.tensor(missing)
            new = encode(inputs.pixel_values[index], inputs.image_sizes[index])
            for k, embeds in zip(missing, new.split([inputs.num_embeds[k] for k in missing]), strict=True):
                found[k] = embeds
                self._remember(inputs.spans[k].digest, embeds)
        self.num_encoded += len(missing)
        self.num_reused += len(found) - len(missing)
        return torch.cat([embeds for embeds in found if embeds is not None])

    def _remember(self, digest: int, embeds: torch.Tensor) -> None:
        size = embeds.numel() * embeds.element_size()
        if digest in self._cache or size > self.max_cache_bytes:
            return
        self._cache[digest] = embeds
        self._cache_bytes += size
        while self._cache_bytes > self.max_cache_bytes:
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= old.numel() * old.element_size()

    def add(self, request_ids: list[str], positions: list[int], embeds: torch.Tensor) -> None:
        for request_id in request_ids:
            self._held[request_id] = (positions, embeds)

    def remove(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    def __bool__(self) -> bool:
        return bool(self._held)

    def rows(self, request_id: str, start: int, end: int, row_start: int) -> tuple[list[int], torch.Tensor] | None:
        """The flat-batch rows (the request's positions [start, end) begin at `row_start`)
        that take image embeddings, and those embeddings; None when there are none."""
        held = self._held.get(request_id)
        if held is None:
            return None
        positions, embeds = held
        lo, hi = bisect_left(positions, start), bisect_left(positions, end)
        if lo == hi:
            return None
        return [row_start + p - start for p in positions[lo:hi]], embeds[lo:hi]


def images_of(prompt: Any) -> list[Any] | PreparedImages:
    """The images a prompt dict carries (`multi_modal_data`: {"image": one, a list, or them
    prepared already})."""
    if not isinstance(prompt, dict) or not prompt.get("multi_modal_data"):
        return []
    data = prompt["multi_modal_data"]
    unknown = sorted(set(data) - {"image"})
    if unknown:
        raise ValueError(f"multi_modal_data of kind {unknown[0]!r} is not supported; supported: image")
    images = data.get("image")
    if isinstance(images, PreparedImages):
        return images
    return list(images) if isinstance(images, (list, tuple)) else [images]


def chat_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """Chat messages with their image parts (OpenAI's `image_url` with a data URL, vLLM's
    `image_pil`, or `image`) as the chat template's `{"type": "image"}`, and the images in
    order, for the prompt's `multi_modal_data`."""
    images: list[Any] = []
    out = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image_url", "image_pil", "image"):
                images.append(_part_image(part, kind, len(images)))
                part = {"type": "image"}
            parts.append(part)
        out.append({**message, "content": parts})
    return out, images


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
    if is_data_url(image):
        try:
            image = decode_data_url(image)
        except ValueError as e:
            raise ValueError(f"image {index}: {e}") from None
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
    height, width = (int(n) for n in size)
    data = pixels[:, :height, :width].contiguous().numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _read_json(path: Path) -> dict[str, Any]:
    import json

    return json.loads(path.read_text()) if path.exists() else {}
