"""Settings declared once, as dataclass fields that carry everything said about them.

A setting's field holds its default, its documentation, its kind (honoured, no-op, refused),
the values it accepts, its per-platform defaults and its command-line flag. From the
fields alone come: validation with messages that name the setting (`check_settings`), the
values a platform fills in (`resolved_setting`), the command line's flags
(`add_cli_arguments`, `cli_settings`) and the settings tables of docs/usage.md
(`markdown_table`, written into the page by `rewrite_generated_tables`). `EngineArgs` is
declared this way.
"""

from __future__ import annotations

import argparse
import math
import re
import typing
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # Typeshed's protocol of a dataclass instance (what `dataclasses.fields` takes).
    from _typeshed import DataclassInstance

# Keys of a field's metadata.
_DOC = "doc"
_KIND = "kind"
# The values a setting accepts, where not all of its type's are; any other is refused.
_ACCEPTS = "accepts"
# A `Valid` every value must pass (None too, unless None is the default).
_VALID = "valid"
# platform name -> the value None stands for there.
_PLATFORM_DEFAULTS = "platform_defaults"
# The default column of the docs table, where the field's default alone would mislead.
_DEFAULT_DOC = "default_doc"
# The field's CLI flag, a `CliFlag`, where it has one.
_CLI = "cli"
# The docs table of its kind a setting is listed in: None for the kind's main one, else a
# name that a generated block of the page asks for (see `rewrite_generated_tables`).
_TABLE = "table"

KINDS = ("honoured", "no-op", "refused")


@dataclass(frozen=True)
class CliFlag:
    """How a setting appears on the command line: by default ``--field-name``, its value
    parsed as the field's type (a bool gets ``--name / --no-name``)."""

    names: tuple[str, ...] = ()
    parse: Callable[[str], Any] | None = None


FLAG = CliFlag()


@dataclass(frozen=True)
class Valid:
    """What a setting's values must satisfy: ``test(value)``, worded as ``allowed``."""

    test: Callable[[Any], bool]
    allowed: str


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def at_least(minimum: int) -> Valid:
    return Valid(lambda value: _is_int(value) and value >= minimum, f"an integer >= {minimum}")


BOOL = Valid(lambda value: isinstance(value, bool), "a bool")
INT = Valid(_is_int, "an int")
POWER_OF_TWO = Valid(
    lambda value: _is_int(value) and value >= 1 and value & (value - 1) == 0,
    "a power of two (16 is usual)",
)
SHARE = Valid(
    lambda value: (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0.0 < value <= 1.0
    ),
    "in (0, 1]",
)


def honoured(
    default: Any,
    doc: str,
    *,
    cli: CliFlag | None = None,
    accepts: tuple[Any, ...] = (),
    valid: Valid | None = None,
    platform_defaults: dict[str, Any] | None = None,
    default_doc: str | None = None,
    table: str | None = None,
) -> Any:
    """A setting that does what it does in vLLM. ``doc`` is its documentation, its CLI
    flag's help and its row of the docs table (plain prose, backticks for code).
    ``platform_defaults`` gives the value a default of None takes on each platform (by
    `Platform.name`); ``default_doc`` words the default where the value alone would mislead;
    ``table`` names the docs table it is listed in, where not the main one."""
    metadata = {
        _DOC: doc,
        _KIND: "honoured",
        _CLI: cli,
        _ACCEPTS: accepts,
        _VALID: valid,
        _PLATFORM_DEFAULTS: platform_defaults,
        _DEFAULT_DOC: default_doc,
        _TABLE: table,
    }
    return field(default=default, metadata=metadata)


def no_op(default: Any, doc: str) -> Any:
    """A setting that tunes something paged_llm does not have: accepted and ignored."""
    return field(default=default, metadata={_DOC: doc, _KIND: "no-op"})


def refused_unless(accepts: tuple[Any, ...], doc: str) -> Any:
    """A setting that asks for a missing feature: any value but ``accepts`` is refused."""
    return field(default=accepts[0], metadata={_DOC: doc, _KIND: "refused", _ACCEPTS: accepts})


def check_settings(settings: DataclassInstance, owner: str) -> None:
    """Raise ValueError naming the first field of ``settings`` whose value its field does
    not accept. None passes `Valid` where it is the field's default."""
    for setting in fields(settings):
        value = getattr(settings, setting.name)
        accepts = setting.metadata.get(_ACCEPTS)
        # NOTE: a bool matches only a bool: True == 1 would pass for a count.
        if accepts and not any(
            value == a and isinstance(value, bool) == isinstance(a, bool) for a in accepts
        ):
            allowed = " or ".join(repr(a) for a in accepts)
            raise ValueError(
                f"{owner} argument {setting.name}={value!r} is not supported by paged_llm: "
                f"{setting.metadata[_DOC]} Leave it at {allowed}."
            )
        valid: Valid | None = setting.metadata.get(_VALID)
        # NOTE: None passes where it is the default (a platform's default, or "none").
        if valid is None or (value is None and setting.default is None):
            continue
        if not valid.test(value):
            raise ValueError(
                f"{owner} argument {setting.name} must be {valid.allowed}, got {value!r}."
            )


def resolved_setting(settings: DataclassInstance, name: str, platform: str) -> Any:
    """The value of setting ``name``, or where it is None, its default on ``platform``."""
    value = getattr(settings, name)
    if value is not None:
        return value
    setting = next(s for s in fields(settings) if s.name == name)
    defaults = setting.metadata.get(_PLATFORM_DEFAULTS) or {}
    return defaults.get(platform)


def settings_of_kind(settings_class: type, kind: str) -> list[Field[Any]]:
    """The fields of a settings class of one kind: "honoured", "no-op" or "refused"."""
    return [setting for setting in fields(settings_class) if setting.metadata[_KIND] == kind]


# ----- the command line -------------------------------------------------------------------


def add_cli_arguments(group: argparse._ActionsContainer, settings_class: type) -> None:
    """One flag per setting that has a `CliFlag`, its help the field's doc and default
    (without the docs' backticks). Every flag defaults to None (unset), so `cli_settings`
    passes only what was given and the settings keep their own defaults."""
    hints = typing.get_type_hints(settings_class)
    for setting in fields(settings_class):
        flag: CliFlag | None = setting.metadata.get(_CLI)
        if flag is None:
            continue
        names = flag.names or ("--" + setting.name.replace("_", "-"),)
        doc = f"{setting.metadata[_DOC]} (default: {_default_text(setting)})"
        help_text = doc.replace("`", "").replace("%", "%%")
        value_type = _cli_type(hints[setting.name])
        if value_type is bool:
            group.add_argument(
                *names, dest=setting.name, action=argparse.BooleanOptionalAction, help=help_text
            )
        else:
            group.add_argument(
                *names, dest=setting.name, type=flag.parse or value_type, help=help_text
            )


def cli_settings(namespace: argparse.Namespace, settings_class: type) -> dict[str, Any]:
    """The settings given on the command line, as keyword arguments."""
    return {
        setting.name: value
        for setting in fields(settings_class)
        if setting.metadata.get(_CLI) is not None
        and (value := getattr(namespace, setting.name)) is not None
    }


def _cli_type(hint: Any) -> type:
    """The type a flag's text is parsed as: the first of bool, int, float in the field's
    type, else str (paths, names, "auto")."""
    members = typing.get_args(hint) or (hint,)
    return next((t for t in (bool, int, float) if t in members), str)


_BYTE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str) -> int:
    """``"4GiB"``, ``"512M"``, ``"1e9"`` -> bytes (binary units): a size on the CLI."""
    match = re.fullmatch(r"\s*([0-9.e+]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a size like 4GiB or 1073741824, got {text!r}")
    try:
        return int(float(match.group(1)) * _BYTE_UNITS[match.group(2)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 4GiB, got {text!r}") from None


# ----- documentation ----------------------------------------------------------------------


# The header of each kind's docs table.
_TABLE_HEADERS = {
    "honoured": ("argument", "default", "meaning"),
    "no-op": ("argument", "default", "why it does nothing"),
    "refused": ("argument", "accepted", "why"),
}


def markdown_table(settings_class: type, kind: str, table: str | None = None) -> str:
    """The Markdown table, header included, of the settings of ``kind`` listed in ``table``
    (None: the kind's main table): one row per field, in field order, with its name, its
    default (a refused setting: the values it accepts) and its doc."""
    settings = [
        setting
        for setting in settings_of_kind(settings_class, kind)
        if setting.metadata.get(_TABLE) == table
    ]
    if not settings:
        raise ValueError(
            f"{settings_class.__name__} has no {kind} settings listed in table {table!r}."
        )
    rows = [
        "| " + " | ".join(_TABLE_HEADERS[kind]) + " |",
        "| --- | --- | --- |",
        *(
            f"| `{setting.name}` | {_default_text(setting)} | {_cell(setting.metadata[_DOC])} |"
            for setting in settings
        ),
    ]
    return "\n".join(rows)


# A generated block: `<!-- generated: <class> <kind> [<table>]; ... -->`, the table, and
# `<!-- /generated -->`.
_GENERATED_BLOCK = re.compile(
    r"<!-- generated: (?P<owner>\w+) (?P<kind>[\w-]+)(?: (?P<table>\w+))?;[^\n]*-->\n"
    r".*?<!-- /generated -->",
    re.DOTALL,
)


def rewrite_generated_tables(text: str, settings_class: type, command: str) -> str:
    """``text`` (a Markdown page) with each generated block of ``settings_class`` written
    anew: between ``<!-- generated: <class> <kind> [<table>]; ... -->`` and
    ``<!-- /generated -->``, `markdown_table` of that kind and table. The opening marker
    names ``command``, the command that rewrites the page. Blocks of other classes are
    left alone. ValueError where a block names an unknown kind or an empty table, or where
    a setting is in no block, so that no setting goes undocumented."""
    owner = settings_class.__name__
    listed: set[str] = set()

    def rewrite(block: re.Match[str]) -> str:
        if block["owner"] != owner:
            return block[0]
        kind, table = block["kind"], block["table"]
        if kind not in KINDS:
            raise ValueError(
                f"A generated block names kind {kind!r}; the kinds are {', '.join(KINDS)}."
            )
        listed.update(
            setting.name
            for setting in settings_of_kind(settings_class, kind)
            if setting.metadata.get(_TABLE) == table
        )
        selector = " ".join(part for part in (owner, kind, table) if part)
        return (
            f"<!-- generated: {selector}; edit {owner}, then run {command} -->\n\n"
            f"{markdown_table(settings_class, kind, table)}\n\n<!-- /generated -->"
        )

    rewritten = _GENERATED_BLOCK.sub(rewrite, text)
    missing = [setting.name for setting in fields(settings_class) if setting.name not in listed]
    if missing:
        raise ValueError(
            f"{owner} settings {', '.join(missing)} are in no generated table of the page: add "
            f"a block <!-- generated: {owner} <kind> [<table>]; --> <!-- /generated --> for "
            f"their kind and table, then run {command}."
        )
    return rewritten


def _default_text(setting: Field[Any]) -> str:
    """A setting's default as its docs table and its ``--help`` word it."""
    default_doc: str | None = setting.metadata.get(_DEFAULT_DOC)
    if default_doc is not None:
        return default_doc
    platform_defaults = setting.metadata.get(_PLATFORM_DEFAULTS)
    if platform_defaults:
        return ", ".join(f"{value} on {platform}" for platform, value in platform_defaults.items())
    if setting.metadata[_KIND] == "refused":
        return " or ".join(f"`{_literal(value)}`" for value in setting.metadata[_ACCEPTS])
    return f"`{_literal(setting.default)}`"


def _literal(value: Any) -> str:
    """``value`` as Python source, a string in double quotes as the docs write them."""
    if isinstance(value, str) and value.isprintable() and not {'"', "\\"} & set(value):
        return f'"{value}"'
    return repr(value)


def _cell(text: str) -> str:
    """``text`` as one Markdown table cell: a ``|`` would end the cell."""
    return text.replace("|", "\\|")
