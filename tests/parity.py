"""What the parity tests share: shoal's packed models against transformers' padded ones.

Each tests/test_<architecture>_parity.py saves a random-initialised transformers model, loads the
checkpoint with shoal and compares the two on one packed batch of mixed lengths. The pieces common
to all of them live here: the packed batch, the padded reference run, randomised parameters, the
per-token diff, the pooled cosine and the packing check. Configs, shapes, the ids a reference
reserves and architecture-specific checks stay in each test file.

Imported as `parity`: pytest's default (prepend) import mode puts tests/ on sys.path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.initialization import no_init_weights

from shoal.heads import pool
from shoal.layers import AttentionMeta, PackedInputs

# The reference's side of each pooling method, over one sequence's `[n, hidden]` states.
REFERENCE_POOLING = {
    "cls": lambda states: states[0],
    "mean": lambda states: states.mean(0),
    "last": lambda states: states[-1],
}


# --- the packed batch ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedBatch:
    """Sequences of random ids packed back to back, as the runner hands them to a model."""

    seqs: list[torch.Tensor]  # one [n_i] id tensor per sequence
    token_types: list[torch.Tensor] | None  # one [n_i] segment tensor (0 or 1) per sequence, when drawn
    input_ids: torch.Tensor  # [T], T = sum(n_i)
    position_ids: torch.Tensor  # [T], restarting at 0 for each sequence
    meta: AttentionMeta  # cu_seqlens [B + 1] and the longest length

    @property
    def lengths(self) -> list[int]:
        return [len(s) for s in self.seqs]

    @property
    def token_type_ids(self) -> torch.Tensor:
        """[T] segment ids, packed like `input_ids`."""
        return torch.cat(_drawn_types(self))

    def inputs(self, *, with_token_types: bool = False) -> PackedInputs:
        """What a model's forward takes: the packed ids, positions and meta (and segment ids)."""
        token_type_ids = self.token_type_ids if with_token_types else None
        return PackedInputs(self.input_ids, self.position_ids, self.meta, token_type_ids)


def _drawn_types(batch: PackedBatch) -> list[torch.Tensor]:
    if batch.token_types is None:
        raise ValueError("this batch was drawn without token types: packed_batch(..., token_types=True)")
    return batch.token_types


def attention_meta(lengths: list[int], row_block_bytes: int = 1) -> AttentionMeta:
    """AttentionMeta for sequences of these lengths packed back to back. By default the feed-forward
    blocks run in the smallest row blocks (layers/rows.py: 64 rows), so that a batch of more tokens
    takes the blocked path a CPU serves with, and the reference checks it; 0: whole (as under LoRA)."""
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)  # [B + 1]
    return AttentionMeta.build(cu_seqlens, max(lengths), row_block_bytes=row_block_bytes)


def packed_batch(
    lengths: list[int], vocab_size: int, *, first_id: int = 1, token_types: bool = False, seed: int = 1
) -> PackedBatch:
    """One sequence of ids per length, drawn uniformly from [first_id, vocab_size) by a generator
    seeded with `seed`, packed with restarting positions. With `token_types`, segment ids 0/1 are
    drawn from the same generator after all the ids."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(first_id, vocab_size, (n,), generator=g) for n in lengths]
    types = [torch.randint(0, 2, (n,), generator=g) for n in lengths] if token_types else None
    return PackedBatch(
        seqs=seqs,
        token_types=types,
        input_ids=torch.cat(seqs),
        position_ids=torch.cat([torch.arange(n) for n in lengths]),
        meta=attention_meta(lengths),
    )


# --- running both sides -------------------------------------------------------------------------


def packed_hidden_states(model: torch.nn.Module, batch: PackedBatch, *, with_token_types: bool = False) -> torch.Tensor:
    """shoal's model on the packed batch, under inference mode: `[T, hidden]`."""
    with torch.inference_mode():
        return model(batch.inputs(with_token_types=with_token_types))


def reference_hidden_states(
    reference: torch.nn.Module, batch: PackedBatch, *, pad_id: int = 0, with_token_types: bool = False
) -> list[torch.Tensor]:
    """transformers' model on the batch's sequences right-padded with `pad_id` (as a tokenizer pads)
    and an attention mask; one `[n_i, hidden]` tensor of real tokens per sequence. With
    `with_token_types`, the batch's segment ids go in as `token_type_ids` (padded with 0)."""
    pad = torch.nn.utils.rnn.pad_sequence
    ids = pad(batch.seqs, batch_first=True, padding_value=pad_id)  # [B, L]
    mask = pad([torch.ones_like(s) for s in batch.seqs], batch_first=True)  # [B, L]
    extra = {"token_type_ids": pad(_drawn_types(batch), batch_first=True)} if with_token_types else {}
    with torch.no_grad():
        out = reference(input_ids=ids, attention_mask=mask, **extra).last_hidden_state  # [B, L, hidden]
    return [out[i, : len(s)] for i, s in enumerate(batch.seqs)]


# --- comparing them -----------------------------------------------------------------------------


def per_sequence_abs_diff(hidden: torch.Tensor, expected: list[torch.Tensor]) -> list[float]:
    """Largest absolute difference between packed `[T, hidden]` states and each sequence's expected
    `[n_i, hidden]` states, one float per sequence."""
    got = torch.split(hidden, [len(e) for e in expected])
    return [(g - e).abs().max().item() for g, e in zip(got, expected)]


def max_abs_diff(hidden: torch.Tensor, expected: list[torch.Tensor]) -> float:
    """Largest absolute difference over every token of every sequence."""
    return max(per_sequence_abs_diff(hidden, expected))


def min_pooled_cosine(hidden: torch.Tensor, meta: AttentionMeta, expected: list[torch.Tensor], method: str) -> float:
    """Smallest cosine, over the sequences, between shoal's `method` pooling of the packed states
    and the same pooling of the reference's per-sequence states."""
    pooled = pool(hidden, meta, method)  # [B, hidden]
    reference = torch.stack([REFERENCE_POOLING[method](e) for e in expected])  # [B, hidden]
    return torch.nn.functional.cosine_similarity(pooled, reference, dim=-1).min().item()


def assert_packing_invariant(
    model: torch.nn.Module, batch: PackedBatch, *, atol: float, pooling: str | None = None
) -> None:
    """Each sequence run alone gives what it gives inside the batch, to `atol`: per token, or per
    pooled vector when `pooling` names a method."""
    with torch.inference_mode():
        packed = model(batch.inputs())  # [T, hidden]
        in_batch = pool(packed, batch.meta, pooling) if pooling else torch.split(packed, batch.lengths)
        for i, s in enumerate(batch.seqs):
            alone_meta = attention_meta([len(s)])
            alone = model(PackedInputs(s, torch.arange(len(s)), alone_meta))  # [n_i, hidden]
            if pooling:
                alone = pool(alone, alone_meta, pooling)[0]  # [hidden]
            diff = (alone - in_batch[i]).abs().max().item()
            assert diff <= atol, f"sequence {i} ({len(s)} tokens) differs by {diff} alone and in the batch"


# --- random references --------------------------------------------------------------------------


def _is_norm(module: torch.nn.Module) -> bool:
    # transformers' RMSNorms (LlamaRMSNorm, Qwen3RMSNorm...) are their own classes, not torch's.
    return isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)) or type(module).__name__.endswith("RMSNorm")


def randomize_norms(model: torch.nn.Module, std: float, *, all_biases: bool = False) -> None:
    """Draw norm weights from N(1, std²) and norm biases from N(0, std²), and with `all_biases`
    every other bias too, so a swapped weight and bias, a skipped norm or a dropped bias cannot pass.

    Draws from torch's global generator in module order: a test that seeds it before building the
    model gets the same values every run."""
    with torch.no_grad():
        for module in model.modules():
            is_norm = _is_norm(module)
            for name, param in module.named_parameters(recurse=False):
                if is_norm and name == "weight":
                    param.normal_(1.0, std)
                elif name == "bias" and (is_norm or all_biases):
                    param.normal_(0.0, std)


def randomize_parameters(model: torch.nn.Module, seed: int = 0) -> None:
    """Fill every parameter from a generator seeded with `seed`: unit-variance activations (so
    attention is sharp enough that windows and positions matter), and norm weights and biases away
    from 1 and 0, so a swapped or skipped tensor cannot pass."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                module.weight.copy_(torch.randn(module.weight.shape, generator=g))
            elif isinstance(module, torch.nn.Linear):
                module.weight.copy_(torch.randn(module.weight.shape, generator=g) * module.in_features**-0.5)
            elif isinstance(module, torch.nn.LayerNorm):
                module.weight.copy_(1.0 + 0.1 * torch.randn(module.weight.shape, generator=g))
            if isinstance(module, (torch.nn.Linear, torch.nn.LayerNorm)) and module.bias is not None:
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=g))


def random_eager_reference(model_class: type[torch.nn.Module], config) -> torch.nn.Module:
    """`model_class(config)` in eval mode with every parameter from `randomize_parameters` and eager
    attention (explicit softmax over an additive mask): a different kernel from the packed SDPA path
    shoal takes on CPU."""
    with no_init_weights():  # transformers' truncated-normal init is slow on CPU, and is overwritten
        reference = model_class(config).eval()
    reference.set_attn_implementation("eager")
    randomize_parameters(reference)
    return reference
