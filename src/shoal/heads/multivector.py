"""The late-interaction (ColBERT) head: a linear projection of every kept token's state.

It also shapes the tokenizers: queries get a marker after [CLS] and [MASK] augmentation up to the
query length (tokens that read the query but, unless the card says otherwise, are read by none:
`Encoded.num_keys`) or a text suffix (colpali-engine's ten `<end_of_utterance>`, attended to),
documents a marker of their own and the checkpoint's document length (`tokenizers`).
"""

from __future__ import annotations

import string

import numpy as np
import torch

from ..weights import load_tensors


class ColbertHead:
    output = "multivector"

    def __init__(self, spec, weight, bias, punctuation_ids, query_tokenizer, document_tokenizer) -> None:
        self.spec = spec
        self.weight, self.bias = weight, bias  # [dim, h], [dim] | None
        self.punctuation_ids = punctuation_ids  # [p]
        self.query_tokenizer, self.document_tokenizer = query_tokenizer, document_tokenizer

    @classmethod
    def build(cls, ctx) -> ColbertHead:
        mv, base = ctx.card.multivector, ctx.tokenizer
        t = load_tensors(ctx.directory, [n for n in (mv.weight, mv.bias) if n], mv.file)
        query, document = base, base
        if mv.query_marker or mv.query_length or mv.query_suffix:
            length = min(mv.query_length or base.max_length, base.max_length)
            query = base.variant(
                length,
                marker=mv.query_marker,
                expand_to=mv.query_length,
                expand_token=mv.mask_token if mv.query_length else None,
                attend_to_expansion=mv.attend_to_expansion_tokens,
                text_suffix=mv.query_suffix or "",
            )
        if mv.document_marker or mv.document_length:
            length = min(mv.document_length or base.max_length, base.max_length)
            document = base.variant(length, marker=mv.document_marker)
        punctuation = torch.tensor(base.token_ids(string.punctuation), device=ctx.to["device"])
        return cls(
            mv, t[mv.weight].to(**ctx.to), t[mv.bias].to(**ctx.to) if mv.bias else None, punctuation, query, document
        )

    def tokenizers(self):
        """(query tokenizer, document tokenizer) this head needs."""
        return self.query_tokenizer, self.document_tokenizer

    def run(self, hidden, specs) -> list[np.ndarray | None]:
        mv, input_ids, meta = self.spec, hidden.input_ids, hidden.meta
        vectors = torch.nn.functional.linear(hidden.states, self.weight, self.bias)  # [T, dim]
        if mv.normalize:
            vectors = torch.nn.functional.normalize(vectors.float(), dim=-1)
        keep = torch.ones_like(input_ids, dtype=torch.bool)  # [T]
        if mv.skip_first:
            keep &= meta.pos_in_seq > 0
        if mv.skip_punctuation:
            is_document = torch.tensor([not s.is_query for s in specs], device=input_ids.device)[meta.seq_index]
            keep &= ~(is_document & torch.isin(input_ids, self.punctuation_ids))
        rows, kept = vectors.float().cpu().numpy(), keep.cpu().numpy()
        bounds = meta.cu_seqlens.tolist()
        return [
            rows[a:b][kept[a:b]] if "multivector" in s.outputs else None
            for a, b, s in zip(bounds[:-1], bounds[1:], specs)
        ]
