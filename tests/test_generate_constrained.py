"""Constrained decoding (shoal.generate.constraints, llguidance) on real SmolLM2-135M weights
(conftest.smollm2_causal): 200 prompts over 10 JSON Schemas, every output parsed and validated by
`jsonschema`; regex and choice constraints; bad and unsatisfiable schemas get InvalidRequest and
take no cache slot."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from shoal.errors import InvalidRequest
from shoal.generate.batcher import GenerationRequest, Generator
from shoal.generate.constraints import Grammars
from shoal.generate.forward import CachedDecoder
from shoal.generate.kv_cache import SlabCache
from shoal.weights import build_model

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SCHEMAS = [
    {  # required and optional fields
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "email": NAME},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {  # an enum
        "type": "object",
        "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}},
        "required": ["sentiment"],
        "additionalProperties": False,
    },
    {  # an array with bounds
        "type": "object",
        "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {  # numbers with ranges
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0, "maximum": 10000},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
        },
        "required": ["price", "quantity"],
        "additionalProperties": False,
    },
    {  # nested objects
        "type": "object",
        "properties": {
            "ticket": {
                "type": "object",
                "properties": {
                    "title": NAME,
                    "priority": {"enum": ["low", "medium", "high"]},
                    "customer": {
                        "type": "object",
                        "properties": {"name": NAME, "vip": {"type": "boolean"}},
                        "required": ["name", "vip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["title", "priority", "customer"],
                "additionalProperties": False,
            }
        },
        "required": ["ticket"],
        "additionalProperties": False,
    },
    {  # an array of objects
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": NAME, "count": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["sku", "count"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {  # a boolean and a nullable field
        "type": "object",
        "properties": {"spam": {"type": "boolean"}, "reason": {"anyOf": [NAME, {"type": "null"}]}},
        "required": ["spam", "reason"],
        "additionalProperties": False,
    },
    {  # a string pattern
        "type": "object",
        "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
        "required": ["date"],
        "additionalProperties": False,
    },
    {  # an array of enums, unique
        "type": "object",
        "properties": {"labels": {"type": "array", "items": {"enum": ["bug", "feature", "question"]}, "maxItems": 3}},
        "required": ["labels"],
        "additionalProperties": False,
    },
    {  # a number alone at the top
        "type": "integer",
        "minimum": 1,
        "maximum": 5,
    },
]
TEXTS = [
    "Maria Lopez, 34, wrote from maria@example.com: the app crashes when I upload a photo.",
    "Great service, the order of 3 mugs at 12.50 each arrived on 2024-05-02.",
    "Bob (VIP) says the login page is down, urgent!",
    "Is there a dark mode? Asked by Kim, age 27.",
    "Two boxes of SKU-881 and one SKU-17, please. Total 40 dollars.",
    "I hate waiting two weeks for a refund. - Tom",
    "WIN A FREE CRUISE!!! click now",
    "Meeting moved to 2025-01-15, says Ana.",
    "The export button does nothing; also, can you add CSV import?",
    "Rate our support from 1 to 5: Lee gave it 4.",
    "Order 7 chairs at 45 each for the new office.",
    "Priya, 51, reports that invoices show the wrong currency.",
    "Neutral feedback: the update is fine, nothing special.",
    "Please tag this: slow search, broken filters, typos.",
    "Hello, I'm Sam. Can I change my email to sam@new.org?",
    "Spam? 'You have inherited 5 million dollars'",
    "New feature request from Omar: keyboard shortcuts.",
    "The delivery on 2023-12-24 was late by a day.",
    "Three pens and one notebook, SKU-5 and SKU-6.",
    "Low priority: the footer logo is blurry. Reported by Jo, VIP customer.",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_causal):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    directory, reference = smollm2_causal
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = build_model(directory, None, "cpu")
    eos = reference.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    grammars = Grammars(
        Tokenizer.from_file(str(directory / "tokenizer.json")).to_str(), model.config.vocab_size, eos_ids
    )
    return tokenizer, model, eos_ids, grammars


def generator(smollm2, slots: int = 32, max_len: int = 512) -> Generator:
    tokenizer, model, eos_ids, grammars = smollm2
    cfg = model.config
    cache = SlabCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, slots=slots, max_len=max_len)
    return Generator(CachedDecoder(model, cache), eos_ids, decode=lambda ids: tokenizer.decode(ids), grammars=grammars)


def prompt(tokenizer, schema: dict, text: str) -> tuple[int, ...]:
    message = f"Fill this JSON Schema from the text.\nSchema: {json.dumps(schema)}\nText: {text}"
    framed = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
    )
    return tuple(tokenizer(framed, add_special_tokens=False)["input_ids"])


def output_text(smollm2, seq) -> str:
    tokenizer, _, eos_ids, _ = smollm2
    return tokenizer.decode([t for t in seq.tokens if t not in eos_ids])


def test_200_constrained_outputs_over_10_schemas_all_validate(smollm2):
    tokenizer, _, _, grammars = smollm2
    gen = generator(smollm2)
    requests, schemas = [], []
    for schema in SCHEMAS:
        grammar = grammars.json_schema(schema)
        for text in TEXTS:
            requests.append(GenerationRequest(prompt(tokenizer, schema, text), max_new_tokens=160, grammar=grammar))
            schemas.append(schema)
    pending = list(zip(requests, schemas))
    done = []
    while pending or gen.running:  # at most 32 at a time: the cache's slots
        while pending and gen.cache.in_use < gen.cache.slots:
            request, schema = pending.pop()
            done.append((gen.add(request), schema))
        gen.step()
    assert len(done) == 200
    failures = []
    for seq, schema in done:
        text = output_text(smollm2, seq)
        try:
            jsonschema.validate(json.loads(text), schema)
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            failures.append((seq.finish_reason, text, str(exc)[:200]))
        assert seq.complete == (seq.finish_reason == "stop")
    assert not failures, f"{len(failures)} of 200 outputs do not validate: {failures[:3]}"
    assert gen.cache.in_use == 0


def test_regex_and_choice_constraints(smollm2):
    tokenizer, _, _, grammars = smollm2
    gen = generator(smollm2, slots=4)
    ask = prompt(tokenizer, {"type": "string"}, "Pick a date and a colour.")
    date, colour = gen.run(
        [
            GenerationRequest(ask, max_new_tokens=20, grammar=grammars.regex(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")),
            GenerationRequest(ask, max_new_tokens=20, grammar=grammars.choice(["red", "green", "blue"])),
        ]
    )
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", output_text(smollm2, date))
    assert output_text(smollm2, colour) in ("red", "green", "blue")


def test_a_schema_is_compiled_once_and_bad_ones_get_clear_errors_taking_no_slot(smollm2):
    _, _, _, grammars = smollm2
    assert grammars.json_schema(SCHEMAS[0]) is grammars.json_schema(json.loads(json.dumps(SCHEMAS[0])))
    gen = generator(smollm2, slots=2)
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        grammars.json_schema('{"type": ')
    with pytest.raises(InvalidRequest, match="is an object"):
        grammars.json_schema([1, 2])
    with pytest.raises(InvalidRequest, match="cannot be used"):
        grammars.json_schema({"type": "strin"})
    with pytest.raises(InvalidRequest, match="cannot be used"):  # unsatisfiable
        grammars.json_schema({"type": "integer", "minimum": 5, "maximum": 1})
    with pytest.raises(InvalidRequest, match="regex"):
        grammars.regex("([a-z]")
    with pytest.raises(InvalidRequest, match="choices"):
        grammars.choice([])
    tokenizer = smollm2[0]
    with pytest.raises(InvalidRequest, match="constraint"):
        gen.add(GenerationRequest(prompt(tokenizer, {}, "a"), grammar='{"grammars": [{"lark_grammar": "start: ("}]}'))
    assert gen.cache.in_use == 0 and not gen.running
