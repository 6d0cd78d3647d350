"""The dense head: pooling over packed encoder output, the sentence-transformers modules after it
(Dense, Normalize), then per-sequence Matryoshka truncation, normalisation and output dtype.

Pooling works on `[T, hidden]` with the batch's `AttentionMeta`; post-processing works on numpy
vectors, one per sequence, since each request may ask for different dimensions and dtypes.

When the model folder is a sentence-transformers folder (`modules.json`), its Pooling, Dense and
Normalize modules are read (`st_folder`) and applied; a card that contradicts them (pooling,
dimensions, normalize) is a load error naming the field. A card may ask to normalise a model whose
folder does not (that is a serving choice, as `normalize_embeddings=True` is), not the reverse.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ModelLoadError
from ..layers import AttentionMeta
from ..vectors import finish
from ..weights import load_tensors
from .st_folder import CARD_POOLING, DenseModule, DensePipeline, read_pipeline

_HALF = (torch.float16, torch.bfloat16)

Step = Callable[[torch.Tensor], torch.Tensor]  # [n, d_in] -> [n, d_out]


def pool(
    hidden: torch.Tensor,
    meta: AttentionMeta,
    method: str,
    *,
    skip: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`[T, hidden]` -> `[n, hidden]`, one vector per sequence, in `dtype` (default: hidden's);
    `model`: the model pooled already (`hidden` is `[n, dim]`).

    `skip` `[n]`: leading tokens of each sequence left out of pooling (a prompt, with
    sentence-transformers' `include_prompt: false`): mean averages the rest (zeros when nothing is
    left), cls takes the first token after them, last is unchanged. Mean pooling of half-precision
    states sums in float32: a long sequence's fp16 running sum loses the low bits of every term.
    """
    starts, ends = meta.cu_seqlens[:-1].long(), meta.cu_seqlens[1:].long()
    dtype = dtype or hidden.dtype
    if skip is not None:
        skip = skip.to(device=starts.device, dtype=torch.long)
    if method == "cls":
        first = starts if skip is None else starts + torch.where(ends - starts > skip, skip, 0)
        return hidden[first].to(dtype)
    if method == "last":
        return hidden[ends - 1].to(dtype)
    if method == "model":
        return hidden.to(dtype)
    if method == "mean":
        acc = torch.float32 if hidden.dtype in _HALF else hidden.dtype
        counts, seq_index, states = ends - starts, meta.seq_index, hidden
        if skip is not None:
            kept = meta.pos_in_seq >= skip[seq_index]  # [T]
            counts, seq_index, states = (counts - skip).clamp(min=0), seq_index[kept], hidden[kept]
        sums = torch.zeros(meta.num_seqs, hidden.shape[1], dtype=acc, device=hidden.device)
        sums.index_add_(0, seq_index, states.to(acc))  # [n, hidden]
        return (sums / counts.clamp(min=1).to(acc)[:, None]).to(dtype)
    raise ValueError(f"unknown pooling {method!r}")


class PoolingHead:
    """`dense`: one pooled vector per sequence, through the folder's modules, finished per its spec."""

    output = "dense"

    def __init__(self, method: str, steps: tuple[Step, ...] = (), include_prompt: bool = True) -> None:
        self.method = method
        self.steps = steps
        self.include_prompt = include_prompt

    @classmethod
    def build(cls, ctx) -> PoolingHead:
        pipeline = read_pipeline(ctx.directory) if ctx.directory is not None else None
        if pipeline is None:
            return cls(ctx.card.pooling)
        method = _check_card(ctx.card, pipeline, ctx.directory)
        steps, width = [], pipeline.embedding_dimension * len(pipeline.modes)
        modules = list(pipeline.steps)
        while modules and not isinstance(modules[-1], DenseModule):
            modules.pop()  # a trailing Normalize is the card's `normalize` (the card must agree), which a
            # request may turn off; one before a Dense is part of the model and always runs
        for step in modules:
            if isinstance(step, DenseModule):
                steps.append(_dense(step, width, ctx.to["device"]))
                width = step.out_features
            else:
                steps.append(_normalize)
        return cls(method, tuple(steps), pipeline.include_prompt)

    def run(self, hidden, specs) -> list[np.ndarray | None]:
        skip = None
        if not self.include_prompt:
            prompt_tokens = [getattr(s, "prompt_tokens", 0) for s in specs]
            if any(prompt_tokens):
                skip = torch.tensor(prompt_tokens)
        # float32 from here on: the folder's Dense layers run on the accumulated vector.
        x = pool(hidden.states, hidden.meta, self.method, skip=skip, dtype=torch.float32)  # [n, h]
        for step in self.steps:
            x = step(x)
        vectors = x.cpu().numpy()  # [n, d]
        return [
            finish(vectors[i], dimensions=s.dimensions, normalize=s.normalize, output_dtype=s.output_dtype)
            if "dense" in s.outputs
            else None
            for i, s in enumerate(specs)
        ]


def _check_card(card, pipeline: DensePipeline, directory: Path) -> str:
    """The card's pooling, dimensions and normalize agree with the folder; returns the pooling."""

    def fail(field: str, message: str, folder_value) -> None:
        raise ModelLoadError(
            f"{card.id}: the card's `{field}` {message}",
            details={
                "model": card.id,
                "field": field,
                "card": getattr(card, field),
                "folder": folder_value,
                "directory": str(directory),
            },
        )

    modes = pipeline.modes
    if len(modes) != 1 or modes[0] not in CARD_POOLING:
        fail(
            "pooling",
            f"cannot express the folder's pooling {'+'.join(modes)} (shoal pools cls, mean or lasttoken)",
            list(modes),
        )
    method = CARD_POOLING[modes[0]]
    if card.pooling != method:
        fail("pooling", f"is {card.pooling}, but the folder's Pooling module says {modes[0]}", modes[0])
    if card.dimensions != pipeline.dimensions:
        fail(
            "dimensions",
            f"is {card.dimensions}, but the folder's modules make {pipeline.dimensions}-dimensional vectors",
            pipeline.dimensions,
        )
    if pipeline.normalizes and not card.normalize:
        fail("normalize", "is false, but the folder ends with a Normalize module", True)
    return method


_ACTIVATIONS: dict[str, Step] = {
    "Identity": lambda x: x,
    "Tanh": torch.tanh,
    "ReLU": F.relu,
    "GELU": F.gelu,
    "Sigmoid": torch.sigmoid,
    "SiLU": F.silu,
}


def _dense(module: DenseModule, width: int, device) -> Step:
    """One Dense module as a float32 step on `device`."""
    config = module.directory / "config.json"
    if module.in_features != width:
        raise ModelLoadError(
            f"{config}: in_features {module.in_features} does not fit the {width}-dimensional input it gets",
            details={"file": str(config), "field": "in_features"},
        )
    if module.activation not in _ACTIVATIONS:
        raise ModelLoadError(
            f"{config}: activation_function {module.activation} is not supported; known: {', '.join(_ACTIVATIONS)}",
            details={"file": str(config), "field": "activation_function"},
        )
    names = ["linear.weight"] + (["linear.bias"] if module.bias else [])
    if module.residual and module.in_features != module.out_features:
        names.append("residual.weight")
    t = {k: v.to(device=device, dtype=torch.float32) for k, v in load_tensors(module.directory, names).items()}
    weight, bias, act = t["linear.weight"], t.get("linear.bias"), _ACTIVATIONS[module.activation]
    if tuple(weight.shape) != (module.out_features, module.in_features):
        raise ModelLoadError(
            f"{module.directory}: linear.weight is {tuple(weight.shape)}, config says "
            f"({module.out_features}, {module.in_features})",
            details={"file": str(config)},
        )
    if not module.residual:
        return lambda x: act(F.linear(x, weight, bias))
    project = t.get("residual.weight")
    return lambda x: act(F.linear(x, weight, bias)) + (x if project is None else F.linear(x, project))


def _normalize(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x, p=2, dim=-1)
