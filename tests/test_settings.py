"""paged_llm.settings on a small settings class of its own: validation, platform defaults,
command-line flags and the generated docs tables."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import pytest

from paged_llm.settings import (
    BOOL,
    FLAG,
    CliFlag,
    add_cli_arguments,
    at_least,
    check_settings,
    cli_settings,
    honoured,
    markdown_table,
    no_op,
    refused_unless,
    resolved_setting,
    rewrite_generated_tables,
)

COMMAND = "python -m toy docs/toy.md"


@dataclass(kw_only=True)
class Toy:
    batch: int | None = honoured(
        None,
        "Most `items` in one batch | at once.",
        cli=FLAG,
        valid=at_least(1),
        platform_defaults={"cpu": 4, "cuda": 64},
    )
    length: int | None = honoured(
        None, "Longest item.", cli=CliFlag(names=("--len",)), default_doc="the model's"
    )
    fast: bool = honoured(True, "Go fast.", cli=FLAG, valid=BOOL)
    mode: str = honoured(
        "auto", 'How: `"auto"` or `"slow"`.', accepts=("auto", "slow"), table="extra"
    )
    cache_dir: str | None = no_op(None, "Nothing is cached.")
    workers: int = refused_unless((1,), "One worker only.")
    hooks: list[Any] | None = refused_unless((None, []), "No hooks.")

    def __post_init__(self) -> None:
        check_settings(self, "Toy")


def _page(*selectors: str) -> str:
    blocks = [
        f"<!-- generated: {selector}; -->\nstale\n<!-- /generated -->" for selector in selectors
    ]
    return "# Toy\n\n" + "\n\nprose\n\n".join(blocks) + "\n"


ALL_TABLES = ("Toy honoured", "Toy honoured extra", "Toy no-op", "Toy refused")


# ----- validation and defaults ------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"workers": 2},
            r"^Toy argument workers=2 is not supported by paged_llm: One worker only\. "
            r"Leave it at 1\.$",
        ),
        ({"hooks": [print]}, r"hooks=\[<built-in function print>\] .* Leave it at None or \[\]"),
        # A bool is not the count it equals.
        ({"workers": True}, r"workers=True is not supported"),
        ({"mode": "fast"}, r"mode='fast' is not supported .* Leave it at 'auto' or 'slow'"),
        ({"batch": 0}, r"^Toy argument batch must be an integer >= 1, got 0\.$"),
        ({"fast": 1}, r"^Toy argument fast must be a bool, got 1\.$"),
    ],
)
def test_check_settings_names_the_setting_its_value_and_what_is_allowed(
    settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Toy(**settings)


def test_none_passes_validation_where_it_is_the_default() -> None:
    assert Toy(batch=None, hooks=[]).batch is None


def test_resolved_setting_fills_in_the_platforms_default_for_none() -> None:
    assert resolved_setting(Toy(), "batch", "cpu") == 4
    assert resolved_setting(Toy(), "batch", "cuda") == 64
    assert resolved_setting(Toy(batch=8), "batch", "cuda") == 8
    assert resolved_setting(Toy(), "length", "cpu") is None


# ----- the command line -------------------------------------------------------------------


def test_flags_parse_as_the_fields_type_and_unset_ones_pass_nothing() -> None:
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser, Toy)
    assert cli_settings(parser.parse_args([]), Toy) == {}
    given = parser.parse_args(["--batch", "3", "--len", "9", "--no-fast"])
    assert cli_settings(given, Toy) == {"batch": 3, "length": 9, "fast": False}


def test_a_flags_help_is_its_doc_and_default_without_backticks() -> None:
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser, Toy)
    helps = {action.dest: action.help for action in parser._actions}
    assert helps["batch"] == "Most items in one batch | at once. (default: 4 on cpu, 64 on cuda)"
    assert helps["length"] == "Longest item. (default: the model's)"
    assert helps["fast"] == "Go fast. (default: True)"
    assert "mode" not in helps


# ----- the docs tables --------------------------------------------------------------------


def test_markdown_table_writes_header_and_one_row_per_setting_of_its_kind_and_table() -> None:
    assert markdown_table(Toy, "honoured") == (
        "| argument | default | meaning |\n"
        "| --- | --- | --- |\n"
        "| `batch` | 4 on cpu, 64 on cuda | Most `items` in one batch \\| at once. |\n"
        "| `length` | the model's | Longest item. |\n"
        "| `fast` | `True` | Go fast. |"
    )
    assert markdown_table(Toy, "honoured", "extra").endswith(
        '| `mode` | `"auto"` | How: `"auto"` or `"slow"`. |'
    )
    assert markdown_table(Toy, "refused") == (
        "| argument | accepted | why |\n"
        "| --- | --- | --- |\n"
        "| `workers` | `1` | One worker only. |\n"
        "| `hooks` | `None` or `[]` | No hooks. |"
    )
    with pytest.raises(ValueError, match=r"Toy has no no-op settings listed in table 'extra'"):
        markdown_table(Toy, "no-op", "extra")


def test_rewrite_generated_tables_writes_each_block_and_leaves_the_rest_alone() -> None:
    page = _page(*ALL_TABLES, "Other honoured")
    rewritten = rewrite_generated_tables(page, Toy, COMMAND)
    assert rewritten.startswith(
        f"# Toy\n\n<!-- generated: Toy honoured; edit Toy, then run {COMMAND} -->\n\n"
        f"{markdown_table(Toy, 'honoured')}\n\n<!-- /generated -->\n\nprose\n\n"
    )
    assert rewritten.count("stale") == 1
    assert rewritten.endswith("<!-- generated: Other honoured; -->\nstale\n<!-- /generated -->\n")
    assert rewrite_generated_tables(rewritten, Toy, COMMAND) == rewritten


def test_rewrite_generated_tables_refuses_a_page_that_leaves_a_setting_out() -> None:
    with pytest.raises(ValueError, match=r"Toy settings mode are in no generated table.*toy\.md"):
        rewrite_generated_tables(_page("Toy honoured", "Toy no-op", "Toy refused"), Toy, COMMAND)
    with pytest.raises(ValueError, match=r"names kind 'ignored'"):
        rewrite_generated_tables(_page(*ALL_TABLES, "Toy ignored"), Toy, COMMAND)
