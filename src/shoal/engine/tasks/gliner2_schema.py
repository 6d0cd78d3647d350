"""A GLiNER2 call's schema: checked, then written as GLiNER2's prompt, task by task.

The entity types are the call's `labels`; the rest travels in `ExtractCall.schema`, a subset of
the `gliner2` package's schema dict (what its `create_schema()...build()` returns):

    {"entity_descriptions": {"person": "a human being", ...},
     "relations": [{"works_for": {"head": "", "tail": ""}}, ...],                # one per relation type
     "relation_descriptions": {"works_for": "an employment", ...},
     "classifications": [{"task": "sentiment", "labels": ["positive", "negative"]   # or {label: description}
                          "multi_label": false, "cls_threshold": 0.5, "top_k": null,
                          "class_act": "auto"}]}                                  # auto | sigmoid | softmax

Each task is one prompt (GLiNER2's inference layout), entities first, then relations, then
classifications: `( [P] name ( [E] field [E] field ) )`, where name is "entities", the relation
type (`name: description` when described; fields `[R] head [R] tail`) or the classification's task
(fields `[L] label`), followed by ` [DESCRIPTION] label: text` for each described entity type or
label. Structured records (`json_structures`) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...errors import InvalidRequest

P_TOKEN, E_TOKEN, L_TOKEN, R_TOKEN = "[P]", "[E]", "[L]", "[R]"
SEP_STRUCT, SEP_TEXT, DESC_TOKEN = "[SEP_STRUCT]", "[SEP_TEXT]", "[DESCRIPTION]"
CLASS_ACTS = ("auto", "sigmoid", "softmax")
_CLASSIFICATION_KEYS = {"task", "labels", "multi_label", "cls_threshold", "top_k", "class_act"}
_NOT_YET = {"json_structures": "structured records"}
_KEYS = ("entity_descriptions", "relations", "relation_descriptions", "classifications")
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

    @property
    def sigmoid(self) -> bool:
        return self.activation == "sigmoid" or (self.activation == "auto" and self.multi_label)


@dataclass(frozen=True)
class RelationType:
    name: str
    description: str | None = None


@dataclass(frozen=True)
class Schema:
    entity_types: list[str]
    entity_descriptions: dict[str, str]
    classifications: list[Classification]
    relations: list[RelationType] = field(default_factory=list)

    def prompts(self) -> list[tuple[str, list[str]]]:
        """(kind, the prompt's words) per task, in the sequence's order."""
        out = []
        if self.entity_types:
            out.append(("entities", _prompt("entities", self.entity_types, E_TOKEN, self.entity_descriptions)))
        for r in self.relations:
            name = f"{r.name}: {r.description}" if r.description else r.name
            out.append(("relations", _prompt(name, RELATION_FIELDS, R_TOKEN, {})))
        for c in self.classifications:
            out.append(("classifications", _prompt(c.task, c.labels, L_TOKEN, c.descriptions)))
        return out


def _prompt(name: str, fields: list[str], marker: str, descriptions: dict[str, str]) -> list[str]:
    head = name + "".join(f" {DESC_TOKEN} {label}: {text}" for label, text in descriptions.items() if label in fields)
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
        if key in _NOT_YET:
            raise _bad(f"schema {key}: {_NOT_YET[key]} are not served by shoal's gliner2 kind yet", key)
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
    if not labels and not classifications and not relations:
        raise InvalidRequest(
            "nothing to extract: send entity types in labels, or relations or classification tasks in schema",
            details={"option": "labels"},
        )
    return Schema(list(labels), dict(descriptions), classifications, relations)


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
    return Classification(name, names, descriptions, multi, float(threshold), top_k, act)
