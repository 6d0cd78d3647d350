"""A GLiNER2 call's schema: checked, then written as GLiNER2's prompt, task by task.

The entity types are the call's `labels`; the rest travels in `ExtractCall.schema`, a subset of
the `gliner2` package's schema dict (what its `create_schema()...build()` returns):

    {"entity_descriptions": {"person": "a human being", ...},
     "relations": [{"works_for": {"head": "", "tail": ""}}, ...],                # one per relation type
     "relation_descriptions": {"works_for": "an employment", ...},
     "classifications": [{"task": "sentiment", "labels": ["positive", "negative"]   # or {label: description}
                          "multi_label": false, "cls_threshold": 0.5, "top_k": null,
                          "class_act": "auto",                                    # auto | sigmoid | softmax
                          "prompt": "what to decide", "examples": [["a text", "positive"], ...]}],
     "structures": {"product": {"fields": [{"name": "name", "dtype": "str", "description": "its name",
                                            "threshold": 0.4},
                                           {"name": "category", "choices": ["food", "tool"]},
                                           "price::str::what it costs", "tags::[new|used]::list"]}}}

`structures` is the package's `Schema.from_dict` form (a structure's field list may also be given
bare, as `extract_json` takes it); a field is a dict or a `name::dtype::[a|b]::description` string
(dtype "list", the default, or "str", which a string field with choices defaults to). The package's own
`json_structures` dict cannot say a field's dtype or threshold, and record modes (`mode`, `anchor`)
are for its boundary checkpoints; both are refused with a 400 saying what to send.

Each task is one prompt (GLiNER2's inference layout), structures first, then entities, relations and
classifications: `( [P] name ( [C] field [C] field ) )`, where name is the structure, "entities", the
relation type (`name: description` when described; fields `[R] head [R] tail`) or the
classification's task (`task: prompt` with a prompt; fields `[L] label`), followed by
` [DESCRIPTION] label: text` for each described field, entity type or label and a classification's
` [EXAMPLE] text [OUTPUT] label` examples. The fields with choices put their choices in words before
the text (`prefix_words`): `( product: category ( food | tool ) , tags ( new | used ) )`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...errors import InvalidRequest

P_TOKEN, E_TOKEN, L_TOKEN, R_TOKEN, C_TOKEN = "[P]", "[E]", "[L]", "[R]", "[C]"
SEP_STRUCT, SEP_TEXT, DESC_TOKEN = "[SEP_STRUCT]", "[SEP_TEXT]", "[DESCRIPTION]"
EXAMPLE_TOKEN, OUTPUT_TOKEN = "[EXAMPLE]", "[OUTPUT]"
CLASS_ACTS = ("auto", "sigmoid", "softmax")
DTYPES = ("list", "str")
_CLASSIFICATION_KEYS = {"task", "labels", "multi_label", "cls_threshold", "top_k", "class_act", "prompt", "examples"}
_FIELD_KEYS = {"name", "dtype", "choices", "description", "threshold"}
_REFUSED = {
    "json_structures": 'send structured records as structures: {name: {"fields": [...]}} (the gliner2 '
    "package's Schema.from_dict form), which says each field's dtype and threshold"
}
_KEYS = ("entity_descriptions", "relations", "relation_descriptions", "classifications", "structures")
RELATION_FIELDS = ["head", "tail"]


@dataclass(frozen=True)
class Classification:
    task: str
    labels: list[str]
    descriptions: dict[str, str] = field(default_factory=dict)
    multi_label: bool = False
    threshold: float = 0.5
    top_k: int | None = None
    activation: str = "auto"
    prompt: str | None = None
    examples: list[tuple[str, str]] = field(default_factory=list)

    @property
    def sigmoid(self) -> bool:
        return self.activation == "sigmoid" or (self.activation == "auto" and self.multi_label)


@dataclass(frozen=True)
class RelationType:
    name: str
    description: str | None = None


@dataclass(frozen=True)
class StructureField:
    name: str
    dtype: str = "list"  # "list": every span (or choice) found; "str": the best one
    choices: list[str] | None = None  # a choice field picks among these words, not spans of the text
    description: str | None = None
    threshold: float | None = None  # None: the call's threshold


@dataclass(frozen=True)
class Structure:
    name: str
    fields: list[StructureField]

    def prefix(self) -> list[str]:
        """The words its choice fields put before the text (none without such fields)."""
        inner: list[str] = []
        for f in self.fields:
            if f.choices:
                words = [w for i, c in enumerate(f.choices) for w in ((c,) if i == 0 else ("|", c))]
                inner += [f.name, "(", *words, ")", ","]
        return ["(", f"{self.name}:", *inner[:-1], ")"] if inner else []


@dataclass(frozen=True)
class Schema:
    entity_types: list[str]
    entity_descriptions: dict[str, str]
    classifications: list[Classification]
    relations: list[RelationType] = field(default_factory=list)
    structures: list[Structure] = field(default_factory=list)

    def prompts(self) -> list[tuple[str, list[str]]]:
        """(kind, the prompt's words) per task, in the sequence's order."""
        out = []
        for s in self.structures:
            descriptions = {f.name: f.description for f in s.fields if f.description}
            out.append(("structures", _prompt(s.name, [f.name for f in s.fields], C_TOKEN, descriptions)))
        if self.entity_types:
            out.append(("entities", _prompt("entities", self.entity_types, E_TOKEN, self.entity_descriptions)))
        for r in self.relations:
            name = f"{r.name}: {r.description}" if r.description else r.name
            out.append(("relations", _prompt(name, RELATION_FIELDS, R_TOKEN, {})))
        for c in self.classifications:
            name = f"{c.task}: {c.prompt}" if c.prompt else c.task
            out.append(("classifications", _prompt(name, c.labels, L_TOKEN, c.descriptions, c.examples)))
        return out

    def prefix_words(self) -> list[str]:
        """The words between [SEP_TEXT] and the text: each structure's choices, in order."""
        return [w for s in self.structures for w in s.prefix()]


def _prompt(
    name: str,
    fields: list[str],
    marker: str,
    descriptions: dict[str, str],
    examples: list[tuple[str, str]] | None = None,
) -> list[str]:
    head = name + "".join(f" {DESC_TOKEN} {label}: {text}" for label, text in descriptions.items() if label in fields)
    head += "".join(f" {EXAMPLE_TOKEN} {text} {OUTPUT_TOKEN} {label}" for text, label in examples or ())
    return ["(", P_TOKEN, head, "(", *[w for f in fields for w in (marker, f)], ")", ")"]


def marker_words(prompt: list[str]) -> list[int]:
    """The words of a task's prompt whose first token a head reads: [P], then each field's marker."""
    return [1, *range(4, len(prompt) - 2, 2)]


def _bad(message: str, where: str) -> InvalidRequest:
    return InvalidRequest(message, details={"option": "schema", "field": where})


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _bad(f"schema {where} must be a non-empty string", where)
    return value


def parse_schema(labels: list[str], schema: Any) -> Schema:
    """The call's entity types and its `schema`, checked; an InvalidRequest naming what is wrong."""
    if schema is None:
        schema = {}
    if not isinstance(schema, dict):
        raise _bad(f"schema must be an object ({', '.join(_KEYS)})", "schema")
    for key in schema:
        if key in _REFUSED:
            raise _bad(f"schema {key}: {_REFUSED[key]}", key)
        if key not in _KEYS:
            raise _bad(f"schema has an unknown key {key!r} ({', '.join(_KEYS)})", key)
    descriptions = schema.get("entity_descriptions") or {}
    if not isinstance(descriptions, dict):
        raise _bad("schema entity_descriptions must map entity types to descriptions", "entity_descriptions")
    for name, text in descriptions.items():
        if name not in labels:
            raise _bad(f"schema entity_descriptions names {name!r}, which is not in labels", "entity_descriptions")
        _text(text, f"entity_descriptions.{name}")
    tasks = schema.get("classifications") or []
    if not isinstance(tasks, list):
        raise _bad("schema classifications must be a list of tasks", "classifications")
    classifications = [_classification(task, i) for i, task in enumerate(tasks)]
    names = [c.task for c in classifications]
    if len(set(names)) != len(names):
        raise _bad("schema classifications: each task needs its own name", "classifications")
    relations = _relations(schema.get("relations") or [], schema.get("relation_descriptions") or {})
    structures = _structures(schema.get("structures") or {})
    if not labels and not classifications and not relations and not structures:
        raise InvalidRequest(
            "nothing to extract: send entity types in labels, or relations, classification tasks or "
            "structures in schema",
            details={"option": "labels"},
        )
    return Schema(list(labels), dict(descriptions), classifications, relations, structures)


def _structures(items: Any) -> list[Structure]:
    if not isinstance(items, dict):
        raise _bad('schema structures must map each structure to {"fields": [...]}', "structures")
    out = []
    for name, body in items.items():
        where = f"structures.{name}"
        _text(name, "structures")
        if isinstance(body, dict):
            extra = set(body) - {"fields"}
            if extra:
                raise _bad(
                    f"schema {where} has keys {sorted(extra)}: only fields is served (record modes and "
                    "anchors are for gliner2's boundary checkpoints)",
                    where,
                )
            body = body.get("fields")
        if not isinstance(body, list) or not body:
            raise _bad(f"schema {where}.fields must be a non-empty list of fields", f"{where}.fields")
        fields = [_structure_field(spec, f"{where}.fields[{i}]") for i, spec in enumerate(body)]
        names = [f.name for f in fields]
        if len(set(names)) != len(names):
            raise _bad(f"schema {where}.fields names a field twice", f"{where}.fields")
        out.append(Structure(name, fields))
    return out


def _structure_field(spec: Any, where: str) -> StructureField:
    """A field from its dict or its `name::dtype::[a|b]::description` string (the package's forms)."""
    if isinstance(spec, str):
        name, *parts = spec.split("::")
        dtype, choices, description, explicit = "list", None, None, False
        for part in parts:
            if part in DTYPES:
                dtype, explicit = part, True
            elif part.startswith("[") and part.endswith("]"):
                choices = [c.strip() for c in part[1:-1].split("|")]
                dtype = dtype if explicit else "str"
            else:
                description = part
        spec = {"name": name, "dtype": dtype, "choices": choices, "description": description}
    if not isinstance(spec, dict):
        raise _bad(f"schema {where} must be an object with a name, or a name::dtype::description string", where)
    unknown = set(spec) - _FIELD_KEYS
    if unknown:
        raise _bad(f"schema {where} has unknown keys {sorted(unknown)} ({', '.join(sorted(_FIELD_KEYS))})", where)
    name = _text(spec.get("name"), f"{where}.name")
    choices = spec.get("choices")
    dtype = spec.get("dtype", "list")
    if dtype not in DTYPES:
        raise _bad(f"schema {where}.dtype must be list or str", f"{where}.dtype")
    if choices is not None:
        if not isinstance(choices, list) or not choices:
            raise _bad(f"schema {where}.choices must be a non-empty list of choices", f"{where}.choices")
        for choice in choices:
            _text(choice, f"{where}.choices")
        if len(set(choices)) != len(choices):
            raise _bad(f"schema {where}.choices repeats a choice", f"{where}.choices")
    description = spec.get("description")
    if description is not None:
        _text(description, f"{where}.description")
    threshold = spec.get("threshold")
    if threshold is not None and (
        isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1
    ):
        raise _bad(f"schema {where}.threshold must be between 0 and 1", f"{where}.threshold")
    return StructureField(
        name, dtype, list(choices) if choices else None, description, None if threshold is None else float(threshold)
    )


def _relations(items: Any, descriptions: Any) -> list[RelationType]:
    """The relation types, in first-named order (a type named twice is one task, as the package
    groups them), each {name: {"head": "", "tail": ""}}."""
    if not isinstance(items, list):
        raise _bad('schema relations must be a list of {type: {"head": "", "tail": ""}}', "relations")
    names: list[str] = []
    for index, item in enumerate(items):
        where = f"relations[{index}]"
        if not isinstance(item, dict) or not item:
            raise _bad(f'schema {where} must be an object {{type: {{"head": "", "tail": ""}}}}', where)
        for name, fields in item.items():
            _text(name, where)
            if not isinstance(fields, dict) or list(fields) != RELATION_FIELDS:
                raise _bad(f'schema {where}.{name} must be {{"head": "", "tail": ""}} (in that order)', where)
            if name not in names:
                names.append(name)
    if not isinstance(descriptions, dict):
        raise _bad("schema relation_descriptions must map relation types to descriptions", "relation_descriptions")
    for name, text in descriptions.items():
        if name not in names:
            raise _bad(
                f"schema relation_descriptions names {name!r}, which is not in relations", "relation_descriptions"
            )
        _text(text, f"relation_descriptions.{name}")
    return [RelationType(name, descriptions.get(name)) for name in names]


def _classification(task: Any, index: int) -> Classification:
    where = f"classifications[{index}]"
    if not isinstance(task, dict):
        raise _bad(f"schema {where} must be an object with task and labels", where)
    unknown = set(task) - _CLASSIFICATION_KEYS
    if unknown:
        raise _bad(
            f"schema {where} has unknown keys {sorted(unknown)} ({', '.join(sorted(_CLASSIFICATION_KEYS))})", where
        )
    name = _text(task.get("task"), f"{where}.task")
    raw = task.get("labels")
    descriptions: dict[str, str] = {}
    if isinstance(raw, dict):
        descriptions = {_text(k, f"{where}.labels"): _text(v, f"{where}.labels.{k}") for k, v in raw.items()}
        raw = list(raw)
    if not isinstance(raw, list) or not raw:
        raise _bad(f"schema {where}.labels must be a non-empty list of labels", f"{where}.labels")
    names = [_text(label, f"{where}.labels") for label in raw]
    if len(set(names)) != len(names):
        raise _bad(f"schema {where}.labels repeats a label", f"{where}.labels")
    multi = task.get("multi_label", False)
    threshold = task.get("cls_threshold", 0.5)
    top_k = task.get("top_k")
    act = task.get("class_act", "auto")
    if not isinstance(multi, bool):
        raise _bad(f"schema {where}.multi_label must be true or false", f"{where}.multi_label")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
        raise _bad(f"schema {where}.cls_threshold must be between 0 and 1", f"{where}.cls_threshold")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise _bad(f"schema {where}.top_k must be an integer >= 1", f"{where}.top_k")
    if act not in CLASS_ACTS:
        raise _bad(f"schema {where}.class_act must be one of {', '.join(CLASS_ACTS)}", f"{where}.class_act")
    prompt = task.get("prompt")
    if prompt is not None:
        _text(prompt, f"{where}.prompt")
    examples = task.get("examples") or []
    if not isinstance(examples, list):
        raise _bad(f"schema {where}.examples must be a list of [text, label] pairs", f"{where}.examples")
    pairs = []
    for j, example in enumerate(examples):
        at = f"{where}.examples[{j}]"
        if not isinstance(example, (list, tuple)) or len(example) != 2:
            raise _bad(f"schema {at} must be a [text, label] pair", at)
        text, label = _text(example[0], at), _text(example[1], at)
        if label not in names:
            raise _bad(f"schema {at}: {label!r} is not one of the task's labels", at)
        pairs.append((text, label))
    return Classification(name, names, descriptions, multi, float(threshold), top_k, act, prompt, pairs)
