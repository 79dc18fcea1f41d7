"""Settings declared once, as dataclass fields that carry everything said about them.

A setting's field holds its default, its documentation, its kind (honoured, no-op, refused),
the values it accepts, its per-platform defaults and its command-line flag. From the
fields alone come: validation with messages that name the setting (`check_settings`), the
values a platform fills in (`resolved_setting`), one command-line flag per setting
(`add_cli_arguments`, read by `FlexibleArgumentParser` in vLLM's spellings) and the settings
tables of docs/usage.md (`markdown_table`, written into the page by
`rewrite_generated_tables`). `EngineArgs` is declared this way.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
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
# How the field's CLI flag differs from the one its type gives: a `CliFlag`, or None.
_CLI = "cli"
# The docs table of its kind a setting is listed in: None for the kind's main one, else a
# name that a generated block of the page asks for (see `rewrite_generated_tables`).
_TABLE = "table"

KINDS = ("honoured", "no-op", "refused")


@dataclass(frozen=True)
class CliFlag:
    """How a setting's command-line flag differs from the one its type hint gives.

    Every setting has a flag ``--field-name`` that defaults to the field's default and
    reads its text by the field's type hint: a bool is ``--name / --no-name`` (a bool or a
    str: ``--name`` alone is True, ``--name TEXT`` the text); a list takes one or more
    values; a dict is JSON; an int or a float is a number; anything else is text (paths,
    names, and the str spelling of a type a command line cannot write, such as a function or
    a torch.dtype). A type that admits None reads ``None`` as None. ``aliases`` are further
    names (``-tp``); ``parse`` reads the text instead of the type hint's parser."""

    aliases: tuple[str, ...] = ()
    parse: Callable[[str], Any] | None = None


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
    flag's help and its row of the docs table (plain prose, backticks for code); ``cli``
    changes its flag (see `CliFlag`).
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


def no_op(default: Any, doc: str, *, cli: CliFlag | None = None) -> Any:
    """A setting that tunes something paged_llm does not have: accepted and ignored."""
    return field(default=default, metadata={_DOC: doc, _KIND: "no-op", _CLI: cli})


def refused_unless(accepts: tuple[Any, ...], doc: str, *, cli: CliFlag | None = None) -> Any:
    """A setting that asks for a missing feature: any value but ``accepts`` is refused."""
    metadata = {_DOC: doc, _KIND: "refused", _ACCEPTS: accepts, _CLI: cli}
    return field(default=accepts[0], metadata=metadata)


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


def add_cli_arguments(
    container: argparse._ActionsContainer,
    settings_class: type,
    groups: Mapping[str, tuple[str, str]] | None = None,
    help_texts: Mapping[str, str] | None = None,
) -> None:
    """One flag per field of ``settings_class`` (see `CliFlag`), defaulting to the field's
    default, so that ``settings_class(**vars(namespace))`` of no flags is
    ``settings_class()``. Its help is ``help_texts[name]`` or else the field's doc, then its
    default (without the docs' backticks); its choices are the values the field accepts,
    where those are strings. On a parser, ``groups`` (kind -> argument group title and
    description) puts each kind's flags in a group; on a group, every flag goes in it."""
    hints = typing.get_type_hints(settings_class)
    made: dict[str, argparse._ActionsContainer] = {}
    for setting in fields(settings_class):
        kind = setting.metadata[_KIND]
        target = container
        if isinstance(container, argparse.ArgumentParser) and groups and kind in groups:
            title, description = groups[kind]
            if title not in made:
                made[title] = container.add_argument_group(title, description)
            target = made[title]
        flag: CliFlag = setting.metadata.get(_CLI) or CliFlag()
        doc = (help_texts or {}).get(setting.name, setting.metadata[_DOC])
        label = "accepted" if kind == "refused" else "default"
        help_text = f"{doc} ({label}: {_default_text(setting)})".replace("`", "")
        target.add_argument(
            "--" + setting.name.replace("_", "-"),
            *flag.aliases,
            dest=setting.name,
            default=setting.default,
            help=help_text.replace("%", "%%"),
            **_flag_reading(hints[setting.name], flag, setting.metadata.get(_ACCEPTS)),
        )


def _flag_reading(hint: Any, flag: CliFlag, accepts: tuple[Any, ...] | None) -> dict[str, Any]:
    """The `add_argument` keywords that read a flag's text as type ``hint`` (see `CliFlag`)."""
    members = _members(hint)
    optional = type(None) in members
    members.discard(type(None))
    if bool in members:
        if str in members:
            return {"nargs": "?", "const": True, "type": flag.parse or str}
        return {"action": argparse.BooleanOptionalAction}
    listed = next((m for m in members if typing.get_origin(m) is list), None)
    if listed is not None:
        (item,) = typing.get_args(listed)
        return {"nargs": "+", "type": flag.parse or _text_parser(_members(item))}
    reading: dict[str, Any] = {"type": flag.parse or _text_parser(members)}
    if reading["type"] is parse_json:
        reading["metavar"] = "JSON"
    if optional:
        reading["type"] = _none_or(reading["type"])
    named = [value for value in accepts or () if value is not None]
    if named and all(isinstance(value, str) for value in named):
        reading["choices"] = accepts
    return reading


def _members(hint: Any) -> set[Any]:
    """The types of a union type hint; a lone type for any other."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return set(typing.get_args(hint))
    return {hint}


def _text_parser(members: set[Any]) -> Callable[[str], Any]:
    """The parser of a flag's text for a value of one of the types ``members``: JSON for a
    dict, else the first of int and float, else the text itself."""
    origins = {typing.get_origin(member) or member for member in members}
    if dict in origins:
        return parse_json
    return next((t for t in (int, float) if t in origins), str)


def _none_or(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse``, but ``None`` (or nothing) reads as None, as vLLM's optional flags do."""

    @functools.wraps(parse)
    def parse_or_none(text: str) -> Any:
        return None if text in ("", "None") else parse(text)

    return parse_or_none


def parse_json(text: str) -> Any:
    """A flag's JSON text (``'{"rope_theta": 1e6}'``) -> its value."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(
            f"expected JSON such as '{{\"key\": 1}}', got {text!r} ({error})"
        ) from None


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` that reads a long flag spelled with underscores as the
    flag spelled with dashes, as vLLM's does: ``--max_model_len 64`` and
    ``--max_model_len=64`` are ``--max-model-len 64``. A flag declared with underscores keeps
    its spelling, and everything after a bare ``--`` is left alone. Its subcommands' parsers
    are FlexibleArgumentParsers too."""

    # NOTE: parse_args and parse_intermixed_args come through parse_known_args. (One
    # signature in place of typeshed's overloads of it, hence the ignore.)
    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(self._dashed(given), namespace)

    def _dashed(self, args: list[str]) -> list[str]:
        for index, arg in enumerate(args):
            if arg == "--":
                break
            name, equals, value = arg.partition("=")
            if name.startswith("--") and "_" in name and name not in self._option_string_actions:
                args[index] = name.replace("_", "-") + equals + value
        return args


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
