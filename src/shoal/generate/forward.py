"""A decoder step over cached sequences: shoal's Llama-family forward (`models/llama.py`: Llama,
SmolLM2, Qwen2, Qwen3) run on a packed batch of new tokens of several sequences, each with keys and
values already in its KV cache slot.

    new tokens of each sequence, packed [T]
      ─ embeddings ─ per layer: norm, qkv, (qk norm), rotary at each token's position
      ─ keys and values written to each sequence's slot at its positions
      ─ attention of each new token over its slot up to itself (causal)
      ─ out projection, the SwiGLU MLP ─ final norm
      ─ the LM head on each sequence's last new token ─ logits [sequences, vocab]

Attention: when every sequence brings one token (a decode step), one batched call over the
sequences' positions padded to the longest, masked (no mask when they are equally long);
otherwise (a prefill) one causal call per sequence. Positions are read and written through the
cache's block table (generate/kv_cache.py); a decode step of one sequence whose blocks are
consecutive reads its keys and values as one slice of the pools, not a gather.

One token's step is bound by the count of small ops more than their size (docs/benchmarks.md):
queries and keys are rotated in one call, the cache written with `index_copy_` and gathered with
`index_select` (faster than indexing), which is why these differ from the encoder's layer.
"""

from __future__ import annotations

import functools
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..layers.packed import PackedLinear
from ..layers.rotary import apply_rotary
from ..models.llama import LlamaLayer, LlamaModel
from ..weights import load_tensors
from .kv_cache import PagedCache

_COMPILE_LOCK = threading.Lock()


@dataclass(frozen=True)
class _Plan:
    """Where a step's tokens go: per token its position and its index in the cache's pools; per
    segment its slot, first position, token count and end; what attention reads: a prefill
    segment's indices of its positions so far, a decode step's `[S, longest]` of them, or, for a
    decode of one sequence whose blocks are consecutive, the pool index its positions start at."""

    positions: torch.Tensor  # [T]
    writes: torch.Tensor  # [T] indices into the pools
    segment_slots: list[int]
    starts: list[int]
    counts: list[int]
    ends: list[int]
    decode: bool  # one token per segment
    reads: list[torch.Tensor]  # a prefill: each segment's [end] indices; a decode: one [S, longest] (or none: span)
    span: int | None = None  # a decode of one sequence whose positions lie side by side: the first's index


@dataclass(frozen=True)
class Segment:
    """One sequence's new tokens in a step: its cache slot, and the tokens' ids."""

    slot: int
    ids: list[int]


class CachedDecoder:
    """Runs steps of a Llama-family `model` against `cache` (see the module docstring). The LM head
    is the embeddings (tied, as SmolLM2 and the small Qwen models have it) unless `lm_head` is given
    (a checkpoint's own, `lm_head_of`)."""

    def __init__(self, model: LlamaModel, cache: PagedCache, lm_head: torch.Tensor | None = None) -> None:
        if not isinstance(model, LlamaModel):
            raise ConfigError(f"generation runs on Llama-family decoders; this model is a {type(model).__name__}")
        if lm_head is None and not model.config.tie_word_embeddings:
            raise ConfigError(
                f"this {model.config.model_type} checkpoint has its own LM head (tie_word_embeddings false): "
                "pass it as lm_head (`lm_head_of` reads it from the checkpoint)"
            )
        if lm_head is not None and lm_head.shape != model.embed_tokens.weight.shape:
            raise ConfigError(
                f"the LM head is {tuple(lm_head.shape)}, the embeddings {tuple(model.embed_tokens.weight.shape)}: "
                "a head of [vocab, hidden] is needed"
            )
        if cache.k.dtype != model.embed_tokens.weight.dtype:
            raise ConfigError(
                f"the KV cache is {cache.k.dtype}, the model {model.embed_tokens.weight.dtype}: make them one"
            )
        self.model = model
        self.cache = cache
        self.lm_head = model.embed_tokens.weight if lm_head is None else lm_head
        self.vocab_size = self.lm_head.shape[0]
        # hidden [S, hidden] -> logits [S, vocab]; `pack_head` swaps in a oneDNN-packed product.
        self.head: Callable[[torch.Tensor], torch.Tensor] = functools.partial(F.linear, weight=self.lm_head)
        # A layer of one sequence's decode step over a slice of the pools; `compile_span` may swap in
        # a compiled one.
        self._span_layer: Callable[..., torch.Tensor] = _span_layer
        self.compiled = False

    def pack_head(self) -> int:
        """The LM head as a oneDNN-packed float32 product (layers/packed.py), as the engine packs
        the decoder's Linears on a CPU; a tied head's packed copy is extra bytes (returned)."""
        linear = torch.nn.Linear(self.lm_head.shape[1], self.lm_head.shape[0], bias=False)
        linear.weight = torch.nn.Parameter(self.lm_head, requires_grad=False)
        self.head = PackedLinear.of(linear)
        return self.lm_head.numel() * self.lm_head.element_size()

    def drop_own_head(self) -> None:
        """Forget the float tensor of a checkpoint's own LM head once `head` multiplies with a copy
        of it (packed or int8), so the head is held once; a tied head is the embeddings and stays."""
        if self.lm_head is not self.model.embed_tokens.weight:
            self.lm_head = self.lm_head.new_empty((self.vocab_size, 0))  # keeps only its vocabulary size

    @torch.inference_mode()
    def compile_span(self) -> str | None:
        """Compiles the layer of one sequence's decode step (`_span_layer`) with torch.compile
        (inductor's C++ kernels fuse the norms, rotary, casts and residuals around the products;
        sizes symbolic, so one compile serves every layer and length; cached on disk by torch), and
        checks it against the eager layer on two scratch slots. Returns None once compiled, else why the
        steps stay eager (nothing changed). For models whose every layer has the same Linears (the
        guards kept are the tensors' only: one decoder's layers share the compiled code, and each
        decoder gets its own copy of it, so no other model's layer can match its entries)."""
        layers = [cast(LlamaLayer, layer) for layer in self.model.layers]
        kinds = {tuple(type(m).__name__ for m in layer.modules()) for layer in layers}
        if len(kinds) != 1:
            return "its layers differ in their Linears"
        with _COMPILE_LOCK:  # one compile at a time (models load on threads; dynamo's state is shared)
            return self._compile_span(layers)

    def _compile_span(self, layers: list[LlamaLayer]) -> str | None:
        cache = self.cache
        fn = types.FunctionType(_span_layer.__code__.replace(), _span_layer.__globals__, "_span_layer_compiled")
        slots: list[int] = []
        try:
            compiled = torch.compile(
                fn, dynamic=True, options={"guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe}
            )
            for length in (3, 7):  # two scratch slots, at two places in the pools
                slots.append(cache.alloc(length))
        except Exception as e:  # no compiler, or no room for two slots: eager steps
            for slot in slots:
                cache.free(slot)
            return f"{type(e).__name__}: {e}"
        try:
            layer, ck, cv = layers[0], cache.k[0], cache.v[0]
            hidden = self.model.embed_tokens.weight.shape[1]
            # Compiled at the first slot's lengths 2 and 3 (neither 0 nor 1, so they stay symbolic),
            # then checked at another start and lengths (1: a one-token prompt): with the guards
            # dropped, code specialised to the first values would show here rather than in an answer.
            for slot, end in ((slots[0], 2), (slots[0], 3), (slots[1], 7), (slots[1], 1)):
                start = cache.span(slot, end)
                if start is None:
                    return "a scratch slot's blocks are not consecutive"
                position = torch.tensor([end - 1], device=ck.device)
                x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(end)).to(ck)
                cos, sin = self.model.rotary.cos_sin(position, x.dtype)
                writes = cache.flat(torch.tensor([slot], device=ck.device), position)
                want = _span_layer(layer, x, cos, sin, ck, cv, writes, start, end)
                got = compiled(layer, x, cos, sin, ck, cv, writes, start, end)
                if not torch.allclose(got, want, rtol=0.05, atol=0.05 * float(want.abs().max())):
                    return f"the compiled layer differs from the eager one by {float((got - want).abs().max()):.3g}"
        except Exception as e:  # inductor could not build it here: eager steps
            return f"{type(e).__name__}: {e}"
        finally:
            for slot in slots:
                cache.free(slot)
        self._span_layer = compiled
        self.compiled = True
        return None

    @torch.inference_mode()
    def step(self, segments: list[Segment]) -> torch.Tensor:
        """Adds each segment's tokens to its slot; returns the logits after each segment's last
        token, `[len(segments), vocab]` (float32)."""
        cache, model = self.cache, self.model
        device = cache.k.device
        starts = [cache.lengths[s.slot] for s in segments]
        counts = [len(s.ids) for s in segments]
        for seg, start, n in zip(segments, starts, counts):
            if n < 1:
                raise ValueError(f"a segment of slot {seg.slot} has no tokens")
            if start + n > cache.reserved(seg.slot):  # never into another sequence's blocks
                raise ValueError(
                    f"slot {seg.slot} would hold {start + n} positions, over its {cache.reserved(seg.slot)}"
                )
        ids = torch.tensor([t for s in segments for t in s.ids], dtype=torch.long, device=device)
        slots = [s.slot for s in segments]
        ends = [st + n for st, n in zip(starts, counts)]
        decode = all(n == 1 for n in counts)
        if decode:  # each token at its sequence's next position
            positions = torch.tensor(starts, device=device)
        else:
            positions = torch.cat([torch.arange(st, st + n, device=device) for st, n in zip(starts, counts)])
        span = cache.span(slots[0], ends[0]) if decode and len(slots) == 1 else None
        if span is not None:  # read as one slice, written at the slice's next index
            reads, writes = [], torch.tensor([span + starts[0]], device=device)
        else:
            token_slots = torch.tensor([s.slot for s, n in zip(segments, counts) for _ in range(n)], device=device)
            writes = cache.flat(token_slots, positions)
            if decode:
                reads = [cache.gather_index(slots, max(ends))]
            else:
                reads = [cache.gather_index([slot], end)[0] for slot, end in zip(slots, ends)]
        plan = _Plan(positions, writes, slots, starts, counts, ends, decode, reads, span)
        x = model.embed_tokens(ids)  # [T, hidden]
        cos, sin = model.rotary.cos_sin(plan.positions, x.dtype)
        for index, layer in enumerate(model.layers):
            assert isinstance(layer, LlamaLayer)
            x = self._layer(index, layer, x, cos, sin, plan)
        for slot, end in zip(plan.segment_slots, plan.ends):
            cache.lengths[slot] = end
        if not decode:  # each segment's last token
            x = x[torch.tensor(counts, device=device).cumsum(0) - 1]
        hidden = model.norm(x)  # [S, hidden]
        return self.head(hidden).float()

    def _layer(
        self, index: int, layer: LlamaLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: _Plan
    ) -> torch.Tensor:
        ck, cv = self.cache.k[index], self.cache.v[index]  # [positions, Hkv, D]
        if plan.span is not None:
            return self._span_layer(layer, x, cos, sin, ck, cv, plan.writes, plan.span, plan.ends[0])
        q, k, v = _project(layer, x, cos, sin)
        ck.index_copy_(0, plan.writes, k)
        cv.index_copy_(0, plan.writes, v)
        if plan.decode:
            a = self._attend_decode(q, ck, cv, plan)
        else:
            outs, offset = [], 0
            for read, start, n in zip(plan.reads, plan.starts, plan.counts):
                outs.append(
                    self._attend_one(q[offset : offset + n], ck.index_select(0, read), cv.index_select(0, read), start)
                )
                offset += n
            a = torch.cat(outs)
        return layer.feed_forward(layer.attended(x, a))

    def _attend_one(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """Causal attention of `n` new tokens (positions start..start+n-1) over a slot's first
        start+n positions: `[n, H, D]`."""
        n = q.shape[0]
        qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        if start == 0:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=n > 1, enable_gqa=True)
        else:  # token i sees positions 0..start+i
            allowed = (
                torch.arange(start + n, device=q.device)[None, :]
                <= torch.arange(start, start + n, device=q.device)[:, None]
            )
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, enable_gqa=True)
        return out[0].transpose(0, 1)

    def _attend_decode(self, q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """One new token per sequence (q `[S, H, D]`) over its positions (the plan's `[S, longest]`
        reads, padded to the longest and masked): `[S, H, D]`."""
        ends = plan.ends
        S, longest = len(ends), max(ends)
        flat = plan.reads[0].view(-1)
        k = ck.index_select(0, flat).view(S, longest, *ck.shape[1:]).transpose(1, 2)  # [S, Hkv, L, D]
        v = cv.index_select(0, flat).view(S, longest, *cv.shape[1:]).transpose(1, 2)
        allowed = None
        if min(ends) < longest:  # shorter sequences mask what the padded gather read past their end
            allowed = torch.arange(longest, device=q.device)[None, :] < torch.tensor(ends, device=q.device)[:, None]
            allowed = allowed[:, None, None]
        out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=allowed, enable_gqa=True)
        return out[:, :, 0]


def _project(
    layer: LlamaLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`layer.project`, with the queries and keys rotated in one call where no per-head norm
    comes between (they sit side by side in the fused projection's output): a decode step of one
    token is bound by the count of small ops, not their size."""
    if layer.q_norm is not None:
        return layer.project(x, cos, sin)
    T, H, Hkv, D = x.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim
    qkv = layer.qkv(layer.attn_norm(x))  # [T, (H + 2 Hkv) D]
    qk = apply_rotary(qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D), cos, sin)
    return qk[:, :H], qk[:, H:], qkv[:, (H + Hkv) * D :].view(T, Hkv, D)


def _span_layer(
    layer: LlamaLayer,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    ck: torch.Tensor,
    cv: torch.Tensor,
    writes: torch.Tensor,
    start: int,
    end: int,
) -> torch.Tensor:
    """A layer of one sequence's decode step whose positions lie side by side in the pools from
    index `start` (`PagedCache.span`): its token `x` `[1, hidden]` written at `writes`, attending
    over the slice `ck[start : start + end]` (no gather, no mask). What `CachedDecoder.compile_span`
    compiles."""
    q, k, v = _project(layer, x, cos, sin)
    ck.index_copy_(0, writes, k)
    cv.index_copy_(0, writes, v)
    keys = ck[start : start + end].unsqueeze(0).transpose(1, 2)  # [1, Hkv, L, D]
    values = cv[start : start + end].unsqueeze(0).transpose(1, 2)
    a = F.scaled_dot_product_attention(q[:, :, None], keys, values, enable_gqa=True)[:, :, 0]  # [1, H, D]
    return layer.feed_forward(layer.attended(x, a))


def lm_head_of(directory: Path, model: LlamaModel) -> torch.Tensor | None:
    """The checkpoint's own LM head (`lm_head.weight`, `[vocab, hidden]`) in the embeddings' dtype
    and device where its config does not tie the head to the embeddings; None where it does."""
    if model.config.tie_word_embeddings:
        return None
    weight = load_tensors(directory, ["lm_head.weight"], prefixes=())["lm_head.weight"]
    embeddings = model.embed_tokens.weight
    return weight.to(device=embeddings.device, dtype=embeddings.dtype)
