"""Score heads: one relevance score per (query, document) sequence, over packed encoder output.

- `ClassifierHead` (cross-encoders): the checkpoint's own sequence-classification head on the
  pooled pair. Its layout is data the architecture declares (`classifier_layout(config)`: the
  pooling and a list of linear / activation / norm steps over checkpoint module names), so one
  head serves BERT, RoBERTa/XLM-R, DeBERTa-v2, ModernBERT and DistilBERT.
- `YesNoHead` (LLM rerankers): the last token's hidden state through the two LM-head rows of the
  card's yes/no tokens only (never the whole vocabulary); the score is P(yes) over {yes, no}.

`run` returns a float per sequence whose spec asks for "score": the activated score, or the raw
logit when the spec says `raw`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ModelLoadError
from ..head_info import ClassLabels, LlmFrame, NliLabels
from ..layers import activation
from ..weights import load_tensors, read_config
from .pooling import pool


class ClassifierHead:
    output = "score"

    def __init__(
        self,
        pooling: str,
        steps: list[Callable[[torch.Tensor], torch.Tensor]],
        activation_name: str,
        num_labels: int,
        positive_label: int,
    ) -> None:
        self.pooling = pooling
        self.steps = steps
        self.activation = activation_name
        self.num_labels = num_labels
        self.positive_label = positive_label

    @classmethod
    def build(cls, ctx) -> ClassifierHead:
        pooling, steps, num_labels = classifier_steps(ctx)
        spec = ctx.card.score
        positive = spec.positive_label if spec.positive_label is not None else num_labels - 1
        if not 0 <= positive < num_labels:
            raise ModelLoadError(
                f"{ctx.card.id}: score.positive_label {positive} is outside the model's {num_labels} labels",
                details={"field": "score.positive_label"},
            )
        return cls(pooling, steps, spec.activation, num_labels, positive)

    def logits(self, hidden) -> torch.Tensor:
        x = pool(hidden.states, hidden.meta, self.pooling)  # [n, hidden]
        for step in self.steps:
            x = step(x)
        return x.float()  # [n, labels]

    def run(self, hidden, specs) -> list[float | None]:
        logits = self.logits(hidden)
        raw = logits[:, self.positive_label]
        name = self.activation
        if name == "auto":
            name = "sigmoid" if self.num_labels == 1 else "softmax"
        if name == "sigmoid":
            scores = torch.sigmoid(raw)
        elif name == "softmax":
            scores = logits.softmax(-1)[:, self.positive_label]
        else:
            scores = raw
        raw_list, score_list = raw.cpu().tolist(), scores.cpu().tolist()
        return [
            (raw_list[i] if s.raw else score_list[i]) if "score" in s.outputs else None for i, s in enumerate(specs)
        ]


class NliHead(ClassifierHead):
    """Zero-shot classification: the same sequence-classification head on (text, hypothesis)
    pairs; `run` returns each pair's logits `[labels]` (numpy) for the extract task to read."""

    output = "nli"
    entailment_id: int  # set by `build`
    contradiction_id: int

    @classmethod
    def build(cls, ctx) -> NliHead:
        pooling, steps, num_labels = classifier_steps(ctx)
        head = cls(pooling, steps, "none", num_labels, 0)
        names = {int(k): str(v) for k, v in (read_config(ctx.directory).get("id2label") or {}).items()}
        wanted = ctx.card.extract.entailment_label
        matches = [
            i for i, name in sorted(names.items()) if (name == wanted if wanted else name.lower().startswith("entail"))
        ]
        if not matches or num_labels < 2:
            raise ModelLoadError(
                f"{ctx.card.id}: no {wanted or 'entailment'} label among config.json's id2label "
                f"{sorted(names.values())}; set extract.entailment_label",
                details={"field": "extract.entailment_label"},
            )
        # As transformers' pipeline: the entailment label, and (multi-label) label 0 against it,
        # or the last label when entailment is label 0.
        head.entailment_id = matches[0]
        head.contradiction_id = num_labels - 1 if head.entailment_id == 0 else 0
        return head

    def describe(self) -> NliLabels:
        return NliLabels(self.entailment_id, self.contradiction_id)

    def run(self, hidden, specs) -> list:
        logits = self.logits(hidden).cpu().numpy()
        return [logits[i] if "nli" in s.outputs else None for i, s in enumerate(specs)]


class SequenceClassHead(ClassifierHead):
    """Text classification (`*ForSequenceClassification`: sentiment, toxicity, prompt-injection
    guards, language ID): the same head on a text (or a text pair); `run` returns its logits
    `[labels]` (numpy), named and activated by the extract task from `describe()`."""

    output = "class_logits"
    labels: ClassLabels  # set by `build`

    @classmethod
    def build(cls, ctx) -> SequenceClassHead:
        pooling, steps, num_labels = classifier_steps(ctx)
        head = cls(pooling, steps, "none", num_labels, 0)
        config = read_config(ctx.directory)
        raw = config.get("id2label") or {}
        try:
            names = {int(k): str(v) for k, v in raw.items()}
        except (ValueError, AttributeError):
            raise ModelLoadError(
                f"{ctx.card.id}: config.json's id2label keys must be integers", details={"file": "config.json"}
            ) from None
        if names and sorted(names) != list(range(num_labels)):
            raise ModelLoadError(
                f"{ctx.card.id}: config.json's id2label names {len(names)} labels; the classifier has {num_labels}",
                details={"file": "config.json"},
            )
        head.labels = ClassLabels(
            tuple(names.get(i, f"LABEL_{i}") for i in range(num_labels)),
            default_function(config.get("problem_type"), num_labels, config.get("function_to_apply")),
        )
        return head

    def describe(self) -> ClassLabels:
        return self.labels

    def run(self, hidden, specs) -> list:
        logits = self.logits(hidden).cpu().numpy()
        return [logits[i] if "class_logits" in s.outputs else None for i, s in enumerate(specs)]


def default_function(problem_type: str | None, num_labels: int, configured: str | None = None) -> str:
    """The scores' function when a call names none, as transformers' text-classification pipeline
    picks it: none for regression, sigmoid for multi-label or one label, else softmax."""
    if problem_type == "regression":
        return "none"
    if problem_type == "multi_label_classification" or num_labels == 1:
        return "sigmoid"
    if problem_type == "single_label_classification" or num_labels > 1:
        return "softmax"
    return configured if configured in ("softmax", "sigmoid", "none") else "none"


def classifier_steps(ctx) -> tuple[str, list[Callable[[torch.Tensor], torch.Tensor]], int]:
    """The architecture's sequence-classification head as (pooling, steps, number of labels)."""
    layout = getattr(ctx.model, "classifier_layout", None)
    if layout is None:
        raise ModelLoadError(f"{type(ctx.model).__name__} has no sequence-classification head")
    pooling, layout_steps = layout(read_config(ctx.directory))
    names = []
    for op, name, *opts in layout_steps:
        if op in ("linear", "norm"):
            names.append(f"{name}.weight")
            if (opts[0] if opts else {}).get("bias", True):
                names.append(f"{name}.bias")
    prefixes = getattr(ctx.model, "checkpoint_prefixes", ("bert.", "model."))
    t = {k: v.to(**ctx.to) for k, v in load_tensors(ctx.directory, names, prefixes=prefixes).items()}
    steps: list[Callable[[torch.Tensor], torch.Tensor]] = []
    num_labels: int | None = None
    for op, name, *opts in layout_steps:
        opt = opts[0] if opts else {}
        if op == "linear":
            weight, bias = t[f"{name}.weight"], t.get(f"{name}.bias")

            def linear(x: torch.Tensor, w: torch.Tensor = weight, b: torch.Tensor | None = bias) -> torch.Tensor:
                return F.linear(x, w, b)

            steps.append(linear)
            num_labels = weight.shape[0]
        elif op == "norm":
            weight, bias = t[f"{name}.weight"], t.get(f"{name}.bias")
            eps = opt.get("eps", 1e-5)

            def norm(
                x: torch.Tensor, w: torch.Tensor = weight, b: torch.Tensor | None = bias, eps: float = eps
            ) -> torch.Tensor:
                return F.layer_norm(x, w.shape, w, b, eps)

            steps.append(norm)
        elif op == "act":
            try:
                steps.append(activation(name))
            except ValueError as exc:  # an activation config.json names that shoal lacks
                raise ModelLoadError(
                    f"{ctx.card.id}: the classifier head's {exc}", details={"file": "config.json"}
                ) from None
        else:
            raise ModelLoadError(f"unknown classifier step {op!r}")
    assert num_labels is not None  # a classifier head ends in a linear step
    return pooling, steps, num_labels


class YesNoHead:
    """Also says how sequences are framed (`describe`: an LlmFrame): the score task fills the
    card's template, puts `prefix_ids` and `suffix_ids` around it, and cuts only the templated part
    with `body_tokenizer` (as Qwen3-Reranker's reference does)."""

    output = "score"

    def __init__(self, rows: torch.Tensor, spec, prefix_ids: list[int], suffix_ids: list[int], body_tokenizer) -> None:
        self.rows = rows  # [2, hidden]: the LM head's rows for "no" and "yes"
        self.spec = spec
        self.prefix_ids, self.suffix_ids = prefix_ids, suffix_ids
        self.body_tokenizer = body_tokenizer  # truncates at max_length minus the prefix and suffix

    def describe(self) -> LlmFrame:
        return LlmFrame(
            tuple(self.prefix_ids),
            tuple(self.suffix_ids),
            self.spec.template,
            self.spec.instruction,
            self.body_tokenizer,
        )

    @classmethod
    def build(cls, ctx) -> YesNoHead:
        spec = ctx.card.score
        ids = [ctx.tokenizer.token_id(spec.no_token), ctx.tokenizer.token_id(spec.yes_token)]
        config = read_config(ctx.directory)
        try:
            weight = load_tensors(ctx.directory, ["lm_head.weight"], prefixes=())["lm_head.weight"]
        except ModelLoadError:
            if not config.get("tie_word_embeddings", False):
                raise ModelLoadError(
                    f"{ctx.card.id}: the checkpoint has no lm_head.weight and does not tie it to the embeddings"
                ) from None
            weight = _tied_embeddings(ctx.model)
        tokenizer = ctx.tokenizer
        prefix, suffix = tokenizer.plain_ids(spec.prefix), tokenizer.plain_ids(spec.suffix)
        room = tokenizer.max_length - len(prefix) - len(suffix)
        if room < 8:
            raise ModelLoadError(
                f"{ctx.card.id}: score.prefix and score.suffix take {len(prefix) + len(suffix)} "
                f"of the {tokenizer.max_length} tokens",
                details={"field": "score.prefix"},
            )
        return cls(weight[ids].to(**ctx.to), spec, prefix, suffix, tokenizer.variant(room))

    def run(self, hidden, specs) -> list[float | None]:
        last = hidden.states[hidden.meta.cu_seqlens[1:].long() - 1]  # [n, hidden]: each sequence's last token
        logits = F.linear(last, self.rows).float()  # [n, 2]: (no, yes)
        raw = (logits[:, 1] - logits[:, 0]).cpu().tolist()  # log-odds of yes
        scores = logits.softmax(-1)[:, 1].cpu().tolist()
        return [(raw[i] if s.raw else scores[i]) if "score" in s.outputs else None for i, s in enumerate(specs)]


def _tied_embeddings(model: Any) -> torch.Tensor:
    for name in ("embed_tokens.weight", "word_embeddings.weight"):
        try:
            return model.get_parameter(name)
        except AttributeError:
            continue
    raise ModelLoadError(f"{type(model).__name__} has no input embeddings to tie an LM head to")
