"""The encoders that turn a prompt's images (or audio clips) into the embeddings that take
the place of their tokens (worker/core/multimodal.py makes the prompt's tokens and the
pixels; this module runs the model's vision or audio tower over them), and `ImageEmbeddings`:
each request's encoded images, encoded once when a step first computes their tokens, kept
in host memory while the request lives and on the device by their pixels' digest, so that a
conversation sending its image again encodes it once.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from worker.core.multimodal import (
    IMAGE_PROCESSORS,
    AudioClips,
    Gemma3Images,
    ImageInputs,
    ImageProcessor,
    Mistral3Images,
    QwenVLImages,
    WhisperClips,
)
from worker.model_executor.model_loader import iter_safetensors

logger = logging.getLogger(__name__)


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


# each family's processor (worker.core.multimodal.IMAGE_PROCESSORS names the architectures)
# -> its encoder
ENCODER_OF: dict[type[ImageProcessor], type[ImageEncoder]] = {
    Gemma3Images: Gemma3Encoder,
    Mistral3Images: Mistral3Encoder,
    QwenVLImages: QwenVLEncoder,  # Qwen3.5's is Qwen3-VL's, without deepstack
    AudioClips: Qwen2AudioEncoder,  # audio clips, not images
    WhisperClips: WhisperEncoder,  # an encoder-decoder's clip
}


def load_image_encoder(model_path: Path, hf_config: Any, dtype: torch.dtype, device: torch.device,
                       dummy: bool = False) -> ImageEncoder:
    return ENCODER_OF[IMAGE_PROCESSORS[hf_config.architectures[0]]].load(model_path, hf_config, dtype, device, dummy)
