"""``python -m paged_llm.settings_docs docs/usage.md``: rewrite the settings tables that the
docs generate from `EngineArgs` (the blocks between ``<!-- generated: EngineArgs ... -->``
and ``<!-- /generated -->``) in place, after a field of `EngineArgs` changed.

A module of its own, imported by nothing: ``python -m`` on a module that ``paged_llm``
imports would run it twice.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from paged_llm.engine_args import EngineArgs
from paged_llm.settings import rewrite_generated_tables

DOCS_COMMAND = "python -m paged_llm.settings_docs docs/usage.md"


def main(argv: list[str] | None = None) -> None:
    """Rewrite the `EngineArgs` tables of Markdown pages in place (`DOCS_COMMAND`)."""
    parser = argparse.ArgumentParser(
        prog="python -m paged_llm.settings_docs",
        description="Rewrite the settings tables generated from EngineArgs (the blocks "
        "between <!-- generated: EngineArgs ... --> and <!-- /generated -->) in place.",
    )
    parser.add_argument("pages", nargs="+", type=Path, metavar="PAGE", help="a Markdown file")
    for page in parser.parse_args(argv).pages:
        text = page.read_text()
        try:
            rewritten = rewrite_generated_tables(text, EngineArgs, DOCS_COMMAND)
        except ValueError as error:
            parser.error(f"{page}: {error}")
        if rewritten != text:
            page.write_text(rewritten)
        print(f"{page}: {'rewritten' if rewritten != text else 'up to date'}")


if __name__ == "__main__":
    main()
