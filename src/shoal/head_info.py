"""What heads tell the tasks that plan for them, torch-free: one frozen dataclass per kind of
head (a new kind of head adds its own). A head's `describe()` returns one (a dual encoder's
`Similarity` comes from the model itself); the backend puts them in its `ModelInfo`
(engine/backend.py), where tasks read them with `info.head(Kind)`.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from .engine.tokenizer import TextTokenizer


@dataclass(frozen=True)
class GlinerPrompt:
    """A GLiNER model's prompt and span limits (its gliner_config.json)."""

    ent_token: str
    sep_token: str
    max_width: int  # widest span, in words
    max_words: int  # words of text the model was trained to read at once
    embed_ent_token: bool  # a label reads its [ENT] token (else the label's own first token)
    last_subtoken: bool  # a word reads its last token (else its first)


@dataclass(frozen=True)
class Gliner2Prompt:
    """A GLiNER2 span model's limits (its config.json)."""

    max_width: int  # widest span, in words


@dataclass(frozen=True)
class GlirelPrompt:
    """A GLiREL model's prompt and limits (its glirel_config.json)."""

    rel_token: str
    sep_token: str
    max_words: int  # words of text the model reads at most (`max_len`)
    max_pair_distance: int | None  # words between a (later, earlier) pair's starts, at most
    last_subtoken: bool  # a word reads its last token (else its first)


@dataclass(frozen=True)
class GliclassPrompt:
    """A GLiClass model's prompt (its config.json): each label after `label_token`, then
    `sep_token`, after the text (before it when `prompt_first`)."""

    label_token: str
    sep_token: str
    label_token_id: int
    prompt_first: bool


@dataclass(frozen=True)
class TokenLabels:
    """A token classifier's labels (config.json's id2label)."""

    id2label: dict[int, str]

    @property
    def entity_types(self) -> list[str]:
        """The label names less their B-/I- prefixes and O, sorted."""
        return sorted({name.split("-", 1)[-1] for name in self.id2label.values() if name != "O"})


@dataclass(frozen=True)
class ClassLabels:
    """A text classifier's labels (config.json's id2label, by logit index) and the function its
    scores take by default (transformers' text-classification pipeline's choice from the config's
    `problem_type` and label count): "softmax", "sigmoid" or "none"."""

    names: tuple[str, ...]
    function: str


@dataclass(frozen=True)
class NliLabels:
    """Which logits of an NLI classifier mean entailment and contradiction."""

    entailment_id: int
    contradiction_id: int


_FIELD = re.compile(r"\{(instruction|query|document)\}")


@dataclass(frozen=True)
class LlmFrame:
    """How an LLM reranker frames a pair: `prefix_ids` + tokens of the filled template (cut by
    `body`, which leaves room for the prefix and suffix) + `suffix_ids`."""

    prefix_ids: tuple[int, ...]
    suffix_ids: tuple[int, ...]
    template: str  # with {instruction}, {query} and {document}
    instruction: str  # the card's default
    body: TextTokenizer

    def text(self, query: str, document: str, instruction: str | None) -> str:
        values = {
            "instruction": self.instruction if instruction is None else instruction,
            "query": query,
            "document": document,
        }
        return _FIELD.sub(lambda m: values[m.group(1)], self.template)  # one pass: values stay literal


@dataclass(frozen=True)
class Similarity:
    """A dual encoder's own score of a text against an image (CLIP, SigLIP): the cosine of their
    embeddings times `scale`, plus `bias`; SigLIP's is then a sigmoid, a match probability."""

    scale: float  # exp(logit_scale), as checkpoints store its log
    bias: float = 0.0
    sigmoid: bool = False

    def score(self, cosine: float, raw: bool = False) -> float:
        """The model's score from a cosine; `raw`: the logit, without the sigmoid."""
        logit = cosine * self.scale + self.bias
        if raw or not self.sigmoid:
            return logit
        return 1.0 / (1.0 + math.exp(-logit))


@dataclass(frozen=True)
class ChatFrame:
    """A decoder's chat template (the Jinja text of its tokenizer config, as transformers reads
    it) and what generation stops at. `render` frames messages as the template says, with the
    assistant's turn next, in a sandbox (a template is data from the model's files)."""

    template: str | None
    bos_token: str
    eos_token: str
    eos_ids: tuple[int, ...]

    def render(self, messages: list[dict[str, str]]) -> str:
        from .errors import InvalidRequest

        if self.template is None:
            raise InvalidRequest("this model has no chat template: send a `prompt` instead of `messages`")
        from jinja2 import TemplateError

        try:
            rendered = _compiled_template(self.template).render(
                messages=messages, add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token
            )
        except TemplateError as exc:  # the template's own check of these messages, or its limits
            raise InvalidRequest(f"the model's chat template cannot frame these messages: {exc}") from None
        return str(rendered)


@functools.lru_cache(maxsize=16)
def _compiled_template(source: str) -> Any:  # a jinja2.Template
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from .errors import InvalidRequest

    def raise_exception(message: str) -> None:
        raise InvalidRequest(f"the chat template refuses these messages: {message}")

    # As transformers compiles chat templates: trimmed blocks, and {% break %} / {% continue %}.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


HeadInfo = (
    GlinerPrompt
    | Gliner2Prompt
    | GlirelPrompt
    | GliclassPrompt
    | TokenLabels
    | ClassLabels
    | NliLabels
    | LlmFrame
    | Similarity
    | ChatFrame
)
H = TypeVar(
    "H",
    GlinerPrompt,
    Gliner2Prompt,
    GlirelPrompt,
    GliclassPrompt,
    TokenLabels,
    ClassLabels,
    NliLabels,
    LlmFrame,
    Similarity,
    ChatFrame,
)
