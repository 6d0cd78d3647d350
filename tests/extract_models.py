"""Random-initialised extraction models built offline, saved as their libraries save them:
GLiNER span models (the `gliner` library) on a DeBERTa-v3-like backbone with a SentencePiece-style
Unigram tokenizer or on BERT with MiniLM's WordPiece, token classifiers and NLI cross-encoders
(transformers). Shared by the extract tests and bench/extract_throughput.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers

from rerankers import minilm_dir

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def training_corpus() -> list[str]:
    """Fixed English text to train test tokenizers on: the Lee corpus gensim's wheel ships (the
    repo's own docs change, and with them every random model built on such a tokenizer)."""
    import importlib.util

    spec = importlib.util.find_spec("gensim")
    path = Path(next(iter(spec.submodule_search_locations))) / "test" / "test_data" / "lee_background.cor"
    return [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]


def unigram_tokenizer(directory: Path) -> transformers.PreTrainedTokenizerFast:
    """A SentencePiece-style Unigram tokenizer (Metaspace "▁" word prefixes, [CLS] A [SEP]), as
    DeBERTa-v3's is, trained on a small fixed corpus so that words split into several pieces."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    corpus = training_corpus()
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    specials = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"]
    tok.train_from_iterator(
        corpus, trainers.UnigramTrainer(vocab_size=1500, special_tokens=specials, unk_token="[UNK]")
    )
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))],
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        unk_token="[UNK]",
        mask_token="[MASK]",
        model_max_length=512,
    )
    fast.save_pretrained(directory)
    return fast


def sentencepiece_backbone(directory: Path) -> int:
    """A folder laid out as microsoft/deberta-v3-* are: spm.model and tokenizer_config.json, no
    tokenizer.json (a SentencePiece Unigram model trained on a fixed corpus). Returns its size."""
    import io

    import sentencepiece

    corpus = training_corpus()
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_writer=model,
        vocab_size=1200,
        model_type="unigram",
        character_coverage=1.0,
        pad_id=0,
        unk_id=3,
        bos_id=1,
        eos_id=2,
        pad_piece="[PAD]",
        unk_piece="[UNK]",
        bos_piece="[CLS]",
        eos_piece="[SEP]",
        user_defined_symbols=["[MASK]"],
        minloglevel=2,
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "spm.model").write_bytes(model.getvalue())
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"do_lower_case": False, "vocab_type": "spm", "tokenizer_class": "DebertaV2Tokenizer"})
    )
    return len(transformers.AutoTokenizer.from_pretrained(str(directory)))


def wordpiece_tokenizer(directory: Path) -> transformers.PreTrainedTokenizerFast:
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(minilm_dir() / "tokenizer.json"),
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        unk_token="[UNK]",
        mask_token="[MASK]",
        model_max_length=512,
    )
    fast.save_pretrained(directory)
    return fast


def deberta_v3_config(vocab_size: int, **over) -> transformers.DebertaV2Config:
    return transformers.DebertaV2Config(
        vocab_size=vocab_size,
        max_position_embeddings=512,
        relative_attention=True,
        position_buckets=256,
        pos_att_type=["p2c", "c2p"],
        max_relative_positions=-1,
        position_biased_input=False,
        type_vocab_size=0,
        norm_rel_ebd="layer_norm",
        share_att_key=True,
        pad_token_id=0,
        **{**SMALL, **over},
    )


def spread(model: torch.nn.Module, seed: int) -> None:
    """Larger random weights than the initialisers', so that scores spread out (and differ)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name.lower() and name.endswith("weight"):
                param.copy_(torch.empty_like(param).uniform_(0.5, 1.5, generator=generator))
            elif name.endswith("bias") or "bias_" in name:
                param.copy_(torch.empty_like(param).normal_(0, 0.1, generator=generator))
            elif "embeddings" in name:
                param.copy_(torch.empty_like(param).normal_(0, 1.0, generator=generator))
            else:
                param.copy_(torch.empty_like(param).normal_(0, 1.5 / param.shape[-1] ** 0.5, generator=generator))


def build_gliner(
    directory: Path,
    backbone: str = "deberta-v3",
    seed: int = 0,
    hidden_size: int = 32,
    legacy_layout: bool = False,
    backbone_sizes: dict | None = None,
    tokenizer_kind: str | None = None,
    **gliner_config,
):
    """A random GLiNER span model saved with `save_pretrained` into `directory`; returns the
    in-memory reference model. `legacy_layout`: strip what the published v2.1 checkpoints lack
    (`encoder_config` in gliner_config.json, the tokenizer files), leaving the backbone folder at
    `directory.parent / (directory.name + "-backbone")` for the card's extract.backbone.
    `backbone_sizes`: overrides of the backbone's SMALL sizes (hidden_size, num_hidden_layers,
    num_attention_heads, intermediate_size), for benchmarks of a realistic size. `tokenizer_kind`:
    "unigram" (the DeBERTa-v3-style one trained on the Lee corpus, 1,500 pieces) or "wordpiece" (MiniLM's
    30k English vocabulary); unset: unigram for deberta-v3, wordpiece for bert."""
    from gliner import GLiNER
    from gliner.config import GLiNERConfig

    base = directory.parent / f"{directory.name}-backbone"
    sizes = {**SMALL, **(backbone_sizes or {})}
    if backbone == "deberta-v3-spm":  # as microsoft/deberta-v3-* ship: spm.model, no tokenizer.json
        deberta_v3_config(sentencepiece_backbone(base), **sizes).save_pretrained(base)
        backbone = kind = "spm"
    else:
        kind = tokenizer_kind or {"deberta-v3": "unigram", "bert": "wordpiece", "modernbert": "wordpiece"}.get(backbone)
        if kind not in ("unigram", "wordpiece"):
            raise ValueError(f"tokenizer_kind {tokenizer_kind!r} for backbone {backbone!r}")
        if backbone not in ("deberta-v3", "bert", "modernbert"):
            raise ValueError(f"backbone {backbone!r}")
        tokenizer = unigram_tokenizer(base) if kind == "unigram" else wordpiece_tokenizer(base)
    if backbone == "spm":
        pass
    elif backbone == "deberta-v3":
        deberta_v3_config(len(tokenizer), **sizes).save_pretrained(base)
    elif backbone == "modernbert":
        transformers.ModernBertConfig(
            vocab_size=len(tokenizer),
            max_position_embeddings=512,
            pad_token_id=0,
            cls_token_id=101,
            sep_token_id=102,
            bos_token_id=101,
            eos_token_id=102,
            global_attn_every_n_layers=2,
            local_attention=16,
            **sizes,
        ).save_pretrained(base)
    else:
        transformers.BertConfig(vocab_size=len(tokenizer), max_position_embeddings=512, **sizes).save_pretrained(base)
    gliner_config = {"max_width": 12, "span_mode": "markerV0", **gliner_config}
    config = GLiNERConfig(model_name=str(base), hidden_size=hidden_size, dropout=0.0, **gliner_config)
    torch.manual_seed(seed)
    model = GLiNER.from_config(config, backbone_from_pretrained=False, local_files_only=True)
    spread(model.model, seed)
    model.eval()
    model.save_pretrained(directory)
    if legacy_layout:
        path = directory / "gliner_config.json"
        saved = json.loads(path.read_text())
        saved.pop("encoder_config", None)
        path.write_text(json.dumps(saved, indent=2))
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"):
            (directory / name).unlink(missing_ok=True)
    return model


def gliner_card(directory: Path, model_id: str = "test/gliner", backbone: Path | None = None, **extract) -> str:
    fields = "".join(f", {k}: {v}" for k, v in extract.items())
    backbone_field = f", backbone: {{path: {backbone}}}" if backbone else ""
    return f"""
id: {model_id}
tasks: [extract]
extract: {{kind: gliner{backbone_field}{fields}}}
source: {{path: {directory}}}
max_length: 512
"""


TOKEN_LABELS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]


def build_token_classifier(directory: Path, seed: int = 0, max_positions: int = 512):
    tokenizer = wordpiece_tokenizer(directory)
    config = transformers.BertConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=max_positions,
        id2label=dict(enumerate(TOKEN_LABELS)),
        label2id={label: i for i, label in enumerate(TOKEN_LABELS)},
        **SMALL,
    )
    torch.manual_seed(seed)
    model = transformers.BertForTokenClassification(config).eval()
    spread(model, seed)
    model.save_pretrained(directory)
    return model, tokenizer


def build_nli(directory: Path, labels: list[str], seed: int = 0):
    """A random DeBERTa-v3-like NLI cross-encoder (DebertaV2ForSequenceClassification)."""
    tokenizer = unigram_tokenizer(directory)
    config = deberta_v3_config(
        len(tokenizer), id2label=dict(enumerate(labels)), label2id={label: i for i, label in enumerate(labels)}
    )
    torch.manual_seed(seed)
    model = transformers.DebertaV2ForSequenceClassification(config).eval()
    spread(model, seed)
    model.save_pretrained(directory)
    return model, tokenizer


def extract_card(directory: Path, model_id: str, kind: str, max_length: int = 512, **extract) -> str:
    fields = "".join(f", {k}: {v}" for k, v in extract.items())
    return f"""
id: {model_id}
tasks: [extract]
extract: {{kind: {kind}{fields}}}
source: {{path: {directory}}}
max_length: {max_length}
"""


def copy_tree(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, dirs_exist_ok=True)
