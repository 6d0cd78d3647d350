"""DeBERTa-v2 and DeBERTa-v3 (the backbone GLiNER uses), serve-only and padding-free.

Post-LayerNorm encoder with disentangled attention: besides content-to-content scores, each query
reads the embedding of its relative distance to each key (content-to-position, "c2p") and each
key reads the embedding of the distance the other way (position-to-content, "p2c"). Distances are
log-bucketed beyond `position_buckets // 2` (DeBERTa-v3). DeBERTa-v3 adds no absolute positions
(`position_biased_input: false`).

Every tensor outside attention is packed `[T, hidden]`. The relative-position terms depend on q, k
and the position embeddings jointly: `DisentangledBias` computes them as a per-sequence score bias
`[ng, H, Lg, Lg]` for each length group the attention seam (layers/attention.py) hands it, from the
group's padded q and k; the seam adds the content scores and runs the kernel. The distance indices
are built once per forward for positions 0..L-1; each group reads their `[Lg, Lg]` corner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from ..layers import AttentionMeta, FusedLinear, PackedInputs, activation, in_row_blocks, varlen_attention
from ..layers.attention import LengthGroup


@dataclass(frozen=True)
class DebertaV2Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    hidden_act: str = "gelu"
    type_vocab_size: int = 0
    layer_norm_eps: float = 1e-7
    embedding_size: int | None = None  # None: same as hidden_size (no embed_proj)
    attention_head_size: int | None = None  # None: hidden_size // num_attention_heads
    position_biased_input: bool = True  # absolute position embeddings added to the input
    relative_attention: bool = False
    pos_att_type: tuple[str, ...] = ()  # subset of ("c2p", "p2c")
    share_att_key: bool = False  # position projections reuse query_proj / key_proj
    max_relative_positions: int = 512  # already resolved: -1 in config.json means max_position_embeddings
    position_buckets: int | None = None  # None: no log-bucketing
    norm_rel_ebd: tuple[str, ...] = ()  # ("layer_norm",) in DeBERTa-v3
    conv_kernel_size: int = 0  # > 0: a convolution branch after the first layer (DeBERTa-v2 xlarge)
    conv_groups: int = 1
    conv_act: str = "tanh"

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> DebertaV2Config:
        names = cls.__dataclass_fields__
        kw = {k: v for k, v in cfg.items() if k in names}
        pos_att_type = cfg.get("pos_att_type") or ()
        if isinstance(pos_att_type, str):  # legacy "c2p|p2c"
            pos_att_type = pos_att_type.split("|")
        kw["pos_att_type"] = tuple(t.strip().lower() for t in pos_att_type)
        unknown = set(kw["pos_att_type"]) - {"c2p", "p2c"}
        if unknown:
            raise ValueError(f"DeBERTa-v2 pos_att_type {sorted(unknown)} is not supported (known: c2p, p2c)")
        kw["norm_rel_ebd"] = tuple(t.strip() for t in str(cfg.get("norm_rel_ebd", "none")).lower().split("|"))
        if (cfg.get("max_relative_positions") or -1) < 1:
            kw["max_relative_positions"] = cfg.get("max_position_embeddings", 512)
        if (cfg.get("position_buckets") or -1) < 1:
            kw["position_buckets"] = None
        if kw.get("embedding_size") == cfg["hidden_size"]:
            kw["embedding_size"] = None
        kernel = kw.get("conv_kernel_size") or 0
        if kernel > 0 and kernel % 2 == 0:
            raise ValueError(f"DeBERTa-v2 conv_kernel_size={kernel}: only odd kernels keep the sequence length")
        return cls(**kw)

    @property
    def head_dim(self) -> int:
        return self.attention_head_size or self.hidden_size // self.num_attention_heads

    @property
    def position_span(self) -> int:
        """S: relative-position embeddings cover distances -S..S-1 (2S rows)."""
        return self.position_buckets or self.max_relative_positions


def relative_positions(L: int, cfg: DebertaV2Config, device: torch.device) -> torch.Tensor:
    """`[L, L]` long: the (bucketed) distance i - j from query position i to key position j."""
    pos = torch.arange(L, device=device)
    offset = pos[:, None] - pos[None, :]  # [L, L]
    if cfg.position_buckets is None:
        return offset
    # Distances within +-mid keep their own bucket; farther ones share buckets on a log scale that
    # reaches mid + (mid - 1) at max_relative_positions. Same float32 ops as the reference, so
    # ceil() lands on the same side at bucket boundaries.
    mid = cfg.position_buckets // 2
    far = offset.abs().clamp(min=mid)  # [L, L]; log() is only kept where |offset| > mid
    log_ratio = torch.log(torch.tensor((cfg.max_relative_positions - 1) / mid))
    log_bucket = torch.ceil(torch.log(far / mid) / log_ratio * (mid - 1)) + mid  # [L, L] float
    return torch.where(offset.abs() <= mid, offset, torch.sign(offset) * log_bucket.long())


# Length groups for disentangled attention: cut where a length passes 1.25x the group's shortest
# (and 16 tokens more); the default 2x pads a batch of 50..257-token texts to 1.7x its tokens.
DEBERTA_GROUPING = (1.25, 16)


@dataclass(frozen=True)
class RelativeIndex:
    """Rows of the position tables each (query i, key j) pair reads, for positions 0..L-1; built once
    per forward from the (bucketed) distances i - j and shared by all layers and length groups."""

    c2p: torch.Tensor  # [L(i), L(j)] long: row of distance i - j, for query i against key j
    p2c: torch.Tensor  # [L(j), L(i)] long: row of distance -(j - i), for key j against query i
    _windows: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, L: int, cfg: DebertaV2Config, device: torch.device) -> RelativeIndex:
        """Row r of a `[2S, ...]` position table holds distance r - S; farther distances are clamped."""
        rel, span = relative_positions(L, cfg, device), cfg.position_span  # [L, L], S
        return cls((rel + span).clamp(0, 2 * span - 1), (span - rel).clamp(0, 2 * span - 1))

    def window(self, L: int) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        """For sequences of at most L tokens: the rows [lo, hi) of the position tables they read
        (2L - 1 of the 2S, unless distances are bucketed or clamped) and the c2p / p2c indices into
        that slice. Scoring q against those rows only, not all 2S, is what keeps short sequences
        cheap: the reference scores every one (S = 256 for DeBERTa-v3) and then gathers."""
        if L not in self._windows:
            c2p, p2c = self.c2p[:L, :L], self.p2c[:L, :L]
            lo = int(torch.minimum(c2p.min(), p2c.min()))
            hi = int(torch.maximum(c2p.max(), p2c.max())) + 1
            self._windows[L] = (lo, hi, c2p - lo, p2c - lo)
        return self._windows[L]


@dataclass(frozen=True)
class DisentangledBias:
    """The relative-position terms of disentangled attention, a `ScoreBias` (layers/attention.py):
    softmax(q_i.k_j + q_i.pos_key[d(i-j)] + k_j.pos_query[-d(j-i)]) v within each sequence.

    d() is the (bucketed) distance; row r of the position tables holds distance r - S, and
    distances outside -S..S-1 are clamped. The scale is applied to all three terms. At least one of
    `pos_key`, `pos_query` is given.
    """

    pos_key: torch.Tensor | None  # [2S, H, D], keys of the relative-distance embeddings (c2p)
    pos_query: torch.Tensor | None  # [2S, H, D], queries of the relative-distance embeddings (p2c)
    index: RelativeIndex  # L >= the batch's longest sequence
    scale: float
    shared: ClassVar[bool] = False  # one bias per sequence: it reads each one's q and k
    # Three [L, L] score terms, a gather each: padding costs more here than more groups do.
    grouping: ClassVar[tuple[float, int]] = DEBERTA_GROUPING

    def for_group(self, g: LengthGroup, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The two position terms of one length group, summed: q, k `[ng, H, Lg, D]` (padded) ->
        `[ng, H, Lg, Lg]`, fresh (the seam sets its padding keys to -inf)."""
        n, H, L = g.num_seqs, q.shape[1], g.max_seqlen
        lo, hi, c2p_index, p2c_index = self.index.window(L)  # the R = hi - lo distance rows these lengths read
        bias = None
        if self.pos_key is not None:  # content -> position: query i against the embedding of distance i - j
            c2p = (q * self.scale) @ self.pos_key[lo:hi].permute(1, 2, 0)  # [ng, H, Lg, R]
            bias = c2p.gather(-1, c2p_index.expand(n, H, L, L))
        if self.pos_query is not None:  # position -> content: key j against the embedding of distance j - i, negated
            p2c = (k * self.scale) @ self.pos_query[lo:hi].permute(1, 2, 0)  # [ng, H, Lg(j), R]
            term = p2c.gather(-1, p2c_index.expand(n, H, L, L)).transpose(-1, -2)
            bias = term if bias is None else bias.add_(term)
        if bias is None:
            raise ValueError("DisentangledBias needs pos_key, pos_query or both")
        return bias


class DebertaV2Layer(nn.Module):
    def __init__(self, cfg: DebertaV2Config) -> None:
        super().__init__()
        h, inner = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.relative = cfg.relative_attention
        self.c2p, self.p2c = "c2p" in cfg.pos_att_type, "p2c" in cfg.pos_att_type
        self.share_att_key = cfg.share_att_key
        # Each relative term adds a score of the same magnitude, so scores shrink by sqrt(D * terms).
        self.scale = 1.0 / math.sqrt(cfg.head_dim * (1 + self.c2p + self.p2c))
        self.qkv = FusedLinear(h, (inner, inner, inner))
        if self.relative and not cfg.share_att_key:
            self.pos_key_proj = nn.Linear(h, inner) if self.c2p else None
            self.pos_query_proj = nn.Linear(h, inner) if self.p2c else None
        self.attn_out = nn.Linear(inner, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.ffn_in = nn.Linear(h, cfg.intermediate_size)
        self.ffn_out = nn.Linear(cfg.intermediate_size, h)
        self.ffn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.act = activation(cfg.hidden_act)

    def position_projections(self, rel_emb: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Relative-distance embeddings `[2S, hidden]` -> (pos_key, pos_query), each `[2S, H, D]` or None."""
        S2 = rel_emb.shape[0]
        pos_key: torch.Tensor | None
        pos_query: torch.Tensor | None
        if self.share_att_key:
            pos_query, pos_key, _ = self.qkv.split(rel_emb)
        else:  # each projection exists when its term is on
            pos_key = pos_query = None
            if self.c2p:
                assert self.pos_key_proj is not None
                pos_key = self.pos_key_proj(rel_emb)
            if self.p2c:
                assert self.pos_query_proj is not None
                pos_query = self.pos_query_proj(rel_emb)
        if self.c2p:
            assert pos_key is not None
            pos_key = pos_key.view(S2, self.num_heads, self.head_dim)
        else:
            pos_key = None
        if self.p2c:
            assert pos_query is not None
            pos_query = pos_query.view(S2, self.num_heads, self.head_dim)
        else:
            pos_query = None
        return pos_key, pos_query

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        meta: AttentionMeta,
        index: RelativeIndex | None,  # None without relative attention
        rel_emb: torch.Tensor | None,  # [2S, hidden] normalised distance embeddings
    ) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = (t.view(T, self.num_heads, self.head_dim) for t in self.qkv.split(x))  # [T, H, D] each
        bias = None
        if index is not None and rel_emb is not None and (self.c2p or self.p2c):  # relative attention
            bias = DisentangledBias(*self.position_projections(rel_emb), index, self.scale)
        a = varlen_attention(q, k, v, meta, scale=self.scale, bias=bias)  # [T, H, D]
        x = self.attn_norm(x + self.attn_out(a.reshape(T, -1)))  # [T, hidden]
        return in_row_blocks(self.feed_forward, x, self.ffn_in.out_features, meta.row_block_bytes)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The FFN and its residual and norm, per token: `[t, hidden]` -> `[t, hidden]`."""
        return self.ffn_norm(x + self.ffn_out(self.act(self.ffn_in(x))))


_L = r"encoder\.layer\.(\d+)\."


class DebertaV2Model(nn.Module):
    # Not captured as a CUDA graph (engine/graphs.py): its position window is read back to the host
    # the first time each length is seen.
    graphable = False
    config_class = DebertaV2Config
    checkpoint_prefixes = ("deberta.",)
    # Checkpoint tensor name (after "deberta." is stripped) -> (our parameter name, shard or None).
    weight_map = [
        (r"embeddings\.word_embeddings\.weight", "word_embeddings.weight", None),
        (r"embeddings\.position_embeddings\.weight", "position_embeddings.weight", None),
        (r"embeddings\.token_type_embeddings\.weight", "token_type_embeddings.weight", None),
        (r"embeddings\.embed_proj\.weight", "embed_proj.weight", None),
        (r"embeddings\.LayerNorm\.(weight|bias)", r"embed_norm.\1", None),
        (r"encoder\.rel_embeddings\.weight", "rel_embeddings.weight", None),
        (r"encoder\.LayerNorm\.(weight|bias)", r"rel_norm.\1", None),
        (r"encoder\.conv\.conv\.(weight|bias)", r"conv.\1", None),
        (r"encoder\.conv\.LayerNorm\.(weight|bias)", r"conv_norm.\1", None),
        (_L + r"attention\.self\.query_proj\.(weight|bias)", r"layers.\1.qkv.\2", 0),
        (_L + r"attention\.self\.key_proj\.(weight|bias)", r"layers.\1.qkv.\2", 1),
        (_L + r"attention\.self\.value_proj\.(weight|bias)", r"layers.\1.qkv.\2", 2),
        (_L + r"attention\.self\.pos_key_proj\.(weight|bias)", r"layers.\1.pos_key_proj.\2", None),
        (_L + r"attention\.self\.pos_query_proj\.(weight|bias)", r"layers.\1.pos_query_proj.\2", None),
        (_L + r"attention\.output\.dense\.(weight|bias)", r"layers.\1.attn_out.\2", None),
        (_L + r"attention\.output\.LayerNorm\.(weight|bias)", r"layers.\1.attn_norm.\2", None),
        (_L + r"intermediate\.dense\.(weight|bias)", r"layers.\1.ffn_in.\2", None),
        (_L + r"output\.dense\.(weight|bias)", r"layers.\1.ffn_out.\2", None),
        (_L + r"output\.LayerNorm\.(weight|bias)", r"layers.\1.ffn_norm.\2", None),
    ]
    # Task heads and the MLM / replaced-token-detection heads a serve-only encoder does not use.
    ignored_weights = [
        r"lm_predictions\..*",
        r"mask_predictions\..*",
        r"cls\..*",
        r"pooler\..*",
        r"classifier\..*",
        r"qa_outputs\..*",
        r".*position_ids",
    ]

    @staticmethod
    def classifier_layout(config: dict) -> tuple[str, list[tuple]]:
        """DebertaV2ForSequenceClassification: ContextPooler (dense + pooler_hidden_act on [CLS]),
        then the classifier."""
        return "cls", [
            ("linear", "pooler.dense"),
            ("act", config.get("pooler_hidden_act", "gelu")),
            ("linear", "classifier"),
        ]

    def shared_linears(self) -> tuple[str, ...]:
        """Linears that also project the relative-position table, which all sequences of a batch
        share: a per-sequence LoRA adapter cannot target them (engine/lora.py refuses one that does)."""
        if not self.config.relative_attention:
            return ()
        names = ("qkv",) if self.config.share_att_key else ("pos_key_proj", "pos_query_proj")
        return tuple(f"layers.{i}.{name}" for i in range(len(self.layers)) for name in names)

    def __init__(self, cfg: DebertaV2Config) -> None:
        super().__init__()
        h, e = cfg.hidden_size, cfg.embedding_size or cfg.hidden_size
        self.config = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, e)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, e) if cfg.position_biased_input else None
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, e) if cfg.type_vocab_size > 0 else None
        self.embed_proj = nn.Linear(e, h, bias=False) if cfg.embedding_size else None
        self.embed_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        if cfg.relative_attention:
            self.rel_embeddings = nn.Embedding(2 * cfg.position_span, h)
            self.rel_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps) if "layer_norm" in cfg.norm_rel_ebd else None
        if cfg.conv_kernel_size > 0:
            k = cfg.conv_kernel_size
            self.conv = nn.Conv1d(h, h, k, padding=(k - 1) // 2, groups=cfg.conv_groups)
            self.conv_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
            self.conv_act = torch.tanh if cfg.conv_act == "tanh" else activation(cfg.conv_act)
        self.layers = nn.ModuleList(DebertaV2Layer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, inputs: PackedInputs) -> torch.Tensor:
        cfg, meta = self.config, inputs.meta
        x = self.word_embeddings(inputs.input_ids)  # [T, embedding_size]
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(inputs.position_ids)
        if self.token_type_embeddings is not None and inputs.token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        elif self.token_type_embeddings is not None:
            x = x + self.token_type_embeddings(inputs.token_type_ids)
        if self.embed_proj is not None:
            x = self.embed_proj(x)  # [T, hidden]
        # The reference then multiplies by the padding mask: a no-op here, every packed token is real.
        x = self.embed_norm(x)

        index = rel_emb = None
        if cfg.relative_attention:  # shared by all layers: table rows per position pair, and the tables
            index = RelativeIndex.build(meta.max_seqlen, cfg, x.device)
            rel_emb = self.rel_embeddings.weight  # [2S, hidden]
            if self.rel_norm is not None:
                rel_emb = self.rel_norm(rel_emb)

        embedded = x
        for i, layer in enumerate(self.layers):
            x = layer(x, meta, index, rel_emb)
            if i == 0 and cfg.conv_kernel_size > 0:
                x = self.conv_branch(embedded, x, meta)
        return x  # [T, hidden]

    def conv_branch(self, embedded: torch.Tensor, x: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        """DeBERTa-v2's ConvLayer: a 1-D convolution over each sequence's embeddings, added after layer 0."""
        padded = meta.pad(embedded).transpose(1, 2)  # [n, hidden, L], zeros past each sequence's end
        conv = meta.unpad(self.conv(padded).transpose(1, 2))  # [T, hidden]
        return self.conv_norm(x + self.conv_act(conv))
