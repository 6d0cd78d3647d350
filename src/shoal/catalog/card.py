"""Model cards: one YAML file per model, validated on load.

A card says where the weights come from, how to tokenize, how to pool and normalise, which prompts
exist, what the model can output and how it was verified. Errors name the file and the field.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from ..errors import CardError
from .card_parts import Extract, Generate, Multivector, Score, Source, Sparse

_HARDWARE_CLASS = re.compile(r"cpu(:[\w .-]+(\+[\w-]+)?)?|cuda(:[\w .-]+)?")

# model: the model pools itself, one embedding per sequence (a dual encoder such as CLIP: each
# tower's projected embedding).
Pooling = Literal["cls", "mean", "last", "model"]
Output = Literal["dense", "sparse", "multivector"]
# The verbs a model serves; each has its own required card fields (see `_check`).
Task = Literal["encode", "score", "extract", "generate"]
# What a request's items may be (calls.Modality).
Modality = Literal["text", "image"]
# real_weights: compared with its reference on the real weights, in shoal's tests.
# random_weights: only its architecture's parity test (random-initialised) covers it.
# unverified: a user's card that no shoal test exercises.
Verified = Literal["real_weights", "random_weights", "unverified"]


# What a CPU's feed-forward row blocks hold when `Batching.row_block_bytes` is unset (layers/rows.py):
# 512 rows of MiniLM's 1,536-float intermediate, 256 of BERT-base's 3,072.
ROW_BLOCK_BYTES = 3 << 20


class Batching(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Batch limits measured for one hardware class (see `ModelCard.batching`); unset fields fall
    back to the engine's settings."""

    max_batch_tokens: int | None = None
    max_batch_items: int | None = None
    # How long an idle device waits for more of this model's work before cutting a batch smaller
    # than the limits (more texts per forward, at this much added latency); None or 0: no wait.
    batch_wait_ms: float | None = None
    # Torch intra-op threads for this model's forwards on the device thread; None: torch's default.
    threads: int | None = None
    # Batches of fewer tokens than this run on one torch thread fewer than `threads` (at least one),
    # leaving a core to the HTTP side (event loop, tokenizing, answers) when the work comes as many
    # small requests; 0: off; None: SMALL_BATCH_TOKENS.
    small_batch_tokens: int | None = None
    # The card's `quantize` on this hardware class (a kernel choice `shoal tune` can make): "int8",
    # "int4" (generating cards) or "none" (float32 Linears); None: the card's own.
    quantize: Literal["int8", "int4", "none"] | None = None
    # The CPU path of full attention over unequal lengths (layers/attention.py): "each" sequence on
    # its own, or "padded" length groups; None: each.
    attention: Literal["each", "padded"] | None = None
    # CPU only: each layer's feed-forward block runs a block of rows at a time, as many as keep its
    # widest intermediate within this many bytes (layers/rows.py); 0: the whole batch in one call;
    # None: ROW_BLOCK_BYTES (3 MiB: 512 MiniLM tokens, 256 BERT-base ones).
    row_block_bytes: int | None = None
    # CPU only: the card's `dtype` on this hardware class ("float32" keeps a card whose `precisions`
    # list bfloat16 in float32 here; "bfloat16" runs it so, as `shoal tune` may choose); None: the
    # card's own, or bfloat16 by default where its `precisions` allow (engine/precision.py).
    dtype: Literal["float32", "bfloat16"] | None = None

    def over(self, base: Batching) -> Batching:
        """These limits, with `base`'s where these are unset."""
        return Batching(
            **{
                f: getattr(self, f) if getattr(self, f) is not None else getattr(base, f)
                for f in self.__struct_fields__
            }
        )


class Tuned(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A tuned overlay (`shoal tune` writes one per model and hardware class, in a models
    directory's `tuned/` folder): `batching` replaces the card's for `hardware`, field by field;
    `measured` records what the tuning run measured (free-form, for people)."""

    model: str
    hardware: str
    batching: Batching
    measured: dict[str, Any] = {}


class ModelCard(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    id: str
    source: Source
    max_length: int
    architecture: str | None = None
    # Omitted: encode and score (an encoder scores by its outputs); a reranker card says [score].
    tasks: tuple[Task, ...] = ("encode", "score")
    # What the model reads: a request's items of another modality are refused, by item.
    modalities: tuple[Modality, ...] = ("text",)
    # Tokens one image costs in every budget (a ViT's patches, plus its class token, if any);
    # cards that read images give it (the gateway and admission count from it).
    image_tokens: int | None = None
    # A vision-language model's text around an image, one "<image>" where the image's tokens go
    # (ColIdefics3: "<|im_start|>User:<image>Describe the image.<end_of_utterance>\nAssistant:").
    image_prompt: str | None = None
    # Required where the model produces dense vectors (`dense` in outputs), else unused.
    pooling: Pooling | None = None
    dimensions: int | None = None
    normalize: bool = True
    # What the model can produce; the first is what a request gets when it names none.
    outputs: tuple[Output, ...] = ("dense",)
    sparse: Sparse | None = None
    multivector: Multivector | None = None
    # Rerankers (tasks: [score]); cards without it score by their encoder outputs.
    score: Score | None = None
    # Extraction models (tasks: [extract]).
    extract: Extract | None = None
    # Decoders that generate text (tasks: [generate], and [extract] with extract kind generate).
    generate: Generate | None = None
    matryoshka_dims: tuple[int, ...] = ()
    prompts: dict[str, str] = {}
    # The prompt names used for `is_query: true` / `false`, when the model has them.
    query_prompt: str | None = None
    document_prompt: str | None = None
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    # int8: the encoder's Linears run int8 x int8 on a CPU (layers/int8.py: weights per output row,
    # activations per token), about a quarter of their float32 bytes; heads stay float32. int4 (cards
    # with a generate block): the decoder's Linears hold 4-bit weights in groups of 32 (layers/int4.py),
    # an eighth of their float32 bytes, multiplied with bfloat16 activations. Either needs dtype
    # float32; a load on a CUDA device is refused.
    quantize: Literal["int8", "int4"] | None = None
    # Reduced precisions the model passed the quality gate in (tests/test_precision_gate.py, on real
    # text: cosine to float32 >= 0.99 on every item, Lee Spearman within 0.005, score order Kendall
    # tau >= 0.98): a float32 card listing bfloat16 runs bfloat16 on a CPU that has it natively
    # (AMX, AVX512-BF16) unless the server is started with reduced_precision false.
    precisions: tuple[Literal["bfloat16"], ...] = ()
    # Batch limits per hardware class ("cpu", "cuda", or a specific one such as "cuda:H200"),
    # written by hand or by `shoal tune`; the engine falls back to its own settings.
    batching: dict[str, Batching] = {}
    verified: Verified = "unverified"
    description: str = ""
    # Residency: load before serving (`preload`), never evict (`pin`) — on a server whose
    # `--models` admits the card (built-in cards set neither).
    preload: bool = False
    pin: bool = False
    # Other names clients may send as `model` (e.g. an OpenAI model name for a client that only
    # takes those); `--alias NAME=MODEL` adds more at start.
    aliases: tuple[str, ...] = ()
    # PEFT LoRA adapters a request may select (`adapter: NAME`): name -> adapter folder (holding
    # adapter_config.json), relative to the card's file. Adapter folders found under a server's
    # adapters directories are added to these.
    adapters: dict[str, str] = {}
    # The file this card was read from (filled in by the loader).
    card_path: str | None = None

    def adapter_dirs(self) -> dict[str, Path]:
        """The card's adapters: name -> folder (relative paths resolved against the card's file)."""
        base = Path(self.card_path).parent if self.card_path else Path.cwd()
        return {name: (base / path).expanduser() for name, path in self.adapters.items()}

    def batching_for(self, hardware: str) -> Batching:
        """Limits for `hardware` ("cuda:H200", "cpu:AMD EPYC+avx2"), field by field over those for
        the CPU's model name alone ("cpu:AMD EPYC"), over those for its kind ("cuda", "cpu"); unset
        fields are None (the engine's settings apply)."""
        kind = hardware.split(":", 1)[0]
        chain = [kind]
        if kind == "cpu" and "+" in hardware:
            chain.append(hardware.rsplit("+", 1)[0])
        if hardware not in chain:
            chain.append(hardware)
        limits = Batching()
        for key in chain:
            if key in self.batching:
                limits = self.batching[key].over(limits)
        return limits

    def quantize_for(self, hardware: str) -> ModelCard:
        """This card with the `quantize` its limits for `hardware` choose (`batching_for`), if any."""
        chosen = self.batching_for(hardware).quantize
        if chosen is None or chosen == (self.quantize or "none"):
            return self
        return msgspec.structs.replace(self, quantize=None if chosen == "none" else chosen)

    def with_tuned(self, tuned: Tuned) -> ModelCard:
        """This card with a tuned overlay's limits over its own for the overlay's hardware class."""
        if tuned.batching == Batching():  # a tuning run that kept the card's limits changes nothing
            return self
        own = self.batching.get(tuned.hardware) or Batching()
        return msgspec.structs.replace(self, batching={**self.batching, tuned.hardware: tuned.batching.over(own)})

    @property
    def sparse_spec(self) -> Sparse:
        return self.sparse or Sparse()

    def prompt_for(self, prompt_name: str | None, is_query: bool | None) -> str:
        """The text prefix for a request; raises CardError's sibling InvalidRequest upstream."""
        if prompt_name is not None:
            return self.prompts[prompt_name]
        if is_query is True and self.query_prompt:
            return self.prompts[self.query_prompt]
        if is_query is False and self.document_prompt:
            return self.prompts[self.document_prompt]
        return ""


def parse_card(data: object, origin: str) -> ModelCard:
    """Validate a decoded YAML document as a card; `origin` names it in errors."""
    if not isinstance(data, dict):
        raise CardError(f"{origin}: a model card must be a mapping, got {type(data).__name__}")
    try:
        card = msgspec.convert(data, ModelCard)
    except msgspec.ValidationError as exc:
        path = str(exc).rpartition("- at `$")[2].rstrip("`")  # e.g. ".batching.max_batch_items"
        details = {"file": origin, "field": path.lstrip(".")} if path != str(exc) else {"file": origin}
        raise CardError(f"{origin}: {exc}", details=details) from None
    _check(card, origin)
    return msgspec.structs.replace(card, card_path=origin)


def load_card(path: Path) -> ModelCard:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise CardError(f"{path}: cannot read model card: {exc}", details={"file": str(path)}) from None
    return parse_card(data, str(path))


def _check(card: ModelCard, origin: str) -> None:
    def fail(field: str, message: str) -> None:
        raise CardError(f"{origin}: `{field}` {message}", details={"file": origin, "field": field})

    if not (card.source.hub or card.source.path or card.source.package or card.source.package_parts):
        fail("source", "needs at least one of hub, path, package or package_parts")
    if card.max_length < 1:
        fail("max_length", "must be >= 1")
    if not card.tasks:
        fail("tasks", "must list at least one of encode, score, extract, generate")
    if "encode" in card.tasks and not card.outputs:
        fail("outputs", "must list at least one of dense, sparse, multivector")
    if not card.modalities or len(set(card.modalities)) != len(card.modalities):
        fail("modalities", "must list each of text, image at most once, and at least one")
    if ("image" in card.modalities) != (card.image_tokens is not None):
        fail("image_tokens", "and `modalities: [..., image]` go together: the tokens one image costs")
    if card.image_tokens is not None and card.image_tokens < 1:
        fail("image_tokens", "must be >= 1")
    if card.image_prompt is not None and (card.image_prompt.count("<image>") != 1 or "image" not in card.modalities):
        fail("image_prompt", "must hold exactly one <image>, on a card whose modalities include image")
    if card.score is not None and "encode" in card.tasks:
        fail("score", "is for rerankers, which serve only score: set `tasks: [score]`")
    if "score" in card.tasks and "encode" not in card.tasks and card.score is None:
        fail("score", "is required when a model serves score without encode (kind cross_encoder or llm)")
    if card.score is not None and card.score.kind == "llm":
        for token in ("{query}", "{document}"):
            if token not in card.score.template:
                fail("score.template", f"must contain {token}")
    if ("extract" in card.tasks) != (card.extract is not None):
        fail(
            "extract",
            "and `tasks: [extract]` go together: an extraction model needs an extract block "
            "(kind gliner, token_class, zero_shot or classify)",
        )
    if card.extract is not None:
        ex = card.extract
        if ex.kind == "image_labels":  # a dual encoder that also encodes and scores
            if "image" not in card.modalities or "dense" not in card.outputs:
                fail("extract.kind", "image_labels needs a card that reads images into dense vectors")
        elif "encode" in card.tasks or "score" in card.tasks:
            fail("tasks", "of an extraction model is [extract] (and generate, for kind generate)")
        if ex.threshold is not None and not 0.0 <= ex.threshold <= 1.0:
            fail("extract.threshold", "must be between 0 and 1")
        if ex.max_words is not None and ex.max_words < 1:
            fail("extract.max_words", "must be >= 1")
        if ex.window_overlap_words < 0 or ex.window_overlap_tokens < 0:
            fail("extract", "window overlaps must be >= 0")
        try:
            placed = ex.hypothesis_template.format("\x00").count("\x00")
        except (IndexError, KeyError, ValueError):
            placed = 0
        if placed != 1:
            fail("extract.hypothesis_template", "must contain {} exactly once (where the label goes)")
        if ex.backbone is not None:
            b = ex.backbone
            if not (b.hub or b.path) or b.package or b.package_parts or b.onnx:
                fail(
                    "extract.backbone",
                    "takes hub (and revision) or path: where the backbone's config.json and tokenizer are",
                )
        if ex.kind not in ("gliner", "glirel") and ex.backbone is not None:
            fail("extract.backbone", "applies to kinds gliner and glirel")
        if ex.kind != "gliner" and ex.lowercase_labels:
            fail("extract.lowercase_labels", "applies to kind gliner")
    generates = "generate" in card.tasks or (card.extract is not None and card.extract.kind == "generate")
    if generates != (card.generate is not None):
        fail("generate", "and `tasks: [generate]` (or extract kind generate) go together: a decoder's generation block")
    if card.generate is not None:
        g = card.generate
        if g.slots < 1 or g.max_new_tokens < 1:
            fail("generate", "slots and max_new_tokens must be >= 1")
        if g.cache_positions is not None and g.cache_positions < card.max_length:
            fail("generate.cache_positions", "must hold at least one sequence of max_length positions")
        if g.extract_prompt.count("{text}") != 1:
            fail("generate.extract_prompt", "must contain {text} exactly once (where the text goes)")
        if g.max_new_tokens >= card.max_length:
            fail("generate.max_new_tokens", "must be below max_length (the context holds the prompt too)")
        if "encode" in card.tasks or "score" in card.tasks:
            fail("tasks", "of a generating model are generate and extract")
    if "dense" in card.outputs and "encode" in card.tasks:
        if card.pooling is None:
            fail("pooling", "is required when outputs has dense (cls, mean, last or model)")
        if card.dimensions is None:
            fail("dimensions", "is required when outputs has dense")
    if card.source.gguf and not card.source.package:
        fail("source.gguf", "applies to a package source (the folder that holds the GGUF file)")
    if card.source.onnx and not (card.source.package or card.source.path):
        fail("source.onnx", "applies to a package or path source (a folder that holds the ONNX file)")
    for where, chosen, dtype in [("quantize", card.quantize, card.dtype)] + [
        (f"batching.{hw}.{'quantize' if b.quantize else 'dtype'}", b.quantize or card.quantize, b.dtype or card.dtype)
        for hw, b in card.batching.items()
    ]:
        if dtype != "float32" and chosen in ("int8", "int4"):
            fail(
                where,
                f"{chosen} runs with float32 activations, not dtype {dtype}: "
                "leave dtype unset (float32) or drop quantize",
            )
        if chosen == "int4" and card.generate is None:
            fail(where, "int4 is for generating cards (a decode step's 4-bit weights): use int8 for this model")
    if card.dimensions is not None and card.dimensions < 1:
        fail("dimensions", "must be >= 1")
    if "multivector" in card.outputs and card.multivector is None:
        fail("multivector", "is required when outputs has multivector (at least `dim`)")
    if card.sparse is not None and card.sparse.kind == "token_weights" and not card.sparse.weight:
        fail("sparse.weight", "is required for kind token_weights")
    for dim in card.matryoshka_dims:
        if card.dimensions is None or not 1 <= dim <= card.dimensions:
            fail("matryoshka_dims", f"has {dim}, outside 1..{card.dimensions}")
    for name in ("query_prompt", "document_prompt"):
        value = getattr(card, name)
        if value is not None and value not in card.prompts:
            fail(name, f"names prompt {value!r}, which `prompts` does not define")
    for hardware, limits in card.batching.items():
        _check_batching(hardware, limits, fail)


def _check_batching(hardware: str, limits: Batching, fail: Callable[[str, str], None]) -> None:
    if not _HARDWARE_CLASS.fullmatch(hardware):
        fail(
            f"batching.{hardware}",
            "is not a hardware class: use cpu, cpu:<CPU model>, cpu:<CPU model>+<ISA>, cuda or cuda:<device name>",
        )
    for name in ("max_batch_tokens", "max_batch_items", "threads"):
        value = getattr(limits, name)
        if value is not None and value < 1:
            fail(f"batching.{hardware}.{name}", "must be >= 1")
    if limits.small_batch_tokens is not None and limits.small_batch_tokens < 0:
        fail(f"batching.{hardware}.small_batch_tokens", "must be >= 0 (0: every batch on `threads`)")
    if limits.row_block_bytes is not None and limits.row_block_bytes < 0:
        fail(f"batching.{hardware}.row_block_bytes", "must be >= 0 (0: each feed-forward over the whole batch at once)")
    if limits.row_block_bytes is not None and not hardware.startswith("cpu"):
        fail(
            f"batching.{hardware}.row_block_bytes",
            "row blocks run on CPUs only (on a GPU one launch over the "
            "batch is what is fast): set it for cpu or cpu:<CPU model>",
        )
    if limits.threads is not None and limits.threads > 1024:
        fail(f"batching.{hardware}.threads", "must be <= 1024")
    if limits.batch_wait_ms is not None and not 0 <= limits.batch_wait_ms <= 1000:
        fail(f"batching.{hardware}.batch_wait_ms", "must be between 0 and 1000")
    if limits.dtype is not None and not hardware.startswith("cpu"):
        fail(
            f"batching.{hardware}.dtype",
            "chooses a CPU's precision: set it for cpu or cpu:<CPU model> (a GPU runs the card's dtype, "
            "or bfloat16 where its `precisions` list it)",
        )
    if limits.quantize in ("int8", "int4") and limits.dtype not in (None, "float32"):
        fail(f"batching.{hardware}.dtype", f"{limits.quantize} runs with float32 activations: drop dtype or quantize")
    if limits.quantize is not None and not hardware.startswith("cpu"):
        fail(
            f"batching.{hardware}.quantize",
            f"{limits.quantize} runs on CPUs only (its products are CPU kernels): "
            "set quantize for cpu or cpu:<CPU model>",
        )


def check_batching(hardware: str, limits: Batching, origin: str) -> None:
    """`limits` for `hardware` are valid (else CardError naming `origin` and the field)."""

    def fail(field: str, message: str) -> None:
        raise CardError(f"{origin}: `{field}` {message}", details={"file": origin, "field": field})

    _check_batching(hardware, limits, fail)


def load_tuned(path: Path) -> Tuned:
    """A tuned overlay file, validated (CardError names the file and field)."""

    def fail(field: str, message: str) -> None:
        raise CardError(f"{path}: `{field}` {message}", details={"file": str(path), "field": field})

    try:
        tuned = msgspec.convert(yaml.safe_load(path.read_text()), Tuned)
    except (OSError, yaml.YAMLError, msgspec.ValidationError) as exc:
        raise CardError(f"{path}: cannot read tuned overlay: {exc}", details={"file": str(path)}) from None
    _check_batching(tuned.hardware, tuned.batching, fail)
    return tuned
