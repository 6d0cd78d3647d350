"""The text preprocessor: a model's tokenizer with its special tokens, truncation, pairs, word
windows and the query/document variants late interaction needs (the pool that runs it off the
event loop is engine/tokenizer_pool.py).

Texts are cut to a character bound derived from `max_length` before they are tokenized, so an
8 MiB text costs what its kept tokens cost. The cut falls on whitespace where it can; if a cut
text yields no more than `max_length` tokens (the bound was too tight for it: long runs of spaces,
say) it is tokenized again from a longer cut, so cutting never changes which tokens are kept.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import numpy as np
from tokenizers import Tokenizer

from ..errors import InputTooLong, InvalidRequest, ModelLoadError
from .tokenizer_files import load_tokenizer
from .types import Encoded

# Characters kept per token of `max_length` before tokenizing (English runs ~4-5 per token).
CHARS_PER_TOKEN_BOUND = 10
# A cut is widened (x4 at a time) at most to this many times its first bound: pathological text
# (megabytes without a space) then costs a bounded amount, and keeps a cut of that length.
WIDEN_LIMIT = 256
# Texts per tokenizer job: a bulk request is tokenized in turns with the others, and stops when
# its caller goes away.
TEXTS_PER_JOB = 64


def _pad_id(directory: Path, tokenizer: Tokenizer) -> int:
    """The pad token's id: tokenizer_config.json's `pad_token`, else a `<pad>` or `[PAD]` token."""
    names = []
    try:
        named = json.loads((directory / "tokenizer_config.json").read_text()).get("pad_token")
        names.append(named["content"] if isinstance(named, dict) else named)
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        pass  # no config, or no pad_token in it: the usual names below
    for name in [*names, "<pad>", "[PAD]"]:
        if isinstance(name, str) and (token_id := tokenizer.token_to_id(name)) is not None:
            return token_id
    raise ModelLoadError(
        f"{directory}: the model pads its texts, and its tokenizer has no pad token",
        details={"directory": str(directory)},
    )


class TextTokenizer:
    """A model's tokenizer with its special tokens and truncation at `max_length` tokens.

    Late-interaction models also shape the ids: `marker_id` goes right after the first token
    ([CLS] [Q] ...), and `expand_to` pads the sequence with `expand_id` up to that length (ColBERT's
    query augmentation with [MASK]). Both stay within `max_length`. Expansion tokens are attended
    to only when `attend_to_expansion`.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_length: int,
        *,
        marker_id: int | None = None,
        expand_to: int | None = None,
        expand_id: int | None = None,
        attend_to_expansion: bool = False,
        text_suffix: str = "",
    ) -> None:
        self.max_length = max_length
        self.text_suffix = text_suffix  # appended to each single text before it is tokenized
        self.marker_id = marker_id
        self.expand_to = min(expand_to, max_length) if expand_to else None
        self.expand_id = expand_id
        self.attend_to_expansion = attend_to_expansion
        self.max_chars = max_length * CHARS_PER_TOKEN_BOUND + 64
        self._tokenizer = tokenizer
        self._budget = max_length - (marker_id is not None)  # tokens the tokenizer itself may emit
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=self._budget)
        self._pair_tokenizers: OrderedDict[tuple[int, str], Tokenizer] = OrderedDict()
        self._plain: Tokenizer | None = None
        self._pair_lock = threading.Lock()

    @classmethod
    def from_dir(cls, directory: Path, max_length: int, *, pad: bool = False) -> TextTokenizer:
        """The folder's tokenizer.json, or one built from its vocab.txt (`tokenizer_files`).
        `pad`: every sequence is padded with the pad token to `max_length`, as SigLIP's processor
        pads its texts; the pads get outputs (SigLIP pools the last position) but are attended to
        by none, as transformers masks them."""
        tokenizer = load_tokenizer(directory)
        if not pad:
            return cls(tokenizer, max_length)
        pad_id = _pad_id(directory, tokenizer)
        return cls(tokenizer, max_length, expand_to=max_length, expand_id=pad_id)

    def variant(
        self,
        max_length: int,
        *,
        marker: str | None = None,
        expand_to: int | None = None,
        expand_token: str | None = None,
        attend_to_expansion: bool = False,
        text_suffix: str = "",
    ) -> TextTokenizer:
        """A copy with its own truncation, marker, expansion and text suffix (the original is shared
        by threads)."""
        clone = Tokenizer.from_str(self._tokenizer.to_str())
        return TextTokenizer(
            clone,
            max_length,
            marker_id=self.token_id(marker) if marker else None,
            expand_to=expand_to,
            expand_id=self.token_id(expand_token) if expand_token else None,
            attend_to_expansion=attend_to_expansion,
            text_suffix=text_suffix,
        )

    def token_ids(self, tokens) -> list[int]:
        """Ids of those `tokens` that are in the vocabulary (others are skipped)."""
        return [i for i in map(self._tokenizer.token_to_id, tokens) if i is not None]

    def token_id(self, token: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ModelLoadError(f"token {token!r} is not in the model's vocabulary")
        return token_id

    def token(self, token_id: int) -> str:
        return self._tokenizer.id_to_token(int(token_id)) or ""

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def special_ids(self) -> list[int]:
        return sorted(i for i, tok in self._tokenizer.get_added_tokens_decoder().items() if tok.special)

    def tokens(
        self, texts: list[str], add_special_tokens: bool = True
    ) -> list[list[tuple[int, str, bool, int | None, int | None]]]:
        """(id, text, special, start, stop) per token of each text (TEI's /tokenize), cut at
        `max_length` as `encode` cuts: a special token's text is the token itself and it has no
        offsets; another's text is its slice of the text."""
        _, encodings = self._cut_encode(texts, add_special_tokens, first_index=0, what="inputs")
        out = []
        for text, encoding in zip(texts, encodings):
            rows: list[tuple[int, str, bool, int | None, int | None]] = []
            for token_id, token, special, (start, stop) in zip(
                encoding.ids, encoding.tokens, encoding.special_tokens_mask, encoding.offsets
            ):
                if special:
                    rows.append((int(token_id), token, True, None, None))
                else:
                    rows.append((int(token_id), text[start:stop], False, int(start), int(stop)))
            out.append(rows)
        return out

    def decode(self, sequences: list[list[int]], skip_special_tokens: bool = True, first_index: int = 0) -> list[str]:
        """Each sequence of ids as text (TEI's /decode); an id outside the vocabulary is refused,
        naming it (`first_index`: the index of `sequences[0]` in its request)."""
        size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        for i, ids in enumerate(sequences, start=first_index):
            for j, token_id in enumerate(ids):
                if token_id >= size:
                    raise InvalidRequest(
                        f"token id {token_id} (sequence {i}, position {j}) is not in the model's vocabulary "
                        f"(ids 0 to {size - 1})",
                        details={"sequence": i, "position": j, "vocab_size": size},
                    )
        return self._tokenizer.decode_batch(sequences, skip_special_tokens=skip_special_tokens)

    # --- encoding -------------------------------------------------------------------------------

    modality = "text"

    def prepare(self, values: Sequence[str], truncate: bool, *, first_index: int, what: str) -> list[Encoded]:
        """The text preprocessor's side of `backend.Preprocessor`: `encode` of single texts."""
        return self.encode(list(values), truncate, first_index=first_index, what=what)

    def encode(
        self,
        texts: list[str],
        truncate: bool,
        *,
        pairs: list[str] | None = None,
        with_offsets: bool = False,
        first_index: int | None = 0,
        what: str = "items",
        cut_first: bool = False,
    ) -> list[Encoded]:
        """One sequence per text (or per `(texts[i], pairs[i])` pair), special tokens included,
        each at most `max_length` tokens. A pair is truncated from its second text only (from its
        first, `cut_first`: an NLI premise before its hypothesis).
        `first_index`: the index of `texts[0]` in its request, for error messages."""
        if pairs is not None:
            return self._encode_pairs(texts, pairs, truncate, with_offsets, first_index, cut_first)
        if self.text_suffix:
            texts = [text + self.text_suffix for text in texts]
        cut, encodings = self._cut_encode(texts, True, first_index=first_index, what=what)
        if not truncate:
            self._refuse_overflow(encodings, what, first_index)
        return [
            self._shape(enc, with_offsets, pair=False, truncated=bool(enc.overflowing) or c is not t)
            for enc, c, t in zip(encodings, cut, texts)
        ]

    def _cut_encode(
        self, texts: list[str], add_special_tokens: bool, *, first_index: int | None, what: str
    ) -> tuple[list[str], list]:
        """Each text cut to the character bound (see the module's docstring), and its encoding.
        Only `encode_batch` lets go of the GIL while it runs, so a long text never holds the
        event loop's thread. A text whose widest cut still may differ from the whole is refused
        (`_refuse_uncuttable`)."""
        cut = [t if len(t) <= self.max_chars else _cut(t, self.max_chars) for t in texts]
        encodings = self._tokenizer.encode_batch(cut, add_special_tokens=add_special_tokens)
        for index, text in enumerate(texts):
            bound = self.max_chars
            # A cut text that kept too few tokens, or whose kept tokens reach into a word the cut
            # split, may differ from the full text's: widen (up to WIDEN_LIMIT x the bound).
            while (
                cut[index] is not text
                and _needs_wider(cut[index], encodings[index])
                and bound < self.max_chars * WIDEN_LIMIT
            ):
                bound *= 4
                cut[index] = text if len(text) <= bound else _cut(text, bound)
                encodings[index] = _encode(self._tokenizer, cut[index], add_special_tokens=add_special_tokens)
            if cut[index] is not text and _needs_wider(cut[index], encodings[index]):
                self._refuse_uncuttable(len(cut[index]), what, index + (first_index or 0), first_index)
        return cut, encodings

    def _refuse_uncuttable(self, kept_chars: int, what: str, index: int, first_index: int | None) -> NoReturn:
        """InputTooLong for a text whose first `kept_chars` characters (the widest cut) hold fewer
        than `max_length` tokens: its tokens past them are unknown without tokenizing all of it,
        and a vector of the fragment would be silently wrong."""
        name = what if first_index is None else f"{what}[{index}]"
        raise InputTooLong(
            f"{name}: its first {kept_chars} characters hold fewer than the model's {self.max_length} "
            "tokens (long runs of whitespace or of characters the tokenizer drops), so it cannot be cut "
            "at the model's limit safely; remove them, or send only the part to embed",
            details={"index": index, "max_length": self.max_length, "kept_characters": kept_chars},
        )

    def _refuse_overflow(self, encodings: list, what: str, first_index: int | None) -> None:
        """InputTooLong naming `what[i]` (or `what` alone, when `first_index` is None)."""
        for index, enc in enumerate(encodings, start=first_index or 0):
            if enc.overflowing:
                name = what if first_index is None else f"{what}[{index}]"
                raise InputTooLong(
                    f"{name} is longer than the model's max_length of {self.max_length} tokens; "
                    "shorten it or send truncate: true",
                    details={"index": index, "max_length": self.max_length},
                )

    def _encode_pairs(
        self,
        firsts: list[str],
        seconds: list[str],
        truncate: bool,
        with_offsets: bool,
        first_index: int | None,
        cut_first: bool = False,
    ) -> list[Encoded]:
        """Pairs truncated from their second text (from their first, `cut_first`)."""
        cut = 0 if cut_first else 1  # which text of the pair is truncated
        tokenizer = self._pair_variant(strategy="only_first" if cut_first else "only_second")
        bound = self.max_chars
        texts = (firsts, seconds)
        inputs = [
            (a if len(a) <= bound else _cut(a, bound), b if len(b) <= bound else _cut(b, bound))
            for a, b in zip(firsts, seconds)
        ]
        try:
            encodings = tokenizer.encode_batch(inputs, add_special_tokens=True)
            for index, pair in enumerate(inputs):
                # As for single texts: a cut text whose kept tokens may differ from the whole
                # text's is tokenized again from a wider cut.
                whole, wider, parts = texts[cut][index], bound, list(pair)
                while (
                    parts[cut] is not whole
                    and _needs_wider(parts[cut], encodings[index], sequence=cut)
                    and wider < bound * WIDEN_LIMIT
                ):
                    wider *= 4
                    parts[cut] = whole if len(whole) <= wider else _cut(whole, wider)
                    inputs[index] = (parts[0], parts[1])
                    encodings[index] = _encode(tokenizer, (parts[0], parts[1]), add_special_tokens=True)
                if parts[cut] is not whole and _needs_wider(parts[cut], encodings[index], sequence=cut):
                    raise _Uncuttable(index, len(parts[cut]))
        except _Uncuttable as exc:
            self._refuse_uncuttable(
                exc.kept_chars, "texts" if cut_first else "documents", exc.index + (first_index or 0), first_index
            )
        except Exception as exc:  # tokenizers refuses when the text kept whole alone is too long
            kept = "hypothesis" if cut_first else "first text"
            raise InputTooLong(
                f"a {kept} of a pair leaves no room for the other within {self.max_length} tokens: shorten it ({exc})",
                details={"max_length": self.max_length},
            ) from None
        if not truncate:
            self._refuse_overflow(encodings, "texts" if cut_first else "documents", first_index)
        return [
            self._shape(enc, with_offsets, pair=True, truncated=bool(enc.overflowing) or pair[cut] is not whole)
            for enc, pair, whole in zip(encodings, inputs, texts[cut])
        ]

    def window_room(self, first: str) -> int:
        """Tokens of a pair's second text that fit in one sequence next to `first` (whole)."""
        specials = self._tokenizer.num_special_tokens_to_add(True)
        return self._budget - specials - len(self.plain_ids(first))

    def encode_pair_windows(
        self, first: str, seconds: list[str], overlap_tokens: int, max_windows: int
    ) -> list[tuple[list[Encoded], bool]]:
        """Each `(first, second)` pair as one or more sequences: `first` whole in each, `second` in
        windows of the tokens that fit, consecutive windows sharing `overlap_tokens` tokens (at most
        half a window). A second text longer than `max_windows` windows is cut to that many; each
        result says whether its text was cut."""
        room = self.window_room(first)
        if room < 2 or not 0 <= overlap_tokens <= room // 2:
            raise InvalidRequest(
                f"window_overlap_tokens must be between 0 and half a window ({max(0, room // 2)} tokens here: "
                f"{room} of the model's {self.max_length} are left for the document next to the query); "
                f"got {overlap_tokens}",
                details={"option": "window_overlap_tokens", "max": max(0, room // 2)},
            )
        tokenizer = self._pair_variant(overlap_tokens)
        longest = room + (max_windows - 1) * (room - overlap_tokens)
        out = []
        for second in seconds:
            second, cut = self.cut_to_tokens(second, longest)
            enc = _encode(tokenizer, (first, second), add_special_tokens=True)
            out.append(([self._shape(e, False, pair=True) for e in (enc, *enc.overflowing)], cut))
        return out

    def cut_to_tokens(self, text: str, max_tokens: int) -> tuple[str, bool]:
        """`text` cut to at most its first `max_tokens` tokens (special tokens not counted), and
        whether anything was cut. The cut falls at a token's end; if the cut text tokenizes to more
        tokens (byte-level pieces of one character share its offsets), it steps back."""
        plain = self._plain_tokenizer()
        bound = max_tokens * CHARS_PER_TOKEN_BOUND + 64
        while True:
            head = text if len(text) <= bound else _cut(text, bound)
            enc = _encode(plain, head, add_special_tokens=False)
            ends = [end for (_, end), special in zip(enc.offsets, enc.special_tokens_mask) if not special]
            if len(ends) > max_tokens:
                break
            if head is text:
                return text, False
            if bound >= (max_tokens * CHARS_PER_TOKEN_BOUND + 64) * WIDEN_LIMIT:
                self._refuse_uncuttable(len(head), "document", 0, None)
            bound *= 4
        keep = max_tokens
        while keep > 0:
            cut = text[: ends[keep - 1]]
            if len(_encode(plain, cut, add_special_tokens=False).ids) <= max_tokens:
                return cut, True
            keep -= 1
        return "", True

    def encode_words(self, word_lists: list[list[str]]) -> list[Encoded]:
        """Each list of words as one sequence (special tokens included, no truncation: the caller
        sizes it), tokenized word by word as transformers does with `is_split_into_words`; word ids
        index the list."""
        encodings = self._plain_tokenizer().encode_batch(word_lists, is_pretokenized=True, add_special_tokens=True)
        return [
            Encoded(
                np.asarray(enc.ids, dtype=np.int64),
                word_ids=np.asarray([-1 if w is None else w for w in enc.word_ids], dtype=np.int32),
            )
            for enc in encodings
        ]

    def encode_whole(self, text: str) -> tuple[Encoded, int, int]:
        """`text` as one sequence without truncation, with offsets and word ids (the caller reads
        it in windows), and how many special tokens open and close it."""
        enc = _encode(self._plain_tokenizer(), text, add_special_tokens=True)
        mask = enc.special_tokens_mask
        lead = next((i for i, special in enumerate(mask) if not special), len(mask))
        trail = next((i for i, special in enumerate(reversed(mask)) if not special), 0) if lead < len(mask) else 0
        return self._shape(enc, True, pair=False), lead, trail

    def word_token_counts(self, words: list[str]) -> np.ndarray:
        """`[w]` tokens each word takes (as `encode_words` tokenizes it, without special tokens)."""
        if not words:
            return np.zeros(0, dtype=np.int64)
        enc = _encode(self._plain_tokenizer(), words, is_pretokenized=True, add_special_tokens=False)
        ids = np.asarray([w for w in enc.word_ids if w is not None], dtype=np.int64)
        return np.bincount(ids, minlength=len(words))

    def plain_ids(self, text: str) -> list[int]:
        """Token ids of `text` without special tokens and without truncation."""
        return _encode(self._plain_tokenizer(), text, add_special_tokens=False).ids

    def _plain_tokenizer(self) -> Tokenizer:
        """A clone without truncation (for counting and cutting by tokens)."""
        if self._plain is None:
            clone = Tokenizer.from_str(self._tokenizer.to_str())
            clone.no_truncation()
            clone.no_padding()
            self._plain = clone  # a benign race: two threads may each build one
        return self._plain

    def _pair_variant(self, stride: int = 0, strategy: str = "only_second") -> Tokenizer:
        """A clone that truncates pairs from their second text (or, `only_first`, their first),
        keeping `stride` tokens of overlap in the overflowing windows. The last few used are kept;
        a clone is built outside the lock, so a new stride never holds up the others."""
        key = (stride, strategy)
        with self._pair_lock:
            clone = self._pair_tokenizers.get(key)
            if clone is not None:
                self._pair_tokenizers.move_to_end(key)
                return clone
        clone = Tokenizer.from_str(self._tokenizer.to_str())
        clone.no_padding()
        clone.enable_truncation(max_length=self._budget, stride=stride, strategy=strategy)
        with self._pair_lock:
            self._pair_tokenizers[key] = clone
            while len(self._pair_tokenizers) > 8:
                self._pair_tokenizers.popitem(last=False)
        return clone

    def _shape(self, enc, with_offsets: bool, pair: bool, truncated: bool = False) -> Encoded:
        # Columns of the sequence (each a fresh list from `tokenizers`), with what a marker or an
        # expansion token gets in each: its id in `ids`, a neutral value elsewhere.
        cols = {"ids": enc.ids}
        if pair:
            cols["type_ids"] = enc.type_ids
        if with_offsets:
            cols["offsets"] = enc.offsets
            cols["word_ids"] = [-1 if w is None else w for w in enc.word_ids]
        if self.marker_id is not None:
            for name, col in cols.items():
                col.insert(1, self.marker_id if name == "ids" else _NEUTRAL[name])
        num_real = len(cols["ids"])
        extra = (self.expand_to or 0) - num_real
        for name, col in cols.items():
            col.extend([self.expand_id if name == "ids" else _NEUTRAL[name]] * max(0, extra))
        num_keys = num_real if extra > 0 and not self.attend_to_expansion else None

        def column(name: str, dtype) -> np.ndarray | None:
            return np.asarray(cols[name], dtype=dtype) if name in cols else None

        offsets = column("offsets", np.int32)
        return Encoded(
            np.asarray(cols["ids"], dtype=np.int64),  # always a column
            column("type_ids", np.int64),
            offsets.reshape(-1, 2) if offsets is not None else None,
            column("word_ids", np.int32),
            truncated,
            num_keys,
        )


# What a marker or expansion token carries in each column but `ids`.
_NEUTRAL = {"type_ids": 0, "offsets": (0, 0), "word_ids": -1}


_TRAILING_WORD = re.compile(r"\S+\Z")


class _Uncuttable(Exception):
    """A pair's cut text at the widest bound still may differ from the whole (raised past the
    tokenizer's own errors, then refused by name)."""

    def __init__(self, index: int, kept_chars: int) -> None:
        super().__init__(index, kept_chars)
        self.index, self.kept_chars = index, kept_chars


def _encode(tokenizer: Tokenizer, value, **options):
    """`tokenizer.encode` of one text (or pair, or word list) through `encode_batch`, which lets go
    of the GIL while it runs: `encode` holds it, and a long text would stall the event loop's
    thread (and every other request) for as long as it takes."""
    return tokenizer.encode_batch([value], **options)[0]


def _cut(text: str, bound: int) -> str:
    """The first `bound` characters of `text`, ending at whitespace when there is some in the last
    quarter (a word split in two may tokenize differently from the whole word)."""
    head = text[:bound]
    if text[bound : bound + 1].isspace():
        return head
    tail = _TRAILING_WORD.search(head)
    if tail is not None and tail.start() >= bound * 3 // 4:
        return head[: tail.start()]
    return head


def _needs_wider(cut: str, enc, sequence: int | None = None) -> bool:
    """The cut kept no more tokens than fit (tokens may be missing), or it split a word and the
    kept tokens reach into that word. `sequence`: which text of a pair `cut` is (its offsets only)."""
    if not enc.overflowing:
        return True
    if cut[-1:].isspace():
        return False
    tail = _TRAILING_WORD.search(cut)
    owners = enc.sequence_ids if sequence is not None else [None] * len(enc.offsets)
    ends = [
        end
        for (start, end), special, owner in zip(enc.offsets, enc.special_tokens_mask, owners)
        if not special and owner == sequence
    ]
    return tail is not None and bool(ends) and max(ends) > tail.start()
