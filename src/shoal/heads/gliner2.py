"""GLiNER2's span-architecture heads (fastino's `gliner2` package, `architecture: span`), over the
packed backbone output.

One sequence is a schema prompt per task, then the text (no [CLS] or [SEP]):

    ( [P] entities ( [E] person [E] city ) ) [SEP_STRUCT] ( [P] sentiment ( [L] pos [L] neg ) ) [SEP_TEXT] w1 w2 ...

From the backbone's token states, each task reads its markers' states ([P] first, then one per
field: [E] entity types, [L] classification labels) and the text reads each word's first token:

    span tasks       count   = argmax count_pred([P])  (0: the task finds nothing)
                     queries = count_embed(fields, count)                       -> [count, M, H]
                     (entities read instance 0 only; relations every instance, fields [R] head, [R] tail)
                     spans   = markerV0 over the words, as GLiNER's: for start i and width k < K,
                               out_project(relu([start(h_i), end(h_i+k)]))
                     logits  = span . query                                    -> [M, W, K]
    classification   logits  = classifier(label markers)                       -> [C]

count_embed is a GRU unrolled `count` steps from each field's state over learned step embeddings,
then a projector (count_lstm: an MLP of [step, field]; count_lstm_v2: a two-layer transformer
across the fields of each step; count_lstm_moe: a gated mixture of four FFNs). As in the GLiNER
head the out_project layer folds into per-word and per-query parts, so the `[W, K, H]` span
tensor is never built.

Words are the prefix words (a structure's choices, `spec.prefix` of them, before the text) then
the window's text words. `run` returns, per sequence, a tuple with one entry per task of the spec's
`tasks`: for entities the candidates starting in the window's owned words whose sigmoid score
reaches the threshold as numpy arrays (start, width, field, score); for relations each instance's
best span per field over the whole window's text as arrays `[count, M]` (start, width, score, the
score -1 where no span reaches the threshold); for structures every span of the text reaching its
field's threshold (instance, field, start, width, score) and each prefix word's one-word score
`[count, M, P]`; for classifications the label logits `[C]` (float32). Positions are the window's
text words.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelLoadError
from ..head_info import Gliner2Prompt
from ..weights import load_tensors

CONFIG_FILE = "config.json"
BACKBONE_PREFIX = "encoder."
COUNTING_LAYERS = ("count_lstm", "count_lstm_v2", "count_lstm_moe")
MAX_COUNT = 20  # count_pred's classes and count_embed's step embeddings


def read_gliner2_config(directory: Path) -> dict[str, Any]:
    try:
        return json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{directory}/{CONFIG_FILE}: {exc}", details={"file": CONFIG_FILE}) from None


def check_gliner2_config(config: dict[str, Any], where: str) -> None:
    """Refuse, naming the field, what this head does not implement."""

    def refuse(field: str, value: Any, supported: str) -> None:
        raise ModelLoadError(
            f"{where}: GLiNER2 {field}={value!r} is not implemented (shoal serves {supported})",
            details={"file": CONFIG_FILE, "field": field},
        )

    if config.get("model_type", "extractor") != "extractor":
        refuse("model_type", config.get("model_type"), "GLiNER2 extractor checkpoints")
    if config.get("architecture", "span") != "span":
        refuse("architecture", config["architecture"], "the span architecture of the published checkpoints")
    span_mode = (config.get("span_head") or {}).get("span_mode", "markerV0")
    if span_mode != "markerV0":
        refuse("span_head.span_mode", span_mode, "markerV0")
    if config.get("token_pooling", "first") != "first":
        refuse("token_pooling", config["token_pooling"], "first-subtoken pooling")
    counting = config.get("counting_layer", "count_lstm")
    if counting not in COUNTING_LAYERS:
        refuse("counting_layer", counting, ", ".join(COUNTING_LAYERS))


def max_width_of(config: dict[str, Any]) -> int:
    return int((config.get("span_head") or {}).get("max_width", config.get("max_width") or 8))


def _mlp(t: dict[str, torch.Tensor], name: str, layers: tuple[int, ...]):
    """create_mlp / create_projection_layer with dropout 0: Linear, ReLU, ..., Linear at `layers`."""
    weights = [(t[f"{name}.{i}.weight"], t[f"{name}.{i}.bias"]) for i in layers]

    def run(x: torch.Tensor) -> torch.Tensor:
        for j, (w, b) in enumerate(weights):
            x = F.linear(x, w, b)
            if j < len(weights) - 1:
                x = F.relu(x)
        return x

    return run


def _mlp_names(name: str, layers: tuple[int, ...]) -> list[str]:
    return [f"{name}.{i}.{kind}" for i in layers for kind in ("weight", "bias")]


class _CountEmbed:
    """count_embed: field states `[M, H]` -> count-aware queries `[n, M, H]` for `n` instances."""

    def __init__(self, kind: str, t: dict[str, torch.Tensor], transformer: nn.Module | None) -> None:
        self.kind = kind
        self.steps = t["count_embed.pos_embedding.weight"]  # [MAX_COUNT, H]
        self.w_ih, self.w_hh = t["count_embed.gru.weight_ih_l0"], t["count_embed.gru.weight_hh_l0"]
        self.b_ih, self.b_hh = t["count_embed.gru.bias_ih_l0"], t["count_embed.gru.bias_hh_l0"]
        self.t = t
        if kind == "count_lstm":
            self.projector = _mlp(t, "count_embed.projector", (0, 2))
        elif kind == "count_lstm_v2":
            assert transformer is not None
            self.transformer = transformer
            self.in_projector = (
                t["count_embed.transformer.in_projector.weight"],
                t["count_embed.transformer.in_projector.bias"],
            )
            self.out_projector = _mlp(t, "count_embed.transformer.out_projector", (0, 2, 4))
        else:
            self.router = [(t[f"count_embed.router.{i}.weight"], t[f"count_embed.router.{i}.bias"]) for i in (0, 2)]

    @staticmethod
    def names(kind: str, transformer_keys: list[str]) -> list[str]:
        names = ["count_embed.pos_embedding.weight"] + [
            f"count_embed.gru.{kind}_l0" for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
        ]
        if kind == "count_lstm":
            return names + _mlp_names("count_embed.projector", (0, 2))
        if kind == "count_lstm_v2":
            return (
                names
                + ["count_embed.transformer.in_projector.weight", "count_embed.transformer.in_projector.bias"]
                + _mlp_names("count_embed.transformer.out_projector", (0, 2, 4))
                + ["count_embed.transformer.transformer." + k for k in transformer_keys]
            )
        return names + _mlp_names("count_embed.router", (0, 2)) + [f"count_embed.{p}" for p in ("w1", "b1", "w2", "b2")]

    def __call__(self, fields: torch.Tensor, count: int) -> torch.Tensor:
        count = min(count, MAX_COUNT)
        x = F.linear(self.steps[:count], self.w_ih, self.b_ih)  # [n, 3H]: the input side of every step
        h, out = fields, []
        for step in range(count):  # a GRU cell per step, the fields as its batch
            i_r, i_z, i_n = x[step].chunk(3, dim=-1)
            h_r, h_z, h_n = F.linear(h, self.w_hh, self.b_hh).chunk(3, dim=-1)
            r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
            h = (1 - z) * torch.tanh(i_n + r * h_n) + z * h
            out.append(h)
        steps = torch.stack(out)  # [n, M, H]
        if self.kind == "count_lstm":
            return self.projector(torch.cat([steps, fields.expand_as(steps)], dim=-1))
        if self.kind == "count_lstm_v2":
            x = steps + fields
            y = self.transformer(F.linear(x, *self.in_projector))  # attention across the fields of a step
            return self.out_projector(torch.cat([y, x], dim=-1))
        (w1, b1), (w2, b2) = self.router
        gates = torch.softmax(F.linear(F.gelu(F.linear(steps, w1, b1)), w2, b2), dim=-1)  # [n, M, E]
        t = self.t
        inner = F.gelu(torch.einsum("lmd,edh->lmeh", steps, t["count_embed.w1"]) + t["count_embed.b1"])
        experts = torch.einsum("lmeh,ehd->lmed", inner, t["count_embed.w2"]) + t["count_embed.b2"]  # [n, M, E, H]
        return (gates.unsqueeze(-1) * experts).sum(dim=2)


def _count_transformer() -> nn.TransformerEncoder:
    """count_lstm_v2's transformer: 2 post-norm layers of width 128, 4 heads, FFN 256, ReLU."""
    layer = nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=256, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


class Gliner2Head:
    output = "gliner2"

    def __init__(self, config: dict[str, Any], t: dict[str, torch.Tensor], count_embed: _CountEmbed) -> None:
        self.max_width = max_width_of(config)
        self.hidden_size = t["span_rep.span_rep_layer.project_start.0.weight"].shape[1]
        h = self.hidden_size
        span = "span_rep.span_rep_layer."
        self.start = _mlp(t, span + "project_start", (0, 3))
        self.end = _mlp(t, span + "project_end", (0, 3))
        w1 = t[span + "out_project.0.weight"]  # [4H, 2H]
        self.out_start, self.out_end, self.out_b1 = w1[:, :h], w1[:, h:], t[span + "out_project.0.bias"]
        self.out_w2, self.out_b2 = t[span + "out_project.3.weight"], t[span + "out_project.3.bias"]
        self.classifier = _mlp(t, "classifier", (0, 2))
        self.count_pred = _mlp(t, "count_pred", (0, 2))
        self.count_embed = count_embed

    def describe(self) -> Gliner2Prompt:
        return Gliner2Prompt(self.max_width)

    @classmethod
    def build(cls, ctx) -> Gliner2Head:
        config = read_gliner2_config(ctx.directory)
        check_gliner2_config(config, str(ctx.directory))
        counting = config.get("counting_layer", "count_lstm")
        span = "span_rep.span_rep_layer."
        names = _mlp_names(span + "project_start", (0, 3)) + _mlp_names(span + "project_end", (0, 3))
        names += _mlp_names(span + "out_project", (0, 3))
        names += _mlp_names("classifier", (0, 2)) + _mlp_names("count_pred", (0, 2))
        transformer = _count_transformer() if counting == "count_lstm_v2" else None
        keys = list(transformer.state_dict()) if transformer is not None else []
        names += _CountEmbed.names(counting, keys)
        t = load_tensors(ctx.directory, names, prefixes=())
        t = {k: v.to(**ctx.to) for k, v in t.items()}
        if transformer is not None:
            prefix = "count_embed.transformer.transformer."
            transformer.load_state_dict({k: t.pop(prefix + k) for k in keys})
            transformer = transformer.to(**ctx.to).eval().requires_grad_(False)
        return cls(config, t, _CountEmbed(counting, t, transformer))

    def run(self, hidden, specs) -> list:
        out: list = [None] * len(specs)
        states = hidden.states
        starts = hidden.meta.cu_seqlens[:-1].long().tolist()
        device = states.device
        for i, spec in enumerate(specs):
            if "gliner2" not in spec.outputs:
                continue
            at = starts[i]
            words = states[at + torch.from_numpy(spec.word_tokens).to(device)]  # [P + W, H]: prefix, text
            span_parts = None
            results: list = []
            for task in spec.tasks:
                marks = states[at + torch.from_numpy(task.markers).to(device)]  # [1 + M, H]
                if task.kind == "classifications":
                    results.append(self.classifier(marks[1:]).squeeze(-1).float().cpu().numpy())
                    continue
                count = int(self.count_pred(marks[0]).argmax())
                entities = task.kind == "entities"
                if count <= 0 or len(words) <= spec.prefix:
                    results.append(_no_candidates() if entities else _no_instances(task.kind, len(marks) - 1))
                    continue
                queries = self.count_embed(marks[1:], 1 if entities else count)  # [n, M, H]
                if span_parts is None:
                    span_parts = (
                        F.linear(F.relu(self.start(words)), self.out_start),  # [P + W, 4H]
                        F.linear(F.relu(self.end(words)), self.out_end),
                    )
                n, m, h = queries.shape
                probs = self._probs(*span_parts, queries.reshape(n * m, h))  # [P + W, k, n*M]
                if entities:
                    results.append(self._candidates(probs, spec))
                elif task.kind == "relations":
                    results.append(self._best(probs, spec, n, m))
                else:
                    results.append(self._structure(probs, spec, task, n, m))
            out[i] = tuple(results)
        return out

    def _probs(self, a: torch.Tensor, b: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        """`[P + W, k, Q]` span probabilities for each query; -1 where a span runs past the end."""
        num_words = a.shape[0]
        width = min(self.max_width, num_words)
        starts = torch.arange(num_words, device=a.device)[:, None]  # [P + W, 1]
        ends = starts + torch.arange(width, device=a.device)[None, :]  # [P + W, k]
        inside = ends < num_words
        hidden = F.relu(a[:, None, :] + b[ends.clamp(max=num_words - 1)] + self.out_b1)  # [P + W, k, 4H]
        rows, bias = queries @ self.out_w2, queries @ self.out_b2  # [Q, 4H], [Q]
        return torch.sigmoid((hidden @ rows.T + bias).float()).masked_fill(~inside[:, :, None], -1.0)

    @staticmethod
    def _text_part(probs: torch.Tensor, spec) -> torch.Tensor:
        """The spans starting in the text (after the prefix words), positions from the text's first word."""
        return probs[spec.prefix :]

    def _candidates(self, probs: torch.Tensor, spec) -> tuple[np.ndarray, ...]:
        """Spans `(start, width)` starting in the window's owned words whose score for a field
        reaches the threshold."""
        probs = self._text_part(probs, spec)
        if spec.owned is not None:
            lo, hi = spec.owned
            probs = probs.clone()
            probs[:lo] = -1.0
            probs[hi:] = -1.0
        s, k, m = torch.nonzero(probs >= spec.threshold, as_tuple=True)
        return (s.cpu().numpy(), k.cpu().numpy(), m.cpu().numpy(), probs[s, k, m].cpu().numpy())

    def _best(self, probs: torch.Tensor, spec, n: int, m: int) -> tuple[np.ndarray, ...]:
        """Per instance and field, the best-scoring span starting anywhere in the window's text:
        (start, width, score) each `[n, M]`, the first in (start, width) order on a tie; score -1
        where none reaches the threshold. (Instances are merged across windows, not split.)"""
        probs = self._text_part(probs, spec)
        width = probs.shape[1]
        best, at = probs.reshape(-1, n * m).max(dim=0)  # first maximum in (start, width) order
        score = best.masked_fill(best < spec.threshold, -1.0).reshape(n, m).cpu().numpy()
        index = at.reshape(n, m).cpu().numpy()
        return (index // width, index % width, score)

    def _structure(self, probs: torch.Tensor, spec, task, n: int, m: int) -> tuple[np.ndarray, ...]:
        """A structure's spans and choices: (instance, field, start, width, score) of each span
        starting in the text whose score reaches its field's threshold, and `[n, M, P]` each
        prefix word's own (one-word span) score, where the choice fields find their choices."""
        text = self._text_part(probs, spec)
        thresholds = torch.from_numpy(np.tile(task.thresholds, n)).to(text.device)  # [n*M]
        s, k, q = torch.nonzero(text >= thresholds, as_tuple=True)
        prefix = probs[: spec.prefix, 0, :].T.reshape(n, m, spec.prefix).cpu().numpy()
        q_cpu = q.cpu().numpy()
        return (q_cpu // m, q_cpu % m, s.cpu().numpy(), k.cpu().numpy(), text[s, k, q].cpu().numpy(), prefix)


def _no_instances(kind: str, num_fields: int) -> tuple[np.ndarray, ...]:
    empty = np.zeros((0, num_fields), dtype=np.int64)
    if kind == "relations":
        return (empty, empty, np.zeros((0, num_fields), dtype=np.float32))
    none = np.zeros(0, dtype=np.int64)
    return (none, none, none, none, np.zeros(0, dtype=np.float32), np.zeros((0, num_fields, 0), dtype=np.float32))


def _no_candidates() -> tuple[np.ndarray, ...]:
    empty = np.zeros(0, dtype=np.int64)
    return (empty, empty, empty, np.zeros(0, dtype=np.float32))
