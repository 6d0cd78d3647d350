"""GLiClass's label scorer (uni-encoder), over the packed backbone output.

One sequence is `[CLS] text <<LABEL>> label ... <<LABEL>> label <<SEP>> [SEP]` (the prompt before
the text when `prompt_first`). From the backbone's token states:

    text      the sequence pooled (`pooling_strategy`: first token, mean or max), through
              `text_projector` (Linear, act, Linear)                              -> t   [H]
    labels    each label's <<LABEL>> token (or the token after it, `embed_class_token: false`),
              or the mean of its tokens from its <<LABEL>> to the next one (the last: to the
              sequence's end; `class_token_pooling: average`), through `classes_projector`
                                                                                  -> l   [C, H]
    logits    `scorer_type`: simple (t . l), weighted-dot (an MLP over [Pt_1, Pl_1, Pt_2 * Pl_2]
              with t and l each projected to two halves) or mlp (an MLP over [t, l])   [C]

With `normalize_features`, t and l are L2-normalised first and the logits multiplied by the
checkpoint's `logit_scale` (as it is, not its exp). `run` returns each sequence's logits as a
float32 numpy array `[C]`; the task applies sigmoid or softmax.

The reference pools the text over its padded batch (mean and max then read padding); here a
sequence pools its own tokens only, which is what the reference computes for a batch of one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ModelLoadError
from ..head_info import GliclassPrompt
from ..weights import load_tensors

CONFIG_FILE = "config.json"
BACKBONE_PREFIX = "model.encoder_model."
LABEL_TOKEN = "<<LABEL>>"
SEP_TOKEN = "<<SEP>>"
TEXT_POOLINGS = ("first", "avg", "max")
LABEL_POOLINGS = ("first", "average")
SCORERS = ("simple", "weighted-dot", "mlp")
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "tanh": torch.tanh,
}
# Options that change the forward, and the value this head implements (each other value is refused).
_OFF = {
    "use_lstm": False,
    "squeeze_layers": False,
    "use_segment_embeddings": False,
    "extract_text_features": False,
    "use_calibrator": False,
    "multimodal": False,
    "encoder_layer_id": -1,
}


def read_gliclass_config(directory: Path) -> dict[str, Any]:
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{directory}/{CONFIG_FILE}: {exc}", details={"file": CONFIG_FILE}) from None
    if config.get("model_type") != "GLiClass" or not isinstance(config.get("encoder_config"), dict):
        raise ModelLoadError(
            f"{directory}/{CONFIG_FILE}: not a GLiClass config (model_type {config.get('model_type')!r}, "
            "and an encoder_config is needed)",
            details={"file": CONFIG_FILE, "field": "model_type"},
        )
    return config


def check_gliclass_config(config: dict[str, Any], where: str) -> None:
    """Refuse, naming the field, the GLiClass variants this head does not implement."""

    def refuse(field: str, supported: str) -> None:
        raise ModelLoadError(
            f"{where}: GLiClass {field}={config.get(field)!r} is not implemented (shoal serves {supported})",
            details={"file": CONFIG_FILE, "field": field},
        )

    if config.get("architecture_type", "uni-encoder") != "uni-encoder":
        refuse("architecture_type", "the uni-encoder architecture")
    for field, value in _OFF.items():
        if config.get(field, value) != value:
            refuse(field, f"{field}: {json.dumps(value)}")
    if config.get("pooling_strategy", "first") not in TEXT_POOLINGS:
        refuse("pooling_strategy", f"pooling_strategy {', '.join(TEXT_POOLINGS)}")
    if config.get("class_token_pooling", "first") not in LABEL_POOLINGS:
        refuse("class_token_pooling", f"class_token_pooling {' or '.join(LABEL_POOLINGS)}")
    if config.get("scorer_type", "simple") not in SCORERS:
        refuse("scorer_type", f"scorer_type {', '.join(SCORERS)}")
    if config.get("projector_hidden_act", "gelu") not in ACTIVATIONS:
        refuse("projector_hidden_act", f"projector_hidden_act {', '.join(ACTIVATIONS)}")


class _Projector:
    """FeaturesProjector: Linear, activation, (dropout), Linear."""

    def __init__(self, t: dict[str, torch.Tensor], name: str, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.w1, self.b1 = t[f"{name}.linear_1.weight"], t[f"{name}.linear_1.bias"]
        self.w2, self.b2 = t[f"{name}.linear_2.weight"], t[f"{name}.linear_2.bias"]
        self.act = act

    @staticmethod
    def names(name: str) -> list[str]:
        return [f"{name}.linear_{i}.{kind}" for i in (1, 2) for kind in ("weight", "bias")]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.act(F.linear(x, self.w1, self.b1)), self.w2, self.b2)


def _linears(t: dict[str, torch.Tensor], name: str, indices: tuple[int, ...]) -> list[tuple[torch.Tensor, ...]]:
    return [(t[f"{name}.{i}.weight"], t[f"{name}.{i}.bias"]) for i in indices]


# The scorers' Linear layers in their nn.Sequential (dropouts and ReLUs between them).
_SCORER_LAYERS = {"simple": (), "weighted-dot": ("out_mlp", (0, 3)), "mlp": ("mlp", (0, 2, 4))}


class GliclassHead:
    output = "gliclass"

    def __init__(self, config: dict[str, Any], t: dict[str, torch.Tensor], label_token_id: int) -> None:
        act = ACTIVATIONS[config.get("projector_hidden_act", "gelu")]
        self.text_projector = _Projector(t, "model.text_projector", act)
        self.classes_projector = _Projector(t, "model.classes_projector", act)
        self.pooling = config.get("pooling_strategy", "first")
        self.average_labels = config.get("class_token_pooling", "first") == "average"
        self.embed_class_token = bool(config.get("embed_class_token", True))
        self.normalize = bool(config.get("normalize_features", False))
        self.logit_scale = t.get("model.logit_scale")
        self.scorer = config.get("scorer_type", "simple")
        self.prompt = GliclassPrompt(LABEL_TOKEN, SEP_TOKEN, label_token_id, bool(config.get("prompt_first", False)))
        if self.scorer == "weighted-dot":
            self.proj_text = (t["model.scorer.proj_text.weight"], t["model.scorer.proj_text.bias"])
            self.proj_label = (t["model.scorer.proj_label.weight"], t["model.scorer.proj_label.bias"])
            self.mlp = _linears(t, "model.scorer.out_mlp", (0, 3))
        elif self.scorer == "mlp":
            self.mlp = _linears(t, "model.scorer.mlp", (0, 2, 4))

    def describe(self) -> GliclassPrompt:
        return self.prompt

    @classmethod
    def build(cls, ctx) -> GliclassHead:
        config = read_gliclass_config(ctx.directory)
        check_gliclass_config(config, str(ctx.directory))
        names = _Projector.names("model.text_projector") + _Projector.names("model.classes_projector")
        scorer = config.get("scorer_type", "simple")
        if scorer == "weighted-dot":
            names += [f"model.scorer.proj_{part}.{kind}" for part in ("text", "label") for kind in ("weight", "bias")]
        if _SCORER_LAYERS[scorer]:
            name, indices = _SCORER_LAYERS[scorer]
            names += [f"model.scorer.{name}.{i}.{kind}" for i in indices for kind in ("weight", "bias")]
        if config.get("normalize_features", False):
            names.append("model.logit_scale")
        t = load_tensors(ctx.directory, names, prefixes=())
        t = {k: v.to(**ctx.to) for k, v in t.items()}
        return cls(config, t, ctx.tokenizer.token_id(LABEL_TOKEN))

    def run(self, hidden, specs) -> list:
        mine = [i for i, s in enumerate(specs) if self.output in s.outputs]
        out: list = [None] * len(specs)
        if not mine:
            return out
        states = hidden.states  # [T, E]
        device = states.device
        cu = hidden.meta.cu_seqlens.long().tolist()
        texts = torch.stack([self._pool(states[cu[i] : cu[i + 1]]) for i in mine])  # [n, E]
        labels, counts = self._labels(states, [(cu[i], cu[i + 1], specs[i].prompt_tokens) for i in mine])  # [C, E]
        text = self.text_projector(texts)  # [n, E]
        label = self.classes_projector(labels)  # [C, E]
        if self.normalize:
            text = text / (text.norm(dim=-1, keepdim=True) + 1e-8)
            label = label / (label.norm(dim=-1, keepdim=True) + 1e-8)
        owner = torch.repeat_interleave(torch.arange(len(mine), device=device), torch.tensor(counts, device=device))
        logits = self._score(text[owner], label)  # [C]
        if self.normalize and self.logit_scale is not None:
            logits = logits * self.logit_scale
        logits_np = logits.float().cpu().numpy()
        start = 0
        for j, i in enumerate(mine):
            out[i] = logits_np[start : start + counts[j]].copy()
            start += counts[j]
        return out

    def _pool(self, states: torch.Tensor) -> torch.Tensor:
        """One sequence's `[L, E]` states -> its text vector `[E]`."""
        if self.pooling == "first":
            return states[0]
        if self.pooling == "avg":
            return states.mean(dim=0)
        return states.amax(dim=0)

    def _labels(self, states: torch.Tensor, seqs: list[tuple[int, int, np.ndarray]]) -> tuple[torch.Tensor, list[int]]:
        """Each label's vector `[C, E]` (all sequences' labels in order), and how many each has."""
        counts = [len(positions) for _, _, positions in seqs]
        if not self.average_labels:
            shift = 0 if self.embed_class_token else 1
            picked = np.concatenate([start + positions + shift for start, _, positions in seqs])
            return states[torch.from_numpy(picked).to(states.device)], counts
        # A label's span: from its <<LABEL>> (after it, without embed_class_token) to the next label's,
        # the last label's to the sequence's end.
        rows: list[np.ndarray] = []
        spans: list[np.ndarray] = []
        label = 0
        for start, end, positions in seqs:
            bounds = [*positions.tolist(), end - start]
            for a, b in zip(bounds[:-1], bounds[1:]):
                a += 0 if self.embed_class_token else 1
                rows.append(np.arange(start + a, start + b))
                spans.append(np.full(b - a, label))
                label += 1
        index = torch.from_numpy(np.concatenate(rows)).to(states.device)
        span = torch.from_numpy(np.concatenate(spans)).to(states.device)
        sums = torch.zeros(label, states.shape[1], dtype=states.dtype, device=states.device)
        sums.index_add_(0, span, states[index])
        sizes = torch.bincount(span, minlength=label).clamp(min=1).to(states.dtype)
        return sums / sizes[:, None], counts

    def _score(self, text: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        """`[C, E]` text vectors (each label's text) and label vectors -> `[C]` logits."""
        if self.scorer == "simple":
            return (text * label).sum(dim=-1)
        if self.scorer == "weighted-dot":
            t1, t2 = F.linear(text, *self.proj_text).chunk(2, dim=-1)  # [C, E] each
            l1, l2 = F.linear(label, *self.proj_label).chunk(2, dim=-1)
            x = torch.cat([t1, l1, t2 * l2], dim=-1)  # [C, 3E]
        else:
            x = torch.cat([text, label], dim=-1)  # [C, 2E]
        for weight, bias in self.mlp[:-1]:
            x = F.relu(F.linear(x, weight, bias))
        weight, bias = self.mlp[-1]
        return F.linear(x, weight, bias).squeeze(-1)
