"""GLiREL's relation head (`rel_mode` marker), over the packed backbone output.

One sequence is `[CLS] [REL] type ... [REL] type [SEP] word ... word [SEP]`, tokenized word by
word. From the backbone's token states (projected to GLiREL's hidden size when they differ), each
word reads its first (or last) token, a word the tokenizer drops reads zeros:

    types     each type's [REL] state, its label word's state, or their mean
              (`label_embed_strategy` ent_token, label, both), through `prompt_rep_layer`
              (Linear 4H, ReLU, Linear H)                                         -> t   [C, H]
    words     the text's words through a bidirectional LSTM                       -> h   [W, H]
    entities  the given spans (first word s, last word e): markerv1
              out_project(relu([start(h_s), end(h_e)])), markerv2 projection(mean h_s..h_e),
              each a two-layer ReLU MLP                                           -> e   [n, H]
    pairs     out_project([e_head, e_tail]) for each (head, tail) pair            -> r   [P, H]
    logits    scorer(r, t): dot r . t; dot_thresh (r . proj_type(t) + beta) * softplus(alpha),
              alpha and beta from proj_thresh(t); dot_norm r . t + bias + dy_bias_type(t) +
              dy_bias_rel(r); concat_proj proj([r * t, r - t, r, t])              -> [P, C]

The first layer of the pair out_project acts on the head's and the tail's halves separately, so it
runs once per entity, not per pair. The entity, type and pair-half MLPs run once a batch, over all
its sequences' rows: with a few entities a text, reading their weights costs more than the rows.
`run` returns, per sequence, the sigmoid scores `[P, C]` (float32 numpy) of the spec's pairs and
types.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_sequence, pad_packed_sequence

from ..errors import ModelLoadError
from ..head_info import GlirelPrompt
from ..weights import load_tensors

CONFIG_FILE = "glirel_config.json"
BACKBONE_PREFIX = "token_rep_layer.bert_layer.model."
REL_TOKEN, SEP_TOKEN = "[REL]", "[SEP]"
# What the glirel package adds to the backbone's tokenizer: [FLERT] (special, when missing), then these.
ADDED_TOKENS = (REL_TOKEN, SEP_TOKEN, "[E]", "[/E]")
SCORERS = ("dot", "dot_thresh", "dot_norm", "concat_proj")
_REP = "span_rep_layer.rel_rep_layer."
# Pairs scored at once: the pair layer's hidden state is [pairs, 4H].
PAIR_CHUNK = 4096


def read_glirel_config(directory: Path) -> dict[str, Any]:
    try:
        return json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{directory}/{CONFIG_FILE}: {exc}", details={"file": CONFIG_FILE}) from None


def check_glirel_config(config: dict[str, Any], where: str) -> None:
    """Refuse, naming the field, the GLiREL variants this head does not implement."""

    def refuse(field: str, value: Any, supported: str) -> None:
        raise ModelLoadError(
            f"{where}: GLiREL {field}={value!r} is not implemented (shoal serves {supported})",
            details={"file": CONFIG_FILE, "field": field},
        )

    choices = {
        "rel_mode": ("marker",),
        "span_marker_mode": ("markerv1", "markerv2"),
        "subtoken_pooling": ("first", "last"),
        "label_embed_strategy": ("ent_token", "label", "both"),
        "scorer": SCORERS,
    }
    defaults = {"label_embed_strategy": "ent_token", "scorer": "dot"}
    for field, allowed in choices.items():
        value = config.get(field, defaults.get(field))
        if value not in allowed:
            refuse(field, value, " or ".join(allowed))
    for field in ("refine_relation", "refine_prompt", "add_entity_markers"):
        if config.get(field):
            refuse(field, config[field], f"models without {field}")


def _mlp_names(name: str) -> list[str]:
    return [f"{name}.{i}.{kind}" for i in (0, 3) for kind in ("weight", "bias")]


class _Mlp:
    """create_projection_layer and the scorer's MLPs: Linear, ReLU, (dropout), Linear at `.0`, `.3`."""

    def __init__(self, t: dict[str, torch.Tensor], name: str) -> None:
        self.w1, self.b1 = t[f"{name}.0.weight"], t[f"{name}.0.bias"]
        self.w2, self.b2 = t[f"{name}.3.weight"], t[f"{name}.3.bias"]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.relu(F.linear(x, self.w1, self.b1)), self.w2, self.b2)


def _scorer_names(scorer: str) -> list[str]:
    parts = {"dot": [], "dot_thresh": ["proj_thresh", "proj_type"], "dot_norm": ["dy_bias_type", "dy_bias_rel"]}
    names = [n for part in parts.get(scorer, ["proj"]) for n in _mlp_names(f"scorer.{part}")]
    return names + (["scorer.bias"] if scorer == "dot_norm" else [])


class GlirelHead:
    output = "relations"

    def __init__(self, config: dict[str, Any], t: dict[str, torch.Tensor], lstm: nn.LSTM) -> None:
        self.config = config
        self.strategy = config.get("label_embed_strategy", "ent_token")
        self.scorer = config.get("scorer", "dot")
        self.markerv1 = config["span_marker_mode"] == "markerv1"
        self.projection = (
            (t["token_rep_layer.projection.weight"], t["token_rep_layer.projection.bias"])
            if "token_rep_layer.projection.weight" in t
            else None
        )
        self.lstm = lstm
        self.prompt = _Mlp(t, "prompt_rep_layer")
        marker = _REP + "span_marker."
        if self.markerv1:
            self.start, self.end = _Mlp(t, marker + "project_start"), _Mlp(t, marker + "project_end")
            self.entity_out = _Mlp(t, marker + "out_project")
        else:
            self.entity_out = _Mlp(t, marker + "projection")
        pair = _Mlp(t, _REP + "out_project")
        h = pair.w1.shape[1] // 2
        self.pair_head, self.pair_tail, self.pair = pair.w1[:, :h], pair.w1[:, h:], pair  # [4H, H] each
        self.t = t

    def describe(self) -> GlirelPrompt:
        distance = self.config.get("max_entity_pair_distance")
        return GlirelPrompt(
            REL_TOKEN,
            SEP_TOKEN,
            max_words=int(self.config.get("max_len", 384)),
            max_pair_distance=None if distance is None else int(distance),
            last_subtoken=self.config.get("subtoken_pooling", "first") == "last",
        )

    @classmethod
    def build(cls, ctx) -> GlirelHead:
        config = read_glirel_config(ctx.directory)
        check_glirel_config(config, str(ctx.directory))
        marker = _REP + "span_marker."
        names = _mlp_names("prompt_rep_layer") + _mlp_names(_REP + "out_project")
        if config["span_marker_mode"] == "markerv1":
            names += [n for part in ("project_start", "project_end", "out_project") for n in _mlp_names(marker + part)]
        else:
            names += _mlp_names(marker + "projection")
        names += _scorer_names(config.get("scorer", "dot"))
        lstm_names = [
            f"rnn.lstm.{kind}_l0{rev}"
            for rev in ("", "_reverse")
            for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
        ]
        t = load_tensors(ctx.directory, names + lstm_names, prefixes=())
        try:
            projection = ["token_rep_layer.projection.weight", "token_rep_layer.projection.bias"]
            t.update(load_tensors(ctx.directory, projection, prefixes=()))
        except ModelLoadError:  # the backbone's hidden size is GLiREL's: no projection
            pass
        h = int(config["hidden_size"])
        lstm = nn.LSTM(h, h // 2, num_layers=1, bidirectional=True, batch_first=True)
        try:
            lstm.load_state_dict({name.removeprefix("rnn.lstm."): t.pop(name) for name in lstm_names})
        except RuntimeError as exc:
            raise ModelLoadError(
                f"{ctx.directory}: the checkpoint's LSTM does not fit hidden_size {h}: {exc}",
                details={"file": CONFIG_FILE},
            ) from None
        lstm = lstm.to(**ctx.to).eval().requires_grad_(False)
        return cls(config, {k: v.to(**ctx.to) for k, v in t.items()}, lstm)

    def run(self, hidden, specs) -> list:
        mine = [i for i, s in enumerate(specs) if "relations" in s.outputs]
        out: list = [None] * len(specs)
        if not mine:
            return out
        states = hidden.states
        if self.projection is not None:
            states = F.linear(states, *self.projection)
        starts = hidden.meta.cu_seqlens[:-1].long().tolist()
        words, types = [], []
        for i in mine:
            spec = specs[i]
            words.append(_read(states, starts[i], spec.word_tokens))  # [W, H]
            rel, label = (_read(states, starts[i], spec.label_tokens[:, j]) for j in (0, 1))  # [C, H] each
            types.append({"ent_token": rel, "label": label, "both": (rel + label) / 2}[self.strategy])
        packed, _ = self.lstm(pack_sequence(words, enforce_sorted=False))
        padded, _ = pad_packed_sequence(packed, batch_first=True)  # [n, W, H]
        # The batch's entities, pairs and types at once (the module docstring says why).
        spans = [specs[i].entity_spans for i in mine]
        entities = self._entities(padded, spans)  # [sum n, H]
        offsets = np.cumsum([0] + [len(s) for s in spans[:-1]])
        pairs = np.concatenate([specs[i].pairs + at for i, at in zip(mine, offsets)])  # [sum P, 2]
        sizes = [(len(specs[i].pairs), len(t)) for i, t in zip(mine, types)]
        scores = self._score(entities, torch.from_numpy(pairs).to(states.device), self.prompt(torch.cat(types)), sizes)
        for i, logits in zip(mine, scores):
            out[i] = torch.sigmoid(logits.float()).cpu().numpy()
        return out

    def _entities(self, padded: torch.Tensor, spans: list[np.ndarray]) -> torch.Tensor:
        """Each given span `(first word, last word)` of each sequence's words `[n, W, H]` as one
        vector, the sequences' entities in a row `[sum n, H]`."""
        seq = torch.from_numpy(np.repeat(np.arange(len(spans)), [len(s) for s in spans])).to(padded.device)
        s, e = (torch.from_numpy(np.concatenate([sp[:, k] for sp in spans])).to(padded.device) for k in (0, 1))
        if self.markerv1:
            return self.entity_out(torch.cat([self.start(padded[seq, s]), self.end(padded[seq, e])], dim=-1).relu())
        sums = torch.cat([torch.zeros_like(padded[:, :1]), padded.cumsum(1)], dim=1)  # [n, W + 1, H]
        return self.entity_out((sums[seq, e + 1] - sums[seq, s]) / (e - s + 1)[:, None].to(padded.dtype))

    def _score(
        self, entities: torch.Tensor, pairs: torch.Tensor, types: torch.Tensor, sizes: list[tuple[int, int]]
    ) -> list[torch.Tensor]:
        """Per sequence, logits `[P, C]` of its (head, tail) pairs of entity indices `[sum P, 2]` for
        its types `[sum C, H]`; `sizes` holds each sequence's (P, C)."""
        head, tail = F.linear(entities, self.pair_head), F.linear(entities, self.pair_tail)  # [sum n, 4H] each
        t = self.t
        if self.scorer == "dot_thresh":
            scale = _Mlp(t, "scorer.proj_thresh")(types)  # [sum C, 2]
            alpha, beta = F.softplus(scale[:, 0]), scale[:, 1]
            types = _Mlp(t, "scorer.proj_type")(types)
        bias_type = _Mlp(t, "scorer.dy_bias_type")(types)[:, 0] if self.scorer == "dot_norm" else None  # [sum C]
        out, p0, c0 = [], 0, 0
        for num_pairs, num_types in sizes:
            tt, c = types[c0 : c0 + num_types], slice(c0, c0 + num_types)
            scores = []
            for lo in range(p0, p0 + num_pairs, PAIR_CHUNK):
                p = pairs[lo : min(lo + PAIR_CHUNK, p0 + num_pairs)]
                hidden = F.relu(head[p[:, 0]] + tail[p[:, 1]] + self.pair.b1)  # [p, 4H]
                r = F.linear(hidden, self.pair.w2, self.pair.b2)  # [p, H]
                if self.scorer == "concat_proj":
                    rr, tx = r[:, None, :].expand(-1, num_types, -1), tt[None].expand(len(r), -1, -1)
                    scores.append(_Mlp(t, "scorer.proj")(torch.cat([rr * tx, rr - tx, rr, tx], dim=-1)).squeeze(-1))
                    continue
                score = r @ tt.T  # [p, C]
                if self.scorer == "dot_thresh":
                    score = (score + beta[c]) * alpha[c]
                elif self.scorer == "dot_norm":
                    assert bias_type is not None
                    score = (
                        score + t["scorer.bias"] + bias_type[c] + _Mlp(t, "scorer.dy_bias_rel")(r)
                    )  # [p, 1] broadcast
                scores.append(score)
            out.append(torch.cat(scores) if scores else torch.zeros((0, num_types), device=types.device))
            p0, c0 = p0 + num_pairs, c0 + num_types
        return out


def _read(states: torch.Tensor, at: int, positions: np.ndarray) -> torch.Tensor:
    """The states at `positions` of the sequence starting at `at`; zeros where a position is -1 (a
    word the tokenizer drops, as the package fills it)."""
    index = torch.from_numpy(positions).to(states.device)
    picked = states[at + index.clamp(min=0)]
    return picked.masked_fill((index < 0)[:, None], 0.0)
