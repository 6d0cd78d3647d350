"""encode: one sequence per item; the card's heads make dense, sparse and multi-vector outputs.

Each item goes through its modality's preprocessor (a text through the tokenizer, with the prompt
prefix; an image through the model's image preprocessor), and the results keep the items' order.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import msgspec

from ...calls import EncodeCall, EncodeResult, Modality
from ...catalog import ModelCard
from ...errors import InvalidRequest, ResultTooLarge
from ...verbs import estimate_tokens
from ..backend import ModelInfo
from ..tokenizer import TextTokenizer
from ..tokenizer_pool import TokenizerPool
from ..types import Encoded, EncodeSpec, PhaseSeconds
from .inputs import check_inputs, prepare, value_of

_DTYPE_BYTES = {"float32": 4.0, "float16": 2.0, "int8": 1.0, "binary": 1 / 8, "ubinary": 1 / 8}
TOKEN_STATES = "token_states"


@dataclass
class EncodePlan:
    card: ModelCard
    call: EncodeCall
    spec: EncodeSpec  # its prompt_tokens are filled in by `tokenize`, once the tokenizer is known
    # What each item's preprocessor takes: a text with the prompt prefix applied, an image's bytes.
    values: list
    modalities: list[Modality]
    estimated_tokens: int
    prompt: str = ""

    @property
    def num_items(self) -> int:
        return len(self.values)


class EncodeTask:
    verb = "encode"

    def __init__(self) -> None:
        self._prompt_tokens = PromptTokens()

    def plan(self, card: ModelCard, call: EncodeCall) -> EncodePlan:
        if not call.items:
            raise InvalidRequest("no items to encode", details={"option": "items"})
        modalities = check_inputs(call.items, card)
        spec = _spec(card, call)
        prefix = prompt_of(card, call.prompt_name, call.is_query)
        values = [value_of(item, prefix) for item in call.items]
        return EncodePlan(card, call, spec, values, modalities, estimate_tokens(call, card), prefix)

    async def tokenize(self, plan: EncodePlan, model: ModelInfo, pool: TokenizerPool) -> list[Encoded]:
        seqs = await prepare(
            pool, model, plan.values, plan.modalities, is_query=plan.spec.is_query, truncate=plan.call.truncate
        )
        tokenizer = model.tokenizer_for(plan.spec.is_query)
        if plan.prompt and "dense" in plan.spec.outputs:
            plan.spec = replace(plan.spec, prompt_tokens=self._prompt_tokens.count(tokenizer, plan.prompt))
        return seqs

    def specs(self, plan: EncodePlan, seqs: list[Encoded]) -> list[EncodeSpec]:
        if plan.spec.prompt_tokens and any(m != "text" for m in plan.modalities):
            unprompted = replace(plan.spec, prompt_tokens=0)  # the prompt prefixes texts only
            return [plan.spec if m == "text" else unprompted for m in plan.modalities]
        return [plan.spec] * len(seqs)

    def check_size(self, plan: EncodePlan, seqs: list[Encoded], max_result_bytes: int) -> None:
        per_item = [_item_bytes(plan.card, plan.spec, len(s)) for s in seqs]
        total = sum(per_item)
        if total <= max_result_bytes:
            return
        fits = max(1, int(max_result_bytes // max(per_item)))
        raise ResultTooLarge(
            f"the result would be about {total / 2**20:.1f} MiB, over this server's limit of "
            f"{max_result_bytes / 2**20:.1f} MiB: split the request into requests of at most {fits} items"
            + (" or ask for fewer outputs" if len(plan.spec.outputs) > 1 else ""),
            details={"estimated_bytes": int(total), "max_result_bytes": max_result_bytes, "max_items": fits},
        )

    def collect_off_loop(self, plan: EncodePlan, outputs: list) -> bool:
        return False  # vectors and scores: collecting them is cheap

    def collect(self, plan: EncodePlan, seqs: list[Encoded], outputs: list, timings: PhaseSeconds) -> EncodeResult:
        items = [msgspec.structs.replace(out, truncated=True) if s.truncated else out for out, s in zip(outputs, seqs)]
        return EncodeResult(
            items=items, num_tokens=sum(len(s) for s in seqs), request_id=plan.call.request_id, **timings
        )


class PromptTokens:
    """How many tokens a prompt puts at the start of each sequence, as sentence-transformers counts
    them (for pooling that leaves the prompt out): the prompt tokenized alone, less a trailing
    special token (the [SEP] or EOS that only ends the lone prompt). Short, and cached per
    tokenizer (entries go with the model's tokenizer), so it runs on the loop, not in the pool."""

    def __init__(self) -> None:
        self._counts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def count(self, tokenizer: TextTokenizer, prompt: str) -> int:
        counts = self._counts.setdefault(tokenizer, {})
        if prompt not in counts:
            ids = tokenizer.encode([prompt], truncate=True)[0].ids
            trailing_special = len(ids) > 0 and int(ids[-1]) in set(tokenizer.special_ids())
            counts[prompt] = len(ids) - trailing_special
        return counts[prompt]


def _item_bytes(card: ModelCard, spec: EncodeSpec, num_tokens: int) -> float:
    """Raw array bytes of one item's outputs (sparse: a bound from its length, as the exact count
    of non-zero terms is only known after the forward)."""
    size = 0.0
    if "dense" in spec.outputs:
        size += (spec.dimensions or card.dimensions or 0) * _DTYPE_BYTES[spec.output_dtype]
    if "sparse" in spec.outputs:
        terms = 8 * num_tokens + 128
        top_k = spec.sparse_top_k or card.sparse_spec.top_k
        if top_k:
            terms = min(terms, top_k)
        size += terms * (8 + (16 if spec.return_tokens else 0))
    if "multivector" in spec.outputs and card.multivector is not None:
        size += num_tokens * card.multivector.dim * 4
    if TOKEN_STATES in spec.outputs:
        size += num_tokens * (card.dimensions or 1024) * 4
    return size


def _spec(card: ModelCard, call: EncodeCall) -> EncodeSpec:
    if "encode" not in card.tasks:
        raise InvalidRequest(
            f"model {card.id} does not encode; it serves: {', '.join(card.tasks)}",
            details={"model": card.id, "tasks": list(card.tasks)},
        )
    if call.output_dtype not in _DTYPE_BYTES:
        raise InvalidRequest(
            f"output_dtype {call.output_dtype!r} is not one of {', '.join(_DTYPE_BYTES)}",
            details={"option": "output_dtype", "allowed": list(_DTYPE_BYTES)},
        )
    for option in ("dimensions", "sparse_top_k"):
        value = getattr(call, option)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise InvalidRequest(f"{option} must be an integer >= 1, not {value!r}", details={"option": option})
    outputs = tuple(dict.fromkeys(call.outputs)) if call.outputs else card.outputs[:1]
    # Every encoder has its token states (TEI's /embed_all), whatever heads its card lists, but
    # for one that pools itself (a dual encoder: one embedding per sequence).
    unsupported = [o for o in outputs if o not in card.outputs and (o != TOKEN_STATES or card.pooling == "model")]
    if unsupported:
        raise InvalidRequest(
            f"model {card.id} cannot produce {', '.join(unsupported)} output; "
            f"its card allows: {', '.join(card.outputs)}",
            details={"model": card.id, "option": "outputs", "allowed": list(card.outputs)},
        )
    if (
        call.dimensions is not None
        and card.dimensions is not None
        and "dense" in outputs
        and call.dimensions > card.dimensions
    ):
        raise InvalidRequest(
            f"model {card.id}: dimensions {call.dimensions} is larger than the model's {card.dimensions}",
            details={"model": card.id, "option": "dimensions", "max": card.dimensions},
        )
    normalize = card.normalize if call.normalize is None else call.normalize
    return EncodeSpec(
        normalize=normalize,
        dimensions=call.dimensions,
        output_dtype=call.output_dtype,
        outputs=outputs,
        is_query=bool(call.is_query),
        sparse_top_k=call.sparse_top_k,
        return_tokens=call.return_tokens,
    )


def prompt_of(card: ModelCard, prompt_name: str | None, is_query: bool | None) -> str:
    """The text prefix a request asks for (a prompt by name, or the query/document prompt); an
    unknown name is an InvalidRequest listing the card's prompts."""
    if prompt_name is not None and prompt_name not in card.prompts:
        allowed = ", ".join(sorted(card.prompts)) or "none"
        raise InvalidRequest(
            f"model {card.id} has no prompt {prompt_name!r}; its prompts: {allowed}",
            details={"model": card.id, "option": "prompt_name", "allowed": sorted(card.prompts)},
        )
    return card.prompt_for(prompt_name, is_query)
