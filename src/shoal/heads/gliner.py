"""GLiNER's span head (uni-encoder, `span_mode` markerV0 or marker), over the packed backbone output.

One sequence is `[CLS] <<ENT>> label ... <<ENT>> label <<SEP>> word ... word [SEP]`, tokenized word
by word. From the backbone's token states (projected to GLiNER's hidden size when they differ):

    prompts   the state at each label's <<ENT>> token (or the token after it), through
              `prompt_rep_layer` (Linear 4H, ReLU, Linear H)                      -> p   [C, H]
    words     the state of each text word's first (or last) token, through a bidirectional
              LSTM                                                               -> h   [W, H]
    spans     for a start i and width k < K: out_project(relu([start(h_i), end(h_i+k)])), where
              start and end are two-layer ReLU MLPs, and out_project is one too (markerV0) or a
              single linear layer (marker: NuNER Zero, K = 1)
    logits    span . p for every span and label                                   -> [W, K, C]

The first layer of out_project acts on the two halves of the concatenation separately, and the
span's score is linear in its out_project output, so both fold: per word a = relu(start(h)) A
and b = relu(end(h)) B once, the hidden layer of span (i, k) is relu(a_i + b_(i+k) + bias), and
its scores are that times (W2^T p) plus W2's bias . p (marker: a_i (A^T p) + b_(i+k) (B^T p) +
bias . p, no hidden layer). The [W, K, H] span tensor of the reference is never built; the scores
are the same up to float rounding.

`run` returns, per sequence, the candidates whose sigmoid score passes the spec's threshold as
numpy arrays (start, width, label, score) in (start, width, label) order; decoding them is
`shoal.spans.decode_spans`.
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
from ..head_info import GlinerPrompt
from ..weights import load_tensors

CONFIG_FILE = "gliner_config.json"
BACKBONE_PREFIX = "token_rep_layer.bert_layer.model."
POOLINGS = ("first", "last")
SPAN_MODES = ("markerV0", "marker")


def read_gliner_config(directory: Path) -> dict[str, Any]:
    try:
        return json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{directory}/{CONFIG_FILE}: {exc}", details={"file": CONFIG_FILE}) from None


def check_gliner_config(config: dict[str, Any], where: str) -> None:
    """Refuse, naming the field, the GLiNER variants this head does not implement."""

    def refuse(field: str, value: Any, supported: str) -> None:
        raise ModelLoadError(
            f"{where}: GLiNER {field}={value!r} is not implemented (shoal serves {supported})",
            details={"file": CONFIG_FILE, "field": field},
        )

    span_mode = config.get("span_mode", "markerV0")
    if span_mode not in SPAN_MODES:
        refuse("span_mode", span_mode, "span_mode markerV0 or marker, the uni-encoder span models")
    for field in ("labels_encoder", "labels_decoder", "relations_layer"):
        if config.get(field):
            refuse(field, config[field], "uni-encoder span models")
    if config.get("post_fusion_schema"):
        refuse("post_fusion_schema", config["post_fusion_schema"], "models without post-fusion layers")
    if config.get("fuse_layers"):
        refuse("fuse_layers", True, "models that read the last layer")
    pooling = config.get("subtoken_pooling", "first")
    if pooling not in POOLINGS:
        refuse("subtoken_pooling", pooling, "first or last subtoken pooling")
    if config.get("words_splitter_type", "whitespace") != "whitespace":
        refuse("words_splitter_type", config["words_splitter_type"], "the whitespace word splitter")


class _Mlp:
    """create_projection_layer: Linear(in, 4 out), ReLU, (dropout), Linear(4 out, out)."""

    def __init__(self, t: dict[str, torch.Tensor], name: str) -> None:
        self.w1, self.b1 = t[f"{name}.0.weight"], t[f"{name}.0.bias"]
        self.w2, self.b2 = t[f"{name}.3.weight"], t[f"{name}.3.bias"]

    @staticmethod
    def names(name: str) -> list[str]:
        return [f"{name}.{i}.{kind}" for i in (0, 3) for kind in ("weight", "bias")]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.relu(F.linear(x, self.w1, self.b1)), self.w2, self.b2)


class GlinerHead:
    output = "entities"

    def __init__(self, config: dict[str, Any], t: dict[str, torch.Tensor], lstm: nn.LSTM | None) -> None:
        self.max_width = int(config.get("max_width", 12))
        self.max_len = int(config.get("max_len", 384))  # words a text was trained with at most
        self.ent_token = config.get("ent_token", "<<ENT>>")
        self.sep_token = config.get("sep_token", "<<SEP>>")
        self.hidden_size = int(config["hidden_size"])
        self.embed_ent_token = bool(config.get("embed_ent_token", True))
        self.pooling = config.get("subtoken_pooling", "first")
        self.projection = (
            (t["token_rep_layer.projection.weight"], t["token_rep_layer.projection.bias"])
            if "token_rep_layer.projection.weight" in t
            else None
        )
        self.lstm = lstm
        self.prompt = _Mlp(t, "prompt_rep_layer")
        self.start = _Mlp(t, "span_rep_layer.span_rep_layer.project_start")
        self.end = _Mlp(t, "span_rep_layer.span_rep_layer.project_end")
        h = self.hidden_size
        self.mlp_out = config.get("span_mode", "markerV0") == "markerV0"
        if self.mlp_out:
            out = _Mlp(t, "span_rep_layer.span_rep_layer.out_project")
            self.out_start, self.out_end = out.w1[:, :h], out.w1[:, h:]  # [4H, H] each
            self.out_b1, self.out_w2, self.out_b2 = out.b1, out.w2, out.b2
        else:  # marker: out_project is one Linear(2H, H)
            w, b = (
                t["span_rep_layer.span_rep_layer.out_project.weight"],
                t["span_rep_layer.span_rep_layer.out_project.bias"],
            )
            self.out_start, self.out_end, self.out_bias = w[:, :h], w[:, h:], b  # [H, H] each, [H]

    def describe(self) -> GlinerPrompt:
        return GlinerPrompt(
            self.ent_token,
            self.sep_token,
            self.max_width,
            self.max_len,
            self.embed_ent_token,
            last_subtoken=self.pooling == "last",
        )

    @classmethod
    def build(cls, ctx) -> GlinerHead:
        config = read_gliner_config(ctx.directory)
        check_gliner_config(config, str(ctx.directory))
        names = [*_Mlp.names("prompt_rep_layer")]
        for part in ("project_start", "project_end"):
            names += _Mlp.names(f"span_rep_layer.span_rep_layer.{part}")
        if config.get("span_mode", "markerV0") == "markerV0":
            names += _Mlp.names("span_rep_layer.span_rep_layer.out_project")
        else:
            names += [f"span_rep_layer.span_rep_layer.out_project.{kind}" for kind in ("weight", "bias")]
        layers = int(config.get("num_rnn_layers", 1))
        lstm_names = [
            f"rnn.lstm.{kind}_l{i}{rev}"
            for i in range(layers)
            for rev in ("", "_reverse")
            for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
        ]
        t = load_tensors(ctx.directory, names + lstm_names, prefixes=())
        try:
            t.update(
                load_tensors(
                    ctx.directory, ["token_rep_layer.projection.weight", "token_rep_layer.projection.bias"], prefixes=()
                )
            )
        except ModelLoadError:  # the backbone's hidden size is GLiNER's: no projection
            pass
        lstm = None
        if layers > 0:
            h = int(config["hidden_size"])
            lstm = nn.LSTM(h, h // 2, num_layers=layers, bidirectional=True, batch_first=True)
            try:
                lstm.load_state_dict({name.removeprefix("rnn.lstm."): t.pop(name) for name in lstm_names})
            except RuntimeError as exc:
                raise ModelLoadError(
                    f"{ctx.directory}: the checkpoint's LSTM does not fit hidden_size {h}: {exc}",
                    details={"file": CONFIG_FILE},
                ) from None
            lstm = lstm.to(**ctx.to).eval().requires_grad_(False)
        t = {k: v.to(**ctx.to) for k, v in t.items()}
        return cls(config, t, lstm)

    def run(self, hidden, specs) -> list:
        mine = [i for i, s in enumerate(specs) if "entities" in s.outputs]
        out: list = [None] * len(specs)
        if not mine:
            return out
        states = hidden.states
        if self.projection is not None:
            states = F.linear(states, *self.projection)
        starts = hidden.meta.cu_seqlens[:-1].long().tolist()
        device = states.device
        words, prompts = [], []
        for i in mine:
            spec = specs[i]
            words.append(states[starts[i] + torch.from_numpy(spec.word_tokens).to(device)])  # [w, H]
            prompts.append(states[starts[i] + torch.from_numpy(spec.prompt_tokens).to(device)])  # [c, H]
        if self.lstm is not None:  # each sequence's words on their own, as a packed batch
            packed, _ = self.lstm(pack_sequence(words, enforce_sorted=False))
            padded, _ = pad_packed_sequence(packed, batch_first=True)  # [n, W, H]
            words = [padded[j, : len(w)] for j, w in enumerate(words)]
        # The per-word and per-label projections for the whole batch at once, then each sequence's spans.
        all_words = torch.cat(words)  # [sum W, H]
        a = F.linear(F.relu(self.start(all_words)), self.out_start)  # [sum W, 4H] (marker: H)
        b = F.linear(F.relu(self.end(all_words)), self.out_end)
        p = self.prompt(torch.cat(prompts))  # [sum C, H]
        if self.mlp_out:
            label_rows, label_bias = p @ self.out_w2, p @ self.out_b2  # [sum C, 4H], [sum C]
        else:
            label_rows, label_bias = p, p @ self.out_bias  # [sum C, H], [sum C]
        w0 = c0 = 0
        for j, i in enumerate(mine):
            w, c = len(words[j]), len(prompts[j])
            out[i] = self._candidates(
                a[w0 : w0 + w], b[w0 : w0 + w], label_rows[c0 : c0 + c], label_bias[c0 : c0 + c], specs[i]
            )
            w0, c0 = w0 + w, c0 + c
        return out

    def _candidates(
        self, a: torch.Tensor, b: torch.Tensor, label_rows: torch.Tensor, label_bias: torch.Tensor, spec
    ) -> tuple[np.ndarray, ...]:
        """One sequence's spans: a, b `[W, R]` (the start and end words' parts of each span's hidden
        layer, or of its score for marker), label_rows `[C, R]`, label_bias `[C]`."""
        num_words, num_labels = a.shape[0], label_rows.shape[0]
        width = min(self.max_width, spec.max_width, num_words)
        starts = torch.arange(num_words, device=a.device)[:, None]  # [W, 1]
        ends = starts + torch.arange(width, device=a.device)[None, :]  # [W, k]
        inside = ends < num_words
        ends = ends.clamp(max=num_words - 1)
        if self.mlp_out:  # span (i, i + k): relu(a_i + b_(i+k) + bias), times each label's row
            hidden = F.relu(a[:, None, :] + b[ends] + self.out_b1)  # [W, k, 4H]
            scores = hidden @ label_rows.T + label_bias  # [W, k, C]
        else:  # marker: a_i . p + b_(i+k) . p + bias . p
            per_start, per_end = a @ label_rows.T, b @ label_rows.T  # [W, C]
            scores = per_start[:, None, :] + per_end[ends] + label_bias  # [W, k, C]
        logits = torch.full((num_words, self.max_width, num_labels), float("-inf"), device=a.device)
        logits[:, :width] = scores.float().masked_fill(~inside[:, :, None], float("-inf"))
        if spec.owned is not None:  # spans another window answers for are not candidates here
            lo, hi = spec.owned
            logits[:lo] = float("-inf")
            logits[hi:] = float("-inf")
        probs = torch.sigmoid(logits)
        s, k, c = torch.nonzero(probs > spec.threshold, as_tuple=True)
        scores = probs[s, k, c]
        return (s.cpu().numpy(), k.cpu().numpy(), c.cpu().numpy(), scores.cpu().numpy())
