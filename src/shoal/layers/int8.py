"""int8 Linears for CPU, at the Linear seam: what a card's `quantize: int8` swaps in at load.

`Int8Linear.of(linear)` stands in for an `nn.Linear` (an `Int8FusedLinear` for a `FusedLinear`,
keeping its shards and `split`) with the same contract: float32 `[..., in]` in, float32
`[..., out]` out, bias included.

- Weights: int8, symmetric, one scale per output row (max |w_row| / 127; / 63 for the u8 kernel
  below), quantised once at load and kept transposed, `[in, out]`, as `torch._int_mm` takes them
  (the u8 kernel keeps them only in oneDNN's layout): a quarter of float32's bytes, plus a float32
  scale and the float32 bias per row.
- Activations: int8, symmetric, one scale per token (max |x_t| / 127), at every call, so a
  token's grid is its own, whatever batch it was packed into. (torch.ao's dynamic quantisation,
  fbgemm's `quantized::linear_dynamic`, takes one scale per call over all the tokens: one outlier
  token coarsens every other's grid. On MiniLM it cost 0.009 of Lee Spearman and took the worst
  cosine to float32 to 0.991; its packed weights also need torch's quantized tensors, deprecated
  in 2.13.)
- Outlier channels: transformers carry a few input channels of huge activations for every token
  (MiniLM's ffn_in: 17x the median channel); in a per-token scale they would leave every other
  channel a few levels. `input_maxima` records each Linear's per-channel max while the float32
  model reads calibration text (the runner's, at load); the channels over OUTLIER_RATIO x the
  median stay float32 (`x[:, outliers] @ W[:, outliers]^T`, added to the int8 product): 43 of
  MiniLM's 16,128 input channels, 0.7% of MPNet's. It takes the worst cosine to float32 on single
  words from 0.982 to 0.998 (MiniLM), on Lee sentences from 0.972 to 0.997 and MPNet's shift of
  Lee Spearman from -0.009 to -0.004, for ~5% of the int8 speed.
- Product, one of two kernels (`default_kernel()` picks by the CPU, once):
  - `int_mm`: `torch._int_mm`, int8 x int8 -> int32 through oneDNN, then `y = acc * s_token * s_row
    + bias`, converted in place in the int32 result's own memory. Fast where the CPU has VNNI
    (AVX-512 VNNI, AVX-VNNI, AMX), and on non-x86 CPUs.
  - `u8`: x86 CPUs without VNNI (AVX2 only). There `_int_mm` runs ~35x slower than float32 (a
    reference loop), while oneDNN's u8 x s8 inner product (`torch.ops.onednn.qlinear_pointwise`,
    weights prepacked once) runs faster than float32 (docs/benchmarks.md, int8). Its AVX2 kernel multiplies u8 by s8 and
    adds pairs in int16 with saturation, so one operand must keep to 7 bits: the weights do (per
    row, [-63, 63]; |pair| <= 2 x 255 x 63 < 2^15), the activations keep 8 (per token, sent as
    q + 128 with zero point 128). 7-bit activations instead cost twice the quality (MPNet: worst
    word cosine 0.9875, Lee Spearman -0.0051). The op applies the rows' scales; the tokens'
    scales and the bias follow.

Integer accumulation is exact, but rounding to int8 amplifies float32's last-bit differences (a
value near a rounding boundary lands on the other level), so a sequence's int8 vector varies with
its batch by ~2e-4 of cosine where float32's varies by ~1e-7; the same batch gives the same bits.
A LoRA adapter's forward hook (layers/lora.py) sees this module as it sees any Linear: float32
input and output, to which it adds its float32 delta. bench/int8.py measures the speed and the
quality on MiniLM and MPNet.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Callable, Mapping
from typing import Literal, cast

import torch
from torch import nn

from ..cpuinfo import cpu_flags
from .linear import FusedLinear, Shards

_TINY = 1e-12  # an all-zero row gets a scale, not a division by zero
OUTLIER_RATIO = 5.0  # an input channel this many times the median channel's max stays float32
MAX_OUTLIER_SHARE = 16  # ... up to 1/16 of a Linear's input channels


Kernel = Literal["int_mm", "u8"]
_VNNI_FLAGS = {"avx512_vnni", "avx_vnni", "amx_int8"}
_U8_ZERO_POINT = 128  # kernel u8: activations are sent as q + 128, q in [-127, 127]
_U8_WEIGHT_LEVELS = 63  # ... and the weights keep to [-63, 63]: 7 bits (see the module)


@functools.cache
def default_kernel() -> Kernel:
    """`u8` on an x86 CPU without VNNI where this torch has oneDNN's quantized inner product,
    else `int_mm` (see the module)."""
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
    if not x86 or cpu_flags() & _VNNI_FLAGS or not _u8_works():
        return "int_mm"
    return "u8"


def _u8_works() -> bool:
    """This torch's oneDNN quantized inner product takes the call the u8 kernel makes (its
    signature has changed between releases), and gives the right sum."""
    try:
        linear = Int8Linear(torch.ones(8, 2, dtype=torch.int8), torch.ones(2), None, kernel="u8")
        return bool(torch.allclose(linear(torch.ones(1, 8)), torch.full((1, 2), 8.0), rtol=1e-3))
    except (AttributeError, RuntimeError, TypeError):
        return False


class Int8Linear(nn.Module):
    """`y = x @ W^T + b` with W in int8 and x quantised per token on the fly; the input channels
    in `outliers` stay float32 (see the module)."""

    # Buffers (registered in __init__).
    weight_t: torch.Tensor | None  # None with kernel u8
    weight_scale: torch.Tensor
    bias: torch.Tensor | None
    outliers: torch.Tensor | None
    outlier_weight_t: torch.Tensor | None  # set exactly when `outliers` is

    def __init__(
        self,
        weight_t: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        outliers: torch.Tensor | None = None,
        outlier_weight_t: torch.Tensor | None = None,
        kernel: Kernel = "int_mm",
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = weight_t.shape
        self.kernel = kernel
        kept: torch.Tensor | None = weight_t
        # Buffers, not parameters: nothing trains them, and `ModelRunner` reads the activations'
        # dtype off the model's parameters (float32 here), not off the int8 weights.
        if kernel == "u8":  # the weights live in oneDNN's layout only (opaque: `packed_bytes` counts them)
            self.packed = torch.ops.onednn.qlinear_prepack(weight_t.t().contiguous(), None)
            self.register_buffer("_zero_points", torch.zeros(self.out_features, dtype=torch.int64))
            kept = None
        self.register_buffer("weight_t", kept)  # [in, out] int8, zeros in the outliers' rows (int_mm)
        self.register_buffer("weight_scale", weight_scale)  # [out] float32
        self.register_buffer("bias", bias)  # [out] float32, or None
        self.register_buffer("outliers", outliers)  # [k] int64 input channels, or None
        self.register_buffer("outlier_weight_t", outlier_weight_t)  # [k, out] float32, or None

    @property
    def num_bytes(self) -> int:
        """Bytes of the int8 weights when they are held outside the buffers (kernel u8), else 0."""
        return self.in_features * self.out_features if self.kernel == "u8" else 0

    @classmethod
    def of(cls, linear: nn.Linear, input_max: torch.Tensor | None = None, kernel: Kernel | None = None) -> Int8Linear:
        """The int8 stand-in for `linear` (a float32 CPU Linear, or a FusedLinear). `input_max`
        `[in]`: the largest |x| seen per input channel on calibration text (`input_maxima`);
        channels far above the others stay float32. `kernel`: None, this CPU's (`default_kernel`)."""
        weight = linear.weight.detach().float().clone()  # [out, in]
        outliers = None if input_max is None else outlier_channels(input_max)
        outlier_weight_t = None
        if outliers is not None:
            outlier_weight_t = weight[:, outliers].t().contiguous()  # [k, out]
            weight[:, outliers] = 0  # out of the int8 product, and of the rows' scales
        kernel = kernel or default_kernel()
        levels = _U8_WEIGHT_LEVELS if kernel == "u8" else 127
        scale = weight.abs().amax(1).clamp_min(_TINY) / levels  # [out]
        weight_t = torch.round(weight / scale[:, None]).clamp_(-levels, levels).to(torch.int8).t().contiguous()
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        parts = (weight_t, scale, bias, outliers, outlier_weight_t, kernel)
        if isinstance(linear, FusedLinear):
            return Int8FusedLinear(*parts, shard_sizes=linear.shard_sizes)
        return cls(*parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)  # [T, in]
        # The outlier channels, zeroed in a copy, neither set the tokens' scales nor enter the int8 product.
        rows, scratch = (x, False) if self.outliers is None else (x.index_fill(1, self.outliers, 0), True)
        if self.kernel == "u8":
            u8, scale = quantize_rows(rows, overwrite=scratch, zero_point=_U8_ZERO_POINT)  # [T, in] uint8, q + 128
            y = torch.ops.onednn.qlinear_pointwise(
                u8,
                1.0,
                _U8_ZERO_POINT,
                self.packed,
                self.weight_scale,
                self._zero_points,
                None,
                1.0,
                0,
                torch.float32,
                "none",
                [],
                "",
            )
            if self.bias is None:  # y = acc * s_row: the tokens' scales and the bias are left
                y.mul_(scale)
            else:
                torch.addcmul(self.bias, y, scale, out=y)
        else:
            q, scale = quantize_rows(rows, overwrite=scratch)  # [T, in] int8, [T, 1]
            assert self.weight_t is not None  # kernel int_mm keeps its weights
            acc = torch._int_mm(q, self.weight_t)  # [T, out] int32
            y = acc.view(torch.float32).copy_(acc)  # [T, out] float32, in the same memory: no second buffer
            y.mul_(scale)
            if self.bias is None:
                y.mul_(self.weight_scale)
            else:
                torch.addcmul(self.bias, y, self.weight_scale, out=y)
        if self.outliers is not None:  # + x[:, outliers] @ W[:, outliers]^T, in float32
            assert self.outlier_weight_t is not None
            y.addmm_(x.index_select(1, self.outliers), self.outlier_weight_t)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        outliers = 0 if self.outliers is None else len(self.outliers)
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"float32_inputs={outliers}, kernel={self.kernel}"
        )


class Int8FusedLinear(Shards, Int8Linear):
    """A `FusedLinear` in int8: one matmul for the shards, `split` cuts the output as it did."""


def quantize_rows(x: torch.Tensor, overwrite: bool = False, zero_point: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T, k]` float32 -> (`[T, k]` int8 q, `[T, 1]` float32 scale) with x ~= q * scale, symmetric
    per row, q in [-127, 127]; with a `zero_point`, uint8 q + zero_point. The absolute max is
    max(max, -min): two reads of x, no `[T, k]` temporary. `overwrite`: x is a scratch copy,
    rounded in place."""
    absmax = torch.maximum(x.amax(1, keepdim=True), x.amin(1, keepdim=True).neg_())  # [T, 1]
    scale = absmax.clamp_min_(_TINY).div_(127)
    scaled = x.mul_(scale.reciprocal()) if overwrite else torch.mul(x, scale.reciprocal())
    if zero_point:
        return scaled.round_().add_(zero_point).to(torch.uint8), scale
    return scaled.round_().to(torch.int8), scale


def outlier_channels(input_max: torch.Tensor) -> torch.Tensor | None:
    """The input channels whose calibration max `input_max` `[in]` exceeds OUTLIER_RATIO x the
    median channel's (at most the largest in / MAX_OUTLIER_SHARE), as int64 indices; None if none."""
    limit = input_max.median() * OUTLIER_RATIO
    if limit <= 0:  # most channels never fired on the calibration text: no telling outliers apart
        return None
    order = torch.argsort(input_max, descending=True)[: len(input_max) // MAX_OUTLIER_SHARE]
    chosen = order[input_max[order] > limit]
    return torch.sort(chosen).values if len(chosen) else None


def input_maxima(model: nn.Module, run: Callable[[], object]) -> dict[str, torch.Tensor]:
    """Per `nn.Linear` of `model` (by name), the largest |x| per input channel `[in]` while `run()`
    runs the model (over every call: DeBERTa also projects its position table)."""
    maxima: dict[str, torch.Tensor] = {}

    def record(name: str, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        seen = inputs[0].detach().reshape(-1, module.in_features).abs().amax(0).float()  # [in]
        maxima[name] = seen if name not in maxima else torch.maximum(maxima[name], seen)

    handles = [
        module.register_forward_hook(functools.partial(record, name))
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
    ]
    try:
        with torch.inference_mode():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return maxima


def quantize_linears(
    model: nn.Module, input_max: Mapping[str, torch.Tensor] | None = None, kernel: Kernel | None = None
) -> tuple[str, ...]:
    """Replace every `nn.Linear` of `model` by its int8 stand-in, in place; returns their names.
    `input_max`: `input_maxima` of the float32 model, to keep its outlier channels in float32.

    Embeddings and norms are not Linears and stay float32, as do the heads, which hold their own
    tensors outside the model.
    """
    input_max = input_max or {}
    names = tuple(name for name, module in model.named_modules() if isinstance(module, nn.Linear))
    for name in names:
        parent, _, child = name.rpartition(".")
        setattr(
            model.get_submodule(parent),
            child,
            Int8Linear.of(cast(nn.Linear, model.get_submodule(name)), input_max.get(name), kernel),
        )
    return names
