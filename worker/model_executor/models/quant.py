"""Quantized weights: checkpoints whose linear layers are stored as narrow values times
scales, and fp8 quantization of a float checkpoint as it loads (vLLM's `quantization="fp8"`).

Stored: NVIDIA ModelOpt's FP8 (`quant_method: modelopt`, a `weight_scale` per tensor, read
as compressed-tensors' per-tensor fp8), `quant_method: fp8` in config.json (Qwen3-*-FP8, DeepSeek-V3's layout: fp8 e4m3
values, a scale per block of `weight_block_size` or per tensor, `*.weight_scale_inv` — the
name, not the arithmetic: they multiply), and `compressed-tensors` (llm-compressor's): fp8,
int8 or int4 values with `*.weight_scale` per tensor, output channel, block (fp8) or group
of columns (int), int values possibly packed in int32 words (`*.weight_packed`), asymmetric
ones with `*.weight_zero_point` per channel or group (packed along the outputs). Quantized
at load: fp8, a scale per output channel. gpt-oss's MXFP4 experts (`quant_method: mxfp4`,
read by worker/model_executor/models/gpt_oss.py): 4-bit e2m1 values two to a byte, low nibble first, a
power-of-two scale per 32 columns. GPTQ (`quant_method: gptq`, AutoGPTQ's and GPTQModel's
checkpoints: `qweight` 4- or 8-bit values packed along the input columns, `scales` and
`qzeros` per group of columns, packed along the outputs) and AWQ (`quant_method: awq`,
AutoAWQ's GEMM layout: 4-bit values packed along the outputs in AWQ's interleaved order):
each group's weights are (q - zero) * scale. genq repacks them as it loads into its own
layout (compressed-tensors' packing, a value less 2^(bits-1), zero points held so too, as
an int8 grid shaped as the scales); a symmetric GPTQ checkpoint, whose zero points are all
2^(bits-1), needs none. GPTQ's act-order (`desc_act`) quantizes a layer's columns in order
of importance, each one's group in `g_idx`: genq sorts the columns by group as they load and
gathers the activations in that order (`QuantLinear.input_perm`).

On the kernel path (CUDA) the decoder layers' projections keep their narrow values in
memory, `QuantLinear`s over the Triton kernel `kernels.quant_linear` (int4 stays packed),
and so do experts, on the fused MoE kernel; both widen each weight tile to the activation
dtype (activations are not quantized). On the torch path every weight is dequantized once,
at load, to the model's dtype, each block's values times its scale in float32 then rounded,
as transformers dequantizes them. The embeddings, the
LM head, the routers and any layer the checkpoint leaves float (`modules_to_not_convert`,
`ignore`) stay float.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker.config import QUANTIZATION_METHODS

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# how each kind of weight is held: fp8 and int8 values, int4 values packed eight to an int32,
# fp4 (e2m1) codes two to a byte
STORAGE = {"fp8": FP8, "int8": torch.int8, "int4": torch.int32, "fp4": torch.uint8}
# the sixteen e2m1 codes: sign, two exponent bits, one mantissa bit
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# static activation scales: genq's activations keep the model dtype, so they are not read;
# a packed weight's shape: the model knows it
_IGNORED = (".activation_scale", ".input_scale", ".weight_shape")


@dataclass(frozen=True)
class QuantConfig:
    block: tuple[int, int] | None  # weight rows, columns per scale; None: per tensor as stored, per channel online
    kind: str = "fp8"  # the values: fp8 (e4m3), int8, or int4 (packed eight to an int32)
    skip: tuple[str, ...] = ()  # checkpoint module names kept in float (modules_to_not_convert, ignore)
    online: bool = False  # the checkpoint is float; its weights are quantized as they load
    experts_only: bool = False  # only the experts are quantized (gpt-oss's MXFP4)
    zero_points: bool = False  # integers come with a zero point per scale (asymmetric GPTQ, AWQ)
    packing: str | None = None  # how the checkpoint packs its integers: gptq (v1 zero points), gptq_v2, awq
    act_order: bool = False  # GPTQ's desc_act: columns grouped by g_idx, not in order (sorted so at load)

    @classmethod
    def from_hf(cls, hf_config: Any, quantization: str | None) -> QuantConfig | None:
        """The checkpoint's own quantization (config.json's `quantization_config`), else the
        engine's `quantization` argument; ValueError for a scheme genq cannot serve.
        `quantization` "fp8" quantizes a float checkpoint as it loads; a checkpoint's own
        method (vLLM's names, its Marlin aliases too) only confirms what the checkpoint says."""
        method_named = QUANTIZATION_METHODS.get(quantization or "", quantization)
        if method_named not in (None, *QUANTIZATION_METHODS.values()):
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or None, "
                             f"got {quantization!r}")
        qc = getattr(hf_config, "quantization_config", None)
        if qc is None:
            if method_named not in (None, "fp8"):
                raise ValueError(f"quantization={quantization!r} names the checkpoint's quantization, but the "
                                 "checkpoint has no quantization_config (a float checkpoint: fp8 or None)")
            return cls(block=None, online=True) if quantization == "fp8" else None
        qc = qc if isinstance(qc, dict) else qc.to_dict()
        method = qc.get("quant_method")
        if method_named not in (None, method) and not (method_named == "fp8" and method == "mxfp4"):
            raise ValueError(f"quantization={quantization!r} does not match the checkpoint's quant_method {method!r}")
        if method == "fp8":
            return cls._from_fp8(qc)
        if method == "compressed-tensors":
            return cls._from_compressed_tensors(qc)
        if method == "gptq":
            return cls._from_gptq(qc)
        if method == "awq":
            return cls._from_awq(qc)
        if method == "modelopt":
            return cls._from_modelopt(qc)
        if method == "mxfp4" and (getattr(hf_config, "architectures", None) or [""])[0] == "GptOssForCausalLM":
            # gpt-oss's experts, kept so on the kernel path; with quantization="fp8" they are
            # widened as they load, then quantized to fp8 with the rest
            return cls(block=None, online=True) if quantization == "fp8" else cls(block=(1, 32), kind="fp4",
                                                                                    experts_only=True)
        raise ValueError(f"the checkpoint is quantized with {method!r}, which genq does not serve; supported: "
                         "quant_method 'fp8', 'compressed-tensors' with fp8, int8 or int4 weights, 'modelopt' FP8, "
                         "'mxfp4' (gpt-oss), 'gptq' (4 or 8 bits), 'awq' (4 bits, GEMM), "
                         "or quantization='fp8' over a float checkpoint")

    @classmethod
    def _from_fp8(cls, qc: dict) -> QuantConfig:
        """transformers' FP8 format (Qwen3-*-FP8, DeepSeek-V3)."""
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fp8 format {qc['fmt']!r} is not supported; supported: e4m3")
        if qc.get("scale_fmt") not in (None, "float32"):
            raise ValueError(f"fp8 scale format {qc['scale_fmt']!r} is not supported; supported: float32 scales")
        return cls(block=_block(qc.get("weight_block_size"), "weight_block_size"),
                   skip=tuple(qc.get("modules_to_not_convert") or ()))

    @classmethod
    def _from_modelopt(cls, qc: dict) -> QuantConfig:
        """NVIDIA ModelOpt's FP8 checkpoints (nvidia/*-FP8): fp8 e4m3 weights with a float32
        `weight_scale` per tensor (their `input_scale`s are not read: activations keep the
        model dtype). `exclude_modules` stay float: names, or fnmatch patterns (`*`), in the
        checkpoint's names (Nemotron-H's `backbone.`, `mixer` read as genq's)."""
        algo = qc.get("quant_algo")
        if algo != "FP8":
            raise ValueError(f"ModelOpt quant_algo {algo!r} is not supported; supported: FP8 (a scale per tensor)")
        return cls(block=None, skip=tuple(_modelopt_pattern(name) for name in qc.get("exclude_modules") or ()))

    @classmethod
    def _from_compressed_tensors(cls, qc: dict) -> QuantConfig | None:
        """compressed-tensors' (llm-compressor's checkpoints: *-FP8-dynamic, *-FP8, W8A8 and
        W8A16 int8, W4A16 int4): one scheme over the Linear layers whose weights are symmetric
        8-bit floats (a scale per tensor, output channel or block), or 8- or 4-bit integers (a
        scale per tensor, output channel or group of columns). Activation settings are not
        read: activations keep the model dtype. Its `kv_cache_scheme` is read apart
        (worker.model_executor.models.kv_scales); with no scheme besides it the weights are float (None)."""
        groups = list((qc.get("config_groups") or {}).values())
        if not groups and qc.get("kv_cache_scheme"):
            return None
        if len(groups) != 1 or "Linear" not in groups[0].get("targets", ()):
            raise ValueError(f"compressed-tensors checkpoints with {len(groups)} schemes, or one not over "
                             "the Linear layers, are not supported; supported: one scheme targeting Linear")
        weights = groups[0].get("weights") or {}
        symmetric = weights.get("symmetric", True)
        scheme = (weights.get("type"), weights.get("num_bits"), symmetric)
        kinds = {("float", 8, True): "fp8", ("int", 8, True): "int8", ("int", 4, True): "int4",
                 ("int", 8, False): "int8", ("int", 4, False): "int4"}
        if scheme not in kinds:
            raise ValueError(f"compressed-tensors weights of type {scheme[0]!r}, {scheme[1]} bits"
                             f"{'' if scheme[2] else ', asymmetric'} are not supported; "
                             "supported: symmetric 8-bit float, 8-bit or 4-bit int, symmetric or not")
        kind = kinds[scheme]
        strategy = weights.get("strategy")
        strategies: tuple[str, ...] = ("tensor", "channel", "block") if kind == "fp8" else ("tensor", "channel", "group")
        if not symmetric:  # zero points are kept per group or channel
            strategies = ("channel", "group")
        if strategy not in strategies:
            raise ValueError(f"compressed-tensors weight strategy {strategy!r} is not supported for "
                             f"{'' if symmetric else 'asymmetric '}{kind} weights; "
                             f"supported: {', '.join(strategies)}")
        if weights.get("actorder") == "group":
            raise ValueError("compressed-tensors weights with actorder 'group' (a g_idx permutation) are not supported")
        block = None
        if strategy == "block":
            block = _block(weights.get("block_structure"), "block_structure")
        elif strategy == "group":
            block = _block([1, weights.get("group_size") or 0], "group_size")
        return cls(block=block, kind=kind, skip=tuple(qc.get("ignore") or ()), zero_points=not symmetric)

    @classmethod
    def _from_gptq(cls, qc: dict) -> QuantConfig:
        """AutoGPTQ's and GPTQModel's checkpoints: 4- or 8-bit integers, a scale and zero
        point per group of `group_size` columns (-1: per output channel), symmetric or not."""
        bits = qc.get("bits")
        if bits not in (4, 8):
            raise ValueError(f"GPTQ checkpoints of {bits} bits are not supported; supported: 4 or 8 bits")
        packing = qc.get("checkpoint_format") or "gptq"
        if packing not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {packing!r} is not supported; supported: gptq, gptq_v2")
        if qc.get("lm_head"):
            raise ValueError("GPTQ checkpoints with a quantized lm_head are not supported")
        if qc.get("dynamic"):
            raise ValueError("GPTQ checkpoints with per-module overrides (dynamic) are not supported")
        return cls(block=_group_block(qc.get("group_size", 128)), kind=f"int{bits}",
                   skip=tuple(qc.get("modules_to_not_convert") or ()), zero_points=not qc.get("sym", True),
                   packing=packing, act_order=bool(qc.get("desc_act")) and not qc.get("static_groups"))

    @classmethod
    def _from_awq(cls, qc: dict) -> QuantConfig:
        """AutoAWQ's GEMM checkpoints: 4-bit integers with a scale and zero point per group."""
        bits = qc.get("bits", qc.get("w_bit"))
        version = str(qc.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm" or not qc.get("zero_point", True):
            raise ValueError(f"AWQ checkpoints of {bits} bits, version {version!r}"
                             f"{'' if qc.get('zero_point', True) else ', without zero points'} are not supported; "
                             "supported: 4 bits, version gemm, with zero points")
        return cls(block=_group_block(qc.get("group_size", qc.get("q_group_size", 128))), kind="int4",
                   skip=tuple(qc.get("modules_to_not_convert") or ()), zero_points=True, packing="awq")

    def layout(self, out_features: int, in_features: int) -> tuple[int, int]:
        """The scale block of a layer kept in fp8: the checkpoint's, else one scale per
        output channel (a per-tensor scale fills that grid with one value)."""
        return self.block or (1, in_features)

    def skips(self, names: Iterable[str]) -> bool:
        """Whether a skip entry names one of these modules or a module holding it, or is a
        `re:` pattern that matches one (compressed-tensors' `ignore`)."""
        names = list(names)
        return any(re.match(pattern[3:], name) if pattern.startswith("re:") else f".{pattern}." in f".{name}."
                   for pattern in self.skip for name in names)


def _modelopt_pattern(name: str) -> str:
    """An exclude_modules entry as a skip entry: a name as it is, a pattern as `re:`; Nemotron-H's
    `backbone.` and `mixer` stand for genq's `model.` and its attention or MLP."""
    if "*" not in name and "mixer" not in name and not name.startswith("backbone."):
        return name
    pattern = fnmatch.translate(name.replace("backbone.", "model.", 1))
    return "re:" + pattern.replace("mixer", "(?:mixer|self_attn|mlp)").replace(r"\Z", r"(?:\..*)?\Z")


def _group_block(group_size: int) -> tuple[int, int] | None:
    """GPTQ's and AWQ's `group_size` as a scale block: a row by that many columns; -1 (a
    scale per output channel) as None."""
    if group_size == -1:
        return None
    return _block([1, group_size], "group_size")


def _block(value: Any, field: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if len(value) != 2 or min(value) < 1:
        raise ValueError(f"{field} must be two positive sizes, got {value!r}")
    return int(value[0]), int(value[1])


class QuantLinear(nn.Module):
    """A linear layer over a quantized weight and its float32 scale grid, on the Triton
    kernel: fp8 or int8 values [out, in], or int4 values packed [out, cdiv(in, 8)]; with
    `zero_points`, an int8 zero point per scale (`weight_zero`). With `act_order` (GPTQ's
    desc_act) the weight's columns are held sorted by group, `input_perm` their order: the
    activations are gathered so before the product."""

    weight_scale: torch.Tensor  # set by make_quantized
    weight_zero: torch.Tensor | None
    input_perm: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: nn.Parameter | None, block: tuple[int, int],
                 kind: str = "fp8", zero_points: bool = False, act_order: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.block = block
        self.kind = kind
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device="meta"), requires_grad=False)
        self.weight_zero = None
        make_quantized(self, "weight", block, kind, zero_points)
        self.input_perm = nn.Parameter(torch.empty(in_features, dtype=torch.int64), requires_grad=False) \
            if act_order else None
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        import kernels

        if self.input_perm is not None:
            x = x.index_select(1, self.input_perm)
        return kernels.quant_linear(x, self.weight, self.weight_scale, self.block, self.bias, self.weight_zero)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}, block={self.block}"


def quantize(dense: torch.Tensor, block: tuple[int, int], kind: str = "fp8") -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [..., out, in] as `kind` values and a float32 scale per `block`
    [..., rows, cols]: each block's largest magnitude maps to e4m3's 448, or to the largest
    integer (127, 7; symmetric, rounded to nearest). int4 values come packed (`pack_int4`)."""
    *lead, n, k = dense.shape
    rows, cols = -(-n // block[0]), -(-k // block[1])
    padded = dense.new_zeros(*lead, rows * block[0], cols * block[1], dtype=torch.float32)
    padded[..., :n, :k] = dense
    tiles = padded.view(*lead, rows, block[0], cols, block[1])
    amax = tiles.abs().amax(dim=(-3, -1))
    top = {"fp8": FP8_MAX, "int8": 127.0, "int4": 7.0, "fp4": 6.0}[kind]
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))  # [..., rows, cols]
    if kind == "fp4":  # MXFP4's scales are powers of two, held as their e8m0 exponents
        exponent = torch.ceil(torch.log2(scale))
        q = (tiles / torch.exp2(exponent)[..., :, None, :, None]).view_as(padded)[..., :n, :k]
        return pack_fp4(q), (exponent + 127).to(torch.uint8)
    q = (tiles / scale[..., :, None, :, None]).view_as(padded)[..., :n, :k]
    if kind == "fp8":
        return q.clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    q = q.round().clamp(-top - 1, top).to(torch.int8)
    return (pack_int4(q) if kind == "int4" else q), scale


def packed_columns(in_features: int, kind: str) -> int:
    """How many stored columns hold a row of `in_features` values of `kind`."""
    return -(-in_features // 8) if kind == "int4" else -(-in_features // 2) if kind == "fp4" else in_features


def unpack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes two to a byte [..., C] uint8, low nibble first -> float32 values [..., 2 * C]."""
    lut = torch.tensor(E2M1, dtype=torch.float32, device=codes.device)
    return lut[torch.stack((codes & 0x0F, codes >> 4), dim=-1).flatten(-2).long()]


def e8m0_scales(exponents: torch.Tensor) -> torch.Tensor:
    """MXFP4's scales: uint8 exponents (bias 127) as float32 powers of two."""
    return torch.exp2(exponents.float() - 127)


def pack_fp4(values: torch.Tensor) -> torch.Tensor:
    """Values [..., K] within +-6 rounded to the nearest e2m1 code (ties to the lower code),
    two to a byte, low nibble first: [..., cdiv(K, 2)] uint8."""
    grid = torch.tensor(E2M1[:8], device=values.device)
    codes = (values.abs()[..., None] - grid).abs().argmin(-1) + 8 * (values < 0)  # [..., K]
    if codes.shape[-1] % 2:
        codes = torch.cat((codes, codes.new_zeros(*codes.shape[:-1], 1)), dim=-1)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int4 values [..., K] (in int8) packed as compressed-tensors packs them: value k in bits
    4 * (k % 8) of int32 k // 8, plus 8. [..., cdiv(K, 8)] int32."""
    *lead, k = values.shape
    nibbles = values.new_zeros((*lead, -(-k // 8) * 8), dtype=torch.int64)  # past k: zero bits
    nibbles[..., :k] = values + 8
    words = (nibbles.view(*lead, -1, 8) << torch.arange(0, 32, 4, device=values.device)).sum(-1)
    return (words - (words >= 2**31) * 2**32).to(torch.int32)  # the same 32 bits, as int32


def unpack(words: torch.Tensor, bits: int, k: int | None = None) -> torch.Tensor:
    """`bits`-bit values (4 or 8) packed in int32 words [..., W] as compressed-tensors packs
    them (value i in bits `bits * i` of the row's bit string, plus 2^(bits-1)): int8 [..., k]."""
    per_word = 32 // bits
    fields = (words[..., None] >> torch.arange(0, 32, bits, device=words.device)) & ((1 << bits) - 1)
    values = fields.flatten(-2)[..., : k or words.shape[-1] * per_word] - (1 << (bits - 1))
    return values.to(torch.int8)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               in_features: int | None = None, zero: torch.Tensor | None = None) -> torch.Tensor:
    """A quantized weight [..., out, in] (fp8 or int8; packed int4 [..., out, cdiv(in, 8)]),
    less its zero points if any, times its scales, in float32: one scale, or a grid [...,
    rows, cols] over blocks of `block` (None: blocks that divide the weight exactly), the
    zero points a grid as the scales."""
    if weight.dtype == torch.uint8:
        values = unpack_fp4(weight)[..., :in_features]
    else:
        values = (unpack(weight, 4, in_features) if weight.dtype == torch.int32 else weight).float()
    scale = e8m0_scales(scale) if scale.dtype == torch.uint8 else scale.float()
    if scale.numel() == 1:
        return values * scale.reshape(())
    (n, k), (rows, cols) = values.shape[-2:], scale.shape[-2:]
    block_rows, block_cols = block or (n // rows, k // cols)
    if -(-n // block_rows) != rows or -(-k // block_cols) != cols:
        raise ValueError(f"a scale grid of {rows} x {cols} does not cover a weight of {n} x {k} "
                         f"in blocks of {block_rows} x {block_cols}")

    def spread(grid: torch.Tensor) -> torch.Tensor:
        return grid.repeat_interleave(block_rows, dim=-2)[..., :n, :].repeat_interleave(block_cols, dim=-1)[..., :k]

    if zero is not None:
        values = values - spread(zero.float())
    return values * spread(scale)


def make_quantized(module: nn.Module, name: str, block: tuple[int, int], kind: str = "fp8",
                   zero_points: bool = False) -> None:
    """Turn `module`'s float parameter `name` [..., out, in] into a quantized one of `kind`
    (int4: [..., out, cdiv(in, 8)] words) and its scales `<name>_scale` [..., rows, cols]
    (float32; fp4's are e8m0 exponents, a uint8 each), with `zero_points` int8 zero points
    `<name>_zero` of the same grid, on the meta device before the weights load."""
    *lead, n, k = getattr(module, name).shape
    grid = (*lead, -(-n // block[0]), -(-k // block[1]))
    columns = packed_columns(k, kind)
    setattr(module, name, nn.Parameter(torch.empty(*lead, n, columns, dtype=STORAGE[kind]), requires_grad=False))
    scale_dtype = torch.uint8 if kind == "fp4" else torch.float32
    setattr(module, name + "_scale", nn.Parameter(torch.empty(grid, dtype=scale_dtype), requires_grad=False))
    if zero_points:
        setattr(module, name + "_zero", nn.Parameter(torch.empty(grid, dtype=torch.int8), requires_grad=False))


def quantize_into(module: nn.Module, name: str, dense: torch.Tensor) -> None:
    """Quantize a float weight into `module`'s quantized parameter `name` and its scales, in
    blocks of `module.block`, values of `module.kind` (a `QuantLinear`, or `Experts`);
    symmetric, so any zero points are zero."""
    q, scale = quantize(dense, getattr(module, "block"), getattr(module, "kind"))  # noqa: B009
    with torch.no_grad():
        getattr(module, name).copy_(q)
        getattr(module, name + "_scale").copy_(scale)
        if (zero := getattr(module, name + "_zero", None)) is not None:
            zero.zero_()


def dense_shape(module: nn.Module, name: str) -> tuple[int, ...]:
    """The float shape of `module`'s quantized parameter `name` (a packed one is narrower)."""
    if isinstance(module, QuantLinear):
        return module.out_features, module.in_features
    *lead, n, _ = getattr(module, name).shape
    return (*lead, n, in_features(module, name))


def in_features(module: nn.Module, name: str) -> int:
    """The float width of a quantized weight's rows: a `QuantLinear`'s, or an expert's (w13
    reads the hidden state, w2 the intermediate one)."""
    if isinstance(module, QuantLinear):
        return module.in_features
    return getattr(module, "hidden_size") if name == "w13" else getattr(module, "intermediate_size")  # noqa: B009


def is_quantized(module: nn.Module, name: str) -> bool:
    value = getattr(module, name, None)
    return isinstance(value, torch.Tensor) and value.dtype in STORAGE.values()


def quantized_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
    cfg: QuantConfig,
    kept: Callable[[str], Any],  # the module (with its `block`) whose quantized weight a checkpoint weight is, or None
) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors as the model takes them. A weight the model keeps quantized
    passes with its scale (renamed `<weight>_scale`) and zero points (`<weight>_zero`); any
    other quantized weight is dequantized once all its parts are read (they may come in any
    order, in different files); a float weight of a layer kept quantized is quantized
    (online), or refused (a quantized checkpoint). Packed weights (`<x>.weight_packed`) are
    read as `<x>.weight`: int4 stays packed, int8 is unpacked; GPTQ's and AWQ's are repacked."""
    needed = ("", "_scale", "_zero") if cfg.zero_points else ("", "_scale")
    waiting: dict[str, dict[str, torch.Tensor]] = {}  # quantized weights not kept so: their parts read so far
    for name, tensor in _unpacked(weights, cfg):
        owner, part = _grid_owner(name)
        if owner is None and tensor.dtype in STORAGE.values():
            owner = name  # the values themselves
        if owner is not None:
            if kept(owner) is not None:
                yield owner + part, tensor.float() if part == "_scale" else tensor
                continue
            parts = waiting.setdefault(owner, {})
            parts[part] = tensor
            if all(p in parts for p in needed):
                del waiting[owner]
                yield owner, dequantize(parts[""], parts["_scale"], cfg.block, zero=parts.get("_zero"))
        elif kept(name) is not None:
            if not cfg.online:
                raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype}, but the checkpoint's quantization_config "
                                 f"stores it in {cfg.kind} (list it in modules_to_not_convert or ignore)")
            # a scale per output channel of the checkpoint's whole row (a tensor-parallel rank's
            # share of a layer split by columns takes it whole: the model is the same split or not)
            q, scale = quantize(tensor, (1, tensor.shape[-1]))
            yield name, q
            yield name + "_scale", scale
        else:
            yield name, tensor
    unscaled = sorted(owner for owner, parts in waiting.items() if "" in parts)
    if unscaled:
        raise ValueError(f"checkpoint has quantized weights without scales{' or zero points' if cfg.zero_points else ''}: "
                         f"{', '.join(unscaled[:8])}")
    if waiting:
        raise ValueError(f"checkpoint has scales of no quantized weight: {', '.join(sorted(waiting)[:8])}")


def _unpacked(weights: Iterable[tuple[str, torch.Tensor]], cfg: QuantConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors less those genq does not read, packed weights renamed (and
    GPTQ's and AWQ's repacked)."""
    if cfg.act_order:
        weights = _in_group_order(weights, cfg)
    for name, tensor in weights:
        if name.endswith(_IGNORED):
            continue
        if cfg.packing is not None and name.endswith(_GPTQ_PARTS):
            yield from _repacked(name, tensor, cfg)
        elif name.endswith(".weight_packed"):
            yield name.removesuffix("_packed"), unpack(tensor, 8) if cfg.kind == "int8" else tensor
        elif name.endswith(".weight_zero_point"):  # compressed-tensors': int8, or packed along the outputs
            zero = unpack(tensor.t(), 8 if cfg.kind == "int8" else 4).t() if tensor.dtype == torch.int32 else tensor
            yield name.removesuffix("_point"), zero.to(torch.int8).contiguous()
        else:
            yield name, tensor


# GPTQ's and AWQ's tensors of a layer: its values, their scales and zero points, each column's group
_GPTQ_PARTS = (".qweight", ".scales", ".qzeros", ".g_idx")
# AWQ packs eight outputs to a word in this order: column 8w + j is in nibble _AWQ_NIBBLE[j] of word w
_AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)


def _repacked(name: str, tensor: torch.Tensor, cfg: QuantConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """One of a GPTQ or AWQ layer's tensors as genq holds it (`<x>.weight`, `<x>.weight_scale`,
    `<x>.weight_zero`: [out, ...] rows; the values and zero points less 2^(bits-1), int4 in
    compressed-tensors' packing). Their layouts, transposed ([in, out]):
    GPTQ: qweight [in * bits / 32, out], value k of a column in bits `bits * (k % (32 / bits))`
    of word k // (32 / bits) (for 4 bits, compressed-tensors' packing already); qzeros [groups,
    out * bits / 32] packed so along the outputs, stored less one by the original format
    (checkpoint_format gptq, not gptq_v2); g_idx [in], each column's group (genq serves the
    columns in order).
    AWQ: qweight [in, out / 8] and qzeros [groups, out / 8], eight outputs to a word in
    AWQ's interleaved order.
    Both: scales [groups, out] float16."""
    stem, _, part = name.rpartition(".")
    bits = 8 if cfg.kind == "int8" else 4
    if part == "scales":
        yield stem + ".weight_scale", tensor.float().t().contiguous()
    elif part == "g_idx":
        if not _groups_follow_columns(tensor, cfg):
            raise ValueError(f"{name!r} puts the columns in groups out of order (act-order), but the "
                             "checkpoint's quantization_config says desc_act false")
    elif part == "qweight" and cfg.packing == "awq":
        values = _awq_columns(unpack(tensor, 4))  # [in, out]
        yield stem + ".weight", pack_int4(values.t())
    elif part == "qweight":
        yield stem + ".weight", tensor.t().contiguous() if bits == 4 else unpack(tensor.t(), 8)
    else:  # qzeros
        zeros = unpack(tensor, bits).to(torch.int16)  # [groups, out]
        if cfg.packing == "awq":
            zeros = _awq_columns(zeros)
        elif cfg.packing == "gptq":
            zeros += 1
        if not cfg.zero_points:  # symmetric: every zero point 2^(bits-1), here 0
            if zeros.any():
                raise ValueError(f"{name!r} holds zero points other than {1 << (bits - 1)}, but the checkpoint's "
                                 "quantization_config says sym")
            return
        if zeros.abs().max() > 127:
            raise ValueError(f"{name!r} holds a zero point out of range for {bits}-bit values")
        yield stem + ".weight_zero", zeros.to(torch.int8).t().contiguous()


def _in_group_order(weights: Iterable[tuple[str, torch.Tensor]], cfg: QuantConfig
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """GPTQ's act-order: a layer's columns are quantized in order of importance, each one's
    group in `g_idx`. Each layer's qweight waits for its g_idx (or the other way round), then
    comes out as genq's `<x>.weight` with its columns sorted by group (a stable sort: the
    groups then lie in order, as genq's kernels read them), and `<x>.input_perm`, that order."""
    bits = 8 if cfg.kind == "int8" else 4
    waiting_weights: dict[str, torch.Tensor] = {}
    orders: dict[str, torch.Tensor] = {}

    def sorted_weight(stem: str, qweight: torch.Tensor, order: torch.Tensor) -> tuple[str, torch.Tensor]:
        values = unpack(qweight.t(), bits)[:, order]  # [out, in]
        return stem + ".weight", pack_int4(values) if bits == 4 else values.contiguous()

    for name, tensor in weights:
        stem, _, part = name.rpartition(".")
        if part == "g_idx":
            order = torch.argsort(tensor.long(), stable=True)
            if not _groups_follow_columns(tensor[order], cfg):
                raise ValueError(f"{name!r} does not put {cfg.block[1] if cfg.block else tensor.numel()} "
                                 "columns in each group")
            yield stem + ".input_perm", order
            if stem in waiting_weights:
                yield sorted_weight(stem, waiting_weights.pop(stem), order)
            else:
                orders[stem] = order
        elif part == "qweight":
            if stem in orders:
                yield sorted_weight(stem, tensor, orders.pop(stem))
            else:
                waiting_weights[stem] = tensor
        else:
            yield name, tensor
    if waiting_weights:
        raise ValueError(f"checkpoint has act-order GPTQ weights without g_idx: {', '.join(sorted(waiting_weights)[:8])}")


def _groups_follow_columns(g_idx: torch.Tensor, cfg: QuantConfig) -> bool:
    """Whether each column's group (GPTQ's g_idx) is its place over the group size: groups of
    consecutive columns, in order, as genq's kernels read them."""
    group = cfg.block[1] if cfg.block else g_idx.numel()  # per channel: one group
    return torch.equal(g_idx.long().cpu(), torch.arange(g_idx.numel()) // group)


def _awq_columns(values: torch.Tensor) -> torch.Tensor:
    """AWQ's unpacked values [rows, out], nibble order within each word, in column order."""
    rows, cols = values.shape
    order = torch.tensor(_AWQ_NIBBLE, device=values.device)
    return values.view(rows, cols // 8, 8)[:, :, order].reshape(rows, cols)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit values [rows, out] packed as AutoAWQ's GEMM checkpoints hold them, the
    inverse of `_awq_columns` (for writing such checkpoints): [rows, out / 8] int32."""
    shifts = 4 * torch.tensor(_AWQ_NIBBLE, device=values.device)
    words = (values.long().view(values.shape[0], -1, 8) << shifts).sum(-1)
    return (words - (words >= 2**31) * 2**32).to(torch.int32)  # the same 32 bits, as int32


def _grid_owner(name: str) -> tuple[str | None, str]:
    """The weight a scale or zero-point tensor belongs to, and which it is ("_scale",
    "_zero"): `x.weight` for `x.weight_scale_inv`, `x.weight_scale` or `x.weight_zero`;
    stacked experts' `x.gate_up_proj` for `x.gate_up_proj_scale_inv`. (None, "") for
    any other tensor."""
    for suffix, part in (("_scale_inv", "_scale"), ("_scale", "_scale"), ("_zero", "_zero")):
        if name.endswith(suffix) and (name.endswith(".weight" + suffix) or suffix == "_scale_inv"):
            return name.removesuffix(suffix), part
    return None, ""


# the parameters a quantized weight `<w>` comes with, on its scale grid
GRID_PARTS = ("_scale", "_zero")


def grid_part(name: str) -> str:
    """Which of a quantized weight's grids a parameter name is ("_scale", "_zero"), or ""."""
    return next((part for part in GRID_PARTS if name.endswith(part)), "")
