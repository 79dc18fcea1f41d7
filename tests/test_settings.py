"""paged_llm.settings on a small settings class of its own: validation, platform defaults,
command-line flags and the generated docs tables."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import pytest

from paged_llm.settings import (
    BOOL,
    CliFlag,
    FlexibleArgumentParser,
    add_cli_arguments,
    at_least,
    check_settings,
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
        valid=at_least(1),
        platform_defaults={"cpu": 4, "cuda": 64},
    )
    length: int | None = honoured(
        None, "Longest item.", cli=CliFlag(aliases=("--len",)), default_doc="the model's"
    )
    fast: bool = honoured(True, "Go fast.", valid=BOOL)
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


def test_every_field_is_a_flag_that_defaults_to_the_fields_default() -> None:
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser, Toy)
    assert Toy(**vars(parser.parse_args([]))) == Toy()
    given = parser.parse_args(["--batch", "3", "--len", "9", "--no-fast", "--workers", "2"])
    changed = {"batch": 3, "length": 9, "fast": False, "workers": 2}
    assert vars(given) == {**vars(parser.parse_args([])), **changed}


def test_flags_read_their_text_by_the_fields_type() -> None:
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser, Toy)
    # A type that admits None reads "None" as None; a list takes one or more values.
    given = parser.parse_args(["--length", "None", "--cache-dir", "None", "--hooks", "a", "b"])
    assert (given.length, given.cache_dir, given.hooks) == (None, None, ["a", "b"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--batch", "many"])


def test_string_values_a_field_accepts_are_its_flags_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser, Toy)
    assert parser.parse_args(["--mode", "slow"]).mode == "slow"
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "fast"])
    assert "argument --mode: invalid choice: 'fast'" in capsys.readouterr().err


def test_a_flags_help_is_its_doc_and_default_without_backticks() -> None:
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser, Toy, help_texts={"fast": "Go fast, 100%."})
    helps = {action.dest: action.help for action in parser._actions}
    assert helps["batch"] == "Most items in one batch | at once. (default: 4 on cpu, 64 on cuda)"
    assert helps["length"] == "Longest item. (default: the model's)"
    assert helps["fast"] == "Go fast, 100%%. (default: True)"
    assert helps["workers"] == "One worker only. (accepted: 1)"


def test_on_a_parser_each_kinds_flags_go_in_its_group() -> None:
    parser = argparse.ArgumentParser()
    other = ("others", "Accepted for compatibility.")
    add_cli_arguments(parser, Toy, {"no-op": other, "refused": other})
    groups = {
        group.title: [action.dest for action in group._group_actions]
        for group in parser._action_groups
    }
    assert groups["others"] == ["cache_dir", "workers", "hooks"]
    assert "batch" in groups["options"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--max_model_len", "64"],
        ["--max_model_len=64"],
        ["--max-model-len=64"],
        ["--max-model-len", "64"],
    ],
)
def test_the_flexible_parser_reads_underscores_as_dashes(argv: list[str]) -> None:
    parser = FlexibleArgumentParser()
    parser.add_argument("--max-model-len", type=int)
    assert parser.parse_args(argv).max_model_len == 64


def test_the_flexible_parser_keeps_underscored_flags_and_what_follows_a_double_dash() -> None:
    parser = FlexibleArgumentParser()
    parser.add_argument("--chat_template_path")
    parser.add_argument("--no-fast", action="store_true")
    parser.add_argument("rest", nargs="*")
    given = parser.parse_args(["--chat_template_path", "t.jinja", "--no_fast", "--", "--a_b"])
    assert (given.chat_template_path, given.no_fast, given.rest) == ("t.jinja", True, ["--a_b"])
    commands = FlexibleArgumentParser().add_subparsers(dest="command")
    assert isinstance(commands.add_parser("run"), FlexibleArgumentParser)


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
