"""A model folder's tokenizer as a `tokenizers.Tokenizer`, from whichever files the folder has.

`tokenizer.json` is read as it is. Its post-processor says which special tokens frame a text; since
transformers 5, `add_bos_token` / `add_eos_token` in tokenizer_config.json are dropped when a
tokenizer.json exists, so the file's post-processor alone decides (Qwen3-Embedding's appends
`<|endoftext|>`, which its last-token pooling reads; SmolLM2's adds nothing).

Repos with only a SentencePiece model (DeBERTa-v3's `spm.model`) are converted by transformers,
as its AutoTokenizer converts them (an optional dependency). Older BERT-family repos ship only
`vocab.txt`: a WordPiece tokenizer is built from it the way
transformers' `BertTokenizer` builds one, with `do_lower_case`, `strip_accents`,
`tokenize_chinese_chars` and the special tokens from tokenizer_config.json (falling back to
special_tokens_map.json, then BERT's defaults), framed `[CLS] A [SEP]` / `[CLS] A [SEP] B [SEP]`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import WordPiece

from ..errors import ModelLoadError

_BERT_SPECIALS = {
    "unk_token": "[UNK]",
    "sep_token": "[SEP]",
    "pad_token": "[PAD]",
    "cls_token": "[CLS]",
    "mask_token": "[MASK]",
}


def load_tokenizer(directory: Path) -> Tokenizer:
    """tokenizer.json if the folder has one, else a WordPiece tokenizer built from vocab.txt."""
    path = directory / "tokenizer.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    if (directory / "vocab.txt").is_file():
        return wordpiece_from_vocab(directory)
    if any((directory / name).is_file() for name in _SENTENCEPIECE):
        return from_sentencepiece(directory)
    raise ModelLoadError(
        f"{directory}: no tokenizer.json, vocab.txt or SentencePiece model to build a tokenizer from",
        details={"directory": str(directory)},
    )


# SentencePiece models of repos without a tokenizer.json (microsoft/deberta-v3-*: spm.model).
_SENTENCEPIECE = ("spm.model", "sentencepiece.bpe.model", "tokenizer.model")


def from_sentencepiece(directory: Path) -> Tokenizer:
    """The fast tokenizer transformers converts from the folder's SentencePiece model (as its
    AutoTokenizer does for such repos), which needs transformers and sentencepiece."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ModelLoadError(
            f"{directory} has only a SentencePiece model; converting it needs transformers and "
            "sentencepiece: pip install 'shoal[sentencepiece]'"
        ) from None
    try:
        converted = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        return Tokenizer.from_str(converted.backend_tokenizer.to_str())
    except Exception as exc:  # a missing sentencepiece/protobuf, or a model transformers cannot read
        raise ModelLoadError(
            f"{directory}: cannot convert its SentencePiece model ({type(exc).__name__}: {exc}); "
            "pip install 'shoal[sentencepiece]'"
        ) from None


def wordpiece_from_vocab(directory: Path) -> Tokenizer:
    config = _json(directory / "tokenizer_config.json")
    specials_map = _json(directory / "special_tokens_map.json")

    def special(name: str) -> AddedToken:
        return _added(config.get(name) or specials_map.get(name) or _BERT_SPECIALS[name])

    vocab = _read_vocab(directory / "vocab.txt")
    named = {name: special(name) for name in _BERT_SPECIALS}
    tokenizer = Tokenizer(
        WordPiece(
            vocab, unk_token=named["unk_token"].content, continuing_subword_prefix="##", max_input_chars_per_word=100
        )
    )
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True,
        handle_chinese_chars=bool(config.get("tokenize_chinese_chars", True)),
        strip_accents=config.get("strip_accents"),
        lowercase=bool(config.get("do_lower_case", True)),
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")

    # Tokens listed in added_tokens_decoder keep their own flags; the named and additional special
    # tokens are matched before normalisation, as transformers adds them.
    listed = [_added(t) for _, t in sorted(config.get("added_tokens_decoder", {}).items(), key=lambda kv: int(kv[0]))]
    extra = config.get("additional_special_tokens") or specials_map.get("additional_special_tokens") or []
    tokenizer.add_tokens([t for t in listed if not t.special])
    tokenizer.add_special_tokens([t for t in listed if t.special] + list(named.values()) + [_added(t) for t in extra])

    cls, sep = named["cls_token"].content, named["sep_token"].content
    ids = {token: tokenizer.token_to_id(token) for token in (cls, sep)}
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1", special_tokens=list(ids.items())
    )
    return tokenizer


def _read_vocab(path: Path) -> dict[str, int]:
    """One token a line, the line number its id (a repeated token keeps its last line, as
    transformers reads it); only the newline is stripped."""
    vocab: dict[str, int] = {}
    with open(path, encoding="utf-8") as lines:
        for index, line in enumerate(lines):
            vocab[line.rstrip("\n")] = index
    return vocab


def _added(token: Any) -> AddedToken:
    """A special token as tokenizer configs write it: a string, or an AddedToken's fields."""
    if isinstance(token, str):
        return AddedToken(token, special=True, normalized=False)
    if isinstance(token, dict) and isinstance(token.get("content"), str):
        return AddedToken(
            token["content"],
            single_word=bool(token.get("single_word", False)),
            lstrip=bool(token.get("lstrip", False)),
            rstrip=bool(token.get("rstrip", False)),
            normalized=bool(token.get("normalized", False)),
            special=bool(token.get("special", True)),
        )
    raise ModelLoadError(f"not a token: {token!r}")


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: {exc}", details={"file": str(path)}) from None
    return data if isinstance(data, dict) else {}
