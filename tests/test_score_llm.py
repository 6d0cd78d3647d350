"""The LLM-reranker score (Qwen3-Reranker style) on the real SmolLM2-135M-Instruct weights: shoal's
P(yes) against the reranker's reference formula computed here with transformers' causal LM on the
same framed sequences (prefix + tokenized template, truncated, + suffix; last-token logits of
"no" and "yes"; softmax)."""

from __future__ import annotations

import asyncio

import numpy as np
import torch
import yaml

from shoal.catalog import Catalog
from shoal.config import EngineSettings
from shoal.engine import Engine, ScoreCall

QWEN3 = Catalog.load().get("Qwen/Qwen3-Reranker-0.6B").score  # the shipped card's template
QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Paris is the capital and largest city of France.",
    "The Great Barrier Reef lies off the coast of Queensland, Australia.",
    "Berlin is the capital of Germany.",
    "France's capital city, Paris, sits on the Seine. " * 20,  # longer than the test's max_length
]
MAX_LENGTH = 160


def reference_scores(directory, model, instruction: str) -> np.ndarray:
    """Qwen3-Reranker's published scoring recipe, with this model and tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    prefix = tokenizer.encode(QWEN3.prefix, add_special_tokens=False)
    suffix = tokenizer.encode(QWEN3.suffix, add_special_tokens=False)
    bodies = [f"<Instruct>: {instruction}\n<Query>: {QUERY}\n<Document>: {d}" for d in DOCUMENTS]
    encoded = tokenizer(
        bodies,
        padding=False,
        truncation="longest_first",
        return_attention_mask=False,
        max_length=MAX_LENGTH - len(prefix) - len(suffix),
    )["input_ids"]
    seqs = [prefix + ids + suffix for ids in encoded]
    longest = max(map(len, seqs))
    ids = torch.full((len(seqs), longest), tokenizer.pad_token_id or 0)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):  # left padding: the last position is every sequence's last token
        ids[i, longest - len(s) :], mask[i, longest - len(s) :] = torch.tensor(s), 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1, :]
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    pair = torch.stack([logits[:, no], logits[:, yes]], dim=1)
    return torch.nn.functional.log_softmax(pair, dim=1)[:, 1].exp().numpy(), [len(s) for s in seqs]


def test_llm_reranker_yes_probability_equals_the_reference_formula_on_smollm2(smollm2_causal, tmp_path):
    directory, model = smollm2_causal
    card = {
        "id": "test/smollm2-reranker",
        "architecture": "llama",
        "tasks": ["score"],
        "source": {"path": str(directory)},
        "max_length": MAX_LENGTH,
        "score": {
            "kind": "llm",
            "prefix": QWEN3.prefix,
            "template": QWEN3.template,
            "suffix": QWEN3.suffix,
            "instruction": QWEN3.instruction,
            "yes_token": "yes",
            "no_token": "no",
        },
    }
    (tmp_path / "card.yaml").write_text(yaml.safe_dump(card))
    catalog = Catalog.load(extra_dirs=(tmp_path,))
    custom = "Judge whether the document names the capital city"

    async def go():
        engine = Engine(EngineSettings(), catalog, allow_download=False)
        await engine.start()
        try:
            return (
                await engine.score(ScoreCall("test/smollm2-reranker", QUERY, DOCUMENTS)),
                await engine.score(ScoreCall("test/smollm2-reranker", QUERY, DOCUMENTS, instruction=custom)),
                await engine.score(ScoreCall("test/smollm2-reranker", QUERY, DOCUMENTS, raw_scores=True)),
            )
        finally:
            await engine.stop()

    default, instructed, raw = asyncio.run(go())
    for result, instruction in ((default, QWEN3.instruction), (instructed, custom)):
        expected, lengths = reference_scores(directory, model, instruction)
        got = np.array([next(i.score for i in result.items if i.index == k) for k in range(len(DOCUMENTS))])
        assert np.abs(got - expected).max() <= 1e-4, (got, expected)
        assert max(lengths) == MAX_LENGTH  # the long document was cut to fit, suffix kept
        assert [i.truncated for i in sorted(result.items, key=lambda i: i.index)] == [False, False, False, True]
    # The instruction reaches the model; raw scores are the log-odds of the same probability.
    assert (
        max(
            abs(a.score - b.score)
            for a, b in zip(
                sorted(default.items, key=lambda i: i.index), sorted(instructed.items, key=lambda i: i.index)
            )
        )
        > 1e-4
    )
    p = {i.index: i.score for i in default.items}
    assert max(abs(1 / (1 + np.exp(-i.score)) - p[i.index]) for i in raw.items) <= 1e-5
