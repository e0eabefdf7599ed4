"""Command-line flags generated from a msgspec Struct's fields: one place for a setting's name,
type, default and help.

Field `block_size: Annotated[int, Meta(description="...")] = 16` becomes `--block-size N` with
that help and `(default: 16)`; `bool` takes true/false (1/0, yes/no, on/off); `X | None` takes
an X; a `Literal` gives the flag its choices; `list[str]` takes comma-separated values. A field
whose Meta has `extra=NOT_A_FLAG` is not a flag. Every flag defaults to None, so
`given_values` returns only what the user set and the Struct keeps its own defaults.
"""

from __future__ import annotations

import argparse
from typing import Any

import msgspec
import msgspec.inspect as mi

from ..actors.runtime.config import NOT_A_FLAG


def on_off(value: str) -> bool:
    """An on/off flag's value: 1/true/yes/on or 0/false/no/off, anything else an error."""
    word = value.lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def comma_list(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


METAVARS = {int: "N", float: "X", on_off: "{true,false}", comma_list: "A,B,..."}


class FlagSpec(msgspec.Struct, frozen=True):
    """One field as a flag: what argparse needs to parse it and show it in --help."""

    field: str
    parse: Any  # argparse's `type`
    choices: tuple | None
    metavar: str | None
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")


def flag_specs(
    struct: type[msgspec.Struct], exclude: frozenset[str] = frozenset()
) -> list[FlagSpec]:
    """The flags of `struct`'s user settings, in field order; TypeError on a type no flag
    parses (add it here rather than leave the setting off the command line)."""
    specs = []
    for field in mi.type_info(struct).fields:
        kind, description, extra = field.type, "", {}
        if isinstance(kind, mi.Metadata):
            kind = field.type.type
            description = (field.type.extra_json_schema or {}).get("description", "")
            extra = field.type.extra or {}
        if extra == NOT_A_FLAG or field.name in exclude:
            continue
        parse, choices = _parser(struct, field.name, kind)
        metavar = None if choices else METAVARS.get(parse)
        specs.append(FlagSpec(field.name, parse, choices, metavar, _help(description, field)))
    return specs


def add_flags(
    group: argparse._ActionsContainer,
    struct: type[msgspec.Struct],
    exclude: frozenset[str] = frozenset(),
) -> None:
    for spec in flag_specs(struct, exclude):
        group.add_argument(
            spec.flag,
            dest=spec.field,
            type=spec.parse,
            choices=spec.choices,
            metavar=spec.metavar,
            default=None,
            help=spec.help,
        )


def given_values(
    args: argparse.Namespace, struct: type[msgspec.Struct], exclude: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """The fields of `struct` the user gave a flag for."""
    return {
        spec.field: getattr(args, spec.field)
        for spec in flag_specs(struct, exclude)
        if getattr(args, spec.field) is not None
    }


def as_flags(values: dict[str, Any]) -> list[str]:
    """The command line that gives these field values (`given_values`' inverse): `--block-size
    16`, on/off as true/false, lists comma-joined."""
    argv = []
    for field, value in values.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, list):
            text = ",".join(str(item) for item in value)
        else:
            text = str(value)
        argv += ["--" + field.replace("_", "-"), text]
    return argv


def _parser(struct: type, name: str, kind: mi.Type) -> tuple[Any, tuple | None]:
    if isinstance(kind, mi.UnionType):  # X | None: an X (unset stays None)
        others = [t for t in kind.types if not isinstance(t, mi.NoneType)]
        if len(others) == 1:
            return _parser(struct, name, others[0])
    if isinstance(kind, mi.LiteralType):
        return type(kind.values[0]), kind.values
    if isinstance(kind, mi.ListType) and isinstance(kind.item_type, mi.StrType):
        return comma_list, None
    simple = {mi.IntType: int, mi.FloatType: float, mi.StrType: str, mi.BoolType: on_off}
    if type(kind) in simple:
        return simple[type(kind)], None
    raise TypeError(f"{struct.__name__}.{name}: no flag parses {kind}; mark it not a flag")


def _help(description: str, field: mi.Field) -> str:
    text = description.replace("%", "%%")  # argparse formats help with %
    default = field.default
    if field.default_factory is not msgspec.NODEFAULT:
        default = field.default_factory()
    if default is msgspec.NODEFAULT or default is None or default == []:
        return text
    shown = str(default).lower() if isinstance(default, bool) else default
    return f"{text} (default: {shown})"
