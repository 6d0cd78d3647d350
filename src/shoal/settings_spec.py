"""The machinery of the one settings declaration (the dataclasses of `shoal.config`).

Each field of those dataclasses is declared with `setting(default, help, ...)`; its name, type and
default are the field's own. From that declaration come, for every field:

    field `max_batch_tokens` ─┬─ environment variable  SHOAL_MAX_BATCH_TOKENS
                              ├─ CLI flag               --max-batch-tokens (plus older spellings, `also`)
                              ├─ the parsing of both    (a ConfigError naming the flag or variable)
                              └─ a row of the table     docs/operations.md (`python -m shoal.settings_spec FILE`)

Precedence: defaults < environment < flags (a `merge` list: the variable's items, then the flag's).
Empty text (an empty variable) counts as not given, except for a field that `refuse_empty` (there it
is a ConfigError); `none` sets an optional field to None. Tuples
take items separated by the field's `sep` in a variable, and repeat their flag. This module reads no
environment: `shoal.config` does."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError

_SPEC = "shoal.setting"
_SECTION = "shoal.section"
_DEST = "setting."  # argparse dest prefix: command-only flags never collide with a setting's
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Spec:
    """What a field declares beyond its name, type and default."""

    help: str
    # The subcommands that take its flag; None: those of its section.
    commands: tuple[str, ...] | None = None
    # More flag spellings, kept from before the declaration (`--lanes` for `--device-lanes`).
    also: tuple[str, ...] = ()
    # Tuples: the items' separator in a variable or a flag. A str field with one: its flag repeats,
    # joined by it (`--device cuda:0 --device cuda:1` is `cuda:0,cuda:1`).
    sep: str | None = None
    metavar: str | None = None
    # An environment variable only, no flag: a flag's value shows in `ps` and shell history.
    secret: bool = False
    # Tuples: the flag's items come after the variable's instead of replacing them (more card
    # directories and aliases on top of those a deployment sets in its environment).
    merge: bool = False
    # Why empty text is an error for this field rather than "not given" (its default would turn a
    # safeguard off: an empty tokens file setting would serve without auth); None: not given.
    refuse_empty: str | None = None


def setting(default: Any, help: str, **spec: Any) -> Any:
    """A settings field: `default`, one line of `help`, and `Spec`'s options."""
    declared = Spec(help, **spec)
    return dataclasses.field(default=default, repr=not declared.secret, metadata={_SPEC: declared})


def section(cls: type, commands: Iterable[str]) -> Any:
    """A field holding a dataclass of settings, whose flags these subcommands take."""
    return dataclasses.field(default_factory=cls, metadata={_SECTION: tuple(commands)})


@dataclass(frozen=True)
class Declared:
    """One declared field, flattened: `section` is the Settings field holding it ("" at the top)."""

    section: str
    name: str
    kind: type  # str, int, float, bool, Path, or tuple: a NAME=VALUE pair
    optional: bool  # `X | None`
    many: bool  # `tuple[X, ...]`
    default: Any
    spec: Spec
    commands: tuple[str, ...]

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}" if self.section else self.name

    @property
    def env(self) -> str:
        return "SHOAL_" + self.name.upper()

    @property
    def flags(self) -> tuple[str, ...]:
        return () if self.spec.secret else ("--" + self.name.replace("_", "-"), *self.spec.also)

    @property
    def negation(self) -> str | None:
        """The flag that sets a bool false (`--no-onednn-linear`); a switch named `no_x` has none."""
        if self.kind is not bool or self.many or self.spec.secret or self.name.startswith("no_"):
            return None
        return "--no-" + self.name.replace("_", "-")

    @property
    def sep(self) -> str:
        return self.spec.sep or ","

    @property
    def repeats(self) -> bool:
        return self.many or self.spec.sep is not None


def declare(cls: type, commands: Iterable[str]) -> tuple[Declared, ...]:
    """Every declared field of `cls` and of its sections (top-level fields: `commands`)."""
    out: list[Declared] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if _SECTION in f.metadata:
            inner = hints[f.name]
            inner_hints = typing.get_type_hints(inner)
            out += [
                _declared(f.name, g, inner_hints[g.name], f.metadata[_SECTION])
                for g in dataclasses.fields(inner)
                if _SPEC in g.metadata
            ]
        elif _SPEC in f.metadata:
            out.append(_declared("", f, hints[f.name], tuple(commands)))
    return tuple(out)


def _declared(section_name: str, f: dataclasses.Field, hint: Any, commands: tuple[str, ...]) -> Declared:
    spec: Spec = f.metadata[_SPEC]
    kind, optional, many = _shape(hint)
    return Declared(section_name, f.name, kind, optional, many, f.default, spec, spec.commands or commands)


def _shape(hint: Any) -> tuple[type, bool, bool]:
    """(scalar kind, optional, many) of an annotation: `float | None`, `tuple[Path, ...]`, ..."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        [inner] = [a for a in args if a is not type(None)]
        kind, _, many = _shape(inner)
        return kind, True, many
    if origin is tuple:
        return (tuple if typing.get_origin(args[0]) is tuple else args[0]), False, True
    return hint, False, False


# --- text <-> values --------------------------------------------------------------------------------


def given_text(d: Declared, text: str | None, source: str) -> str | None:
    """`text` as given for `d` by `source` (a flag or a variable), None if it counts as not given
    (absent or empty); ConfigError for empty text where `d` refuses it."""
    if text is None or text.strip():
        return text
    if d.spec.refuse_empty is None:
        return text or None  # blanks are parsed as before (a number refuses them, text strips them)
    empty = f"{source} is empty" if source.startswith("-") else f"{source} is set but empty"
    raise ConfigError(f"{empty}: {d.spec.refuse_empty}", details={"setting": d.path, "source": source})


def parse(d: Declared, text: str, source: str) -> Any:
    """The value of `text` given for `d` by `source` (a flag or a variable); ConfigError if it does not parse."""
    try:
        # `off` too for a number (SHOAL_TARGET_BATCH_S=off, as before the declaration).
        if d.optional and text.strip().lower() in (("none", "off") if d.kind in (int, float) else ("none",)):
            return None
        if d.many:
            return tuple(_scalar(d, item.strip()) for item in text.split(d.sep) if item.strip())
        return _scalar(d, text.strip())
    except ValueError:
        given_as = f"{source} {text!r}" if source.startswith("-") else f"{source}={text!r}"
        raise ConfigError(
            f"{given_as}: {d.path} takes {takes(d)}", details={"setting": d.path, "source": source}
        ) from None


def _scalar(d: Declared, text: str) -> Any:
    if d.kind is bool:
        if text.lower() not in _TRUE + _FALSE:
            raise ValueError(text)
        return text.lower() in _TRUE
    if d.kind is int:
        number = int(text)
        if number < 0:
            raise ValueError(text)
        return number
    if d.kind is float:
        real = float(text)
        if not (math.isfinite(real) and real >= 0):
            raise ValueError(text)
        return real
    if d.kind is tuple:
        name, sep, value = (part.strip() for part in text.partition("="))
        if not (sep and name and value):
            raise ValueError(text)
        return name, value
    return d.kind(text)  # str, Path


def takes(d: Declared) -> str:
    """What a value of `d` must look like, in words."""
    what = {
        int: "a whole number >= 0",
        float: "a number >= 0",
        bool: f"one of {', '.join(_TRUE + _FALSE)}",
        tuple: d.spec.metavar or "NAME=VALUE",
        Path: "a path",
    }.get(d.kind, "text")
    if d.many:
        what = f"{what} items separated by {d.sep!r}"
    return what + (", or none" if d.optional else "")


def text_of(d: Declared, value: Any) -> str:
    """`value` as the text a variable or a flag gives (parse(text_of(v)) == v)."""
    if value is None:
        return "none"
    if d.many:
        return d.sep.join(_scalar_text(d, item) for item in value)
    return _scalar_text(d, value)


def _scalar_text(d: Declared, value: Any) -> str:
    if d.kind is bool:
        return "true" if value else "false"
    if d.kind is tuple:
        return "=".join(value)
    return repr(value) if d.kind is float else str(value)


def build(cls: type, declared: Iterable[Declared], values: Mapping[str, Any]) -> Any:
    """`cls()` with `values` (keyed by `Declared.path`) laid over its defaults."""
    settings = cls()
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    for d in declared:
        if d.path in values:
            (sections.setdefault(d.section, {}) if d.section else top)[d.name] = values[d.path]
    for name, changed in sections.items():
        top[name] = dataclasses.replace(getattr(settings, name), **changed)
    return dataclasses.replace(settings, **top)


# --- argparse ---------------------------------------------------------------------------------------


def add_flags(parser: argparse.ArgumentParser, declared: Iterable[Declared], command: str) -> None:
    """The flags of every setting `command` takes, each with its variable and default in its help."""
    group = parser.add_argument_group("settings (a flag overrides its SHOAL_* variable, which overrides the default)")
    for d in declared:
        if command not in d.commands or d.spec.secret:
            continue
        repeats = " (repeatable)" if d.repeats else ""
        text = f"{d.spec.help}{repeats} [{d.env}; default {default_text(d)}]".replace("%", "%%")
        dest = _DEST + d.name
        if d.kind is bool and not d.many:
            # `--x` / `--no-x` (`d.negation`); a switch named `no_x` is `--no-x` alone.
            action = argparse.BooleanOptionalAction if d.negation else "store_true"
            group.add_argument(*d.flags, dest=dest, action=action, default=None, help=text)
        elif d.repeats:
            group.add_argument(*d.flags, dest=dest, action="append", metavar=metavar(d), help=text)
        else:
            group.add_argument(*d.flags, dest=dest, metavar=metavar(d), help=text)


def given(args: argparse.Namespace, declared: Iterable[Declared]) -> dict[str, str]:
    """The settings flags `args` holds, as text keyed by field name (those not given are absent)."""
    out: dict[str, str] = {}
    for d in declared:
        value = getattr(args, _DEST + d.name, None)
        if isinstance(value, bool):
            value = "true" if value else "false"
        elif isinstance(value, list):
            value = d.sep.join(value)
        if value is not None:
            out[d.name] = value
    return out


def metavar(d: Declared) -> str:
    if d.spec.metavar:
        return d.spec.metavar
    if d.kind is float:
        return "SECONDS" if d.name.endswith("_s") else "X"
    if d.kind is int:
        return "BYTES" if d.name.endswith("_bytes") else "N"
    return "PATH" if d.kind is Path else "TEXT"


def default_text(d: Declared) -> str:
    return text_of(d, d.default) or "none"


# --- docs -------------------------------------------------------------------------------------------

BEGIN, END = (
    "<!-- settings table: generated by `python -m shoal.settings_spec docs/operations.md` -->",
    "<!-- end of the settings table -->",
)


def markdown_table(declared: Iterable[Declared]) -> str:
    """One row per setting: its flags, variable, default, commands and help."""
    rows = [
        "| setting | flag | environment variable | default | commands | what it sets |",
        "|---|---|---|---|---|---|",
    ]
    for d in declared:
        flags = ", ".join(f"`{f}`" for f in (*d.flags, d.negation) if f) + (" (repeatable)" if d.repeats else "")
        env = f"`{d.env}`" + (f" ({d.sep!r}-separated)" if d.many else "")
        rows.append(
            f"| `{d.path}` | {flags or 'none (a secret)'} | {env} | `{default_text(d)}` | "
            f"{', '.join(d.commands)} | {d.spec.help} |"
        )
    return "\n".join(rows) + "\n"


def with_table(doc: str, table: str) -> str:
    """`doc` with the text between its BEGIN and END markers replaced by `table`."""
    pattern = re.compile(re.escape(BEGIN) + r"\n.*?" + re.escape(END), re.S)
    if not pattern.search(doc):
        raise ValueError(f"the markers {BEGIN!r} and {END!r} are missing")
    return pattern.sub(lambda _: f"{BEGIN}\n{table}{END}", doc)


def main(argv: list[str]) -> int:
    """Print the table, or rewrite it inside each markdown file named."""
    from .config import declared

    table = markdown_table(declared())
    if not argv:
        sys.stdout.write(table)
    for name in argv:
        path = Path(name)
        path.write_text(with_table(path.read_text(), table))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
