"""What a loaded model costs the device: its tensors, measured, and its batch workspace, estimated.

`tensor_bytes` walks a model and its heads and adds up every distinct tensor storage (tied
weights, such as an MLM decoder sharing the word embeddings, count once). `workspace_bytes` is the
transient memory of the largest batch the model may run: the activations a layer holds at once
over `num_tokens` packed tokens, plus, on the padded attention path, the `[n, H, L, L]` scores of
sequences of `max_length` tokens (flash-attn on CUDA keeps none); heads that need their own
scratch (SPLADE's vocabulary-wide logits) say so with `workspace_bytes(num_tokens)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

_MAX_DEPTH = 4


def tensor_bytes(roots: Iterable[Any]) -> int:
    """Bytes of the distinct tensor storages reachable from `roots` (modules, heads, containers)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for tensor in _tensors(roots, 0):
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if key in seen or tensor.device.type == "meta":
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _tensors(objects: Iterable[Any], depth: int) -> Iterator[torch.Tensor]:
    for obj in objects:
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, torch.nn.Module):
            yield from obj.parameters()
            yield from obj.buffers()
        elif depth >= _MAX_DEPTH:
            continue
        elif isinstance(obj, (list, tuple)):
            yield from _tensors(obj, depth + 1)
        elif isinstance(obj, dict):
            yield from _tensors(obj.values(), depth + 1)
        elif type(obj).__module__.startswith("shoal.heads") and hasattr(obj, "__dict__"):
            yield from _tensors(vars(obj).values(), depth + 1)


def workspace_bytes(
    model: torch.nn.Module,
    heads: Iterable[Any],
    num_tokens: int,
    max_length: int,
    device: torch.device,
    flash: bool = False,
) -> int:
    """Peak transient bytes of one batch of `num_tokens` tokens (sequences up to `max_length`)."""
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None) or 1024
    inner = getattr(config, "intermediate_size", None) or 4 * hidden
    heads_n = getattr(config, "num_attention_heads", None) or max(1, hidden // 64)
    itemsize = next(model.parameters()).element_size()
    # A layer at its widest: the residual stream twice, q/k/v, the attention output, the MLP's
    # input-side projection and its activation (gated MLPs hold both halves).
    layer = num_tokens * itemsize * (6 * hidden + 2 * inner)
    length = min(max_length, num_tokens)
    scores = 0 if flash else num_tokens * heads_n * length * 4  # [n, H, L, L] with n*L = num_tokens, fp32
    head = max((h.workspace_bytes(num_tokens) for h in heads if hasattr(h, "workspace_bytes")), default=0)
    return layer + scores + head
