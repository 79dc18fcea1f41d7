"""``python -m paged_llm.settings_docs docs/usage.md docs/vllm_compat.md``: rewrite the tables
that the docs generate from declarations in the code, in place: the settings tables of
`EngineArgs` (the blocks between ``<!-- generated: EngineArgs ... -->`` and
``<!-- /generated -->``) after a field changed, and the table of vLLM's names
(`paged_llm.vllm_names`, between ``<!-- generated: vllm_names -->`` and
``<!-- /generated -->``) after a name's status changed.

A module of its own, imported by nothing: ``python -m`` on a module that ``paged_llm``
imports would run it twice.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from paged_llm import vllm_names
from paged_llm.engine_args import EngineArgs
from paged_llm.settings import rewrite_generated_tables

DOCS_COMMAND = "python -m paged_llm.settings_docs docs/usage.md docs/vllm_compat.md"

_VLLM_NAMES_BLOCK = re.compile(
    r"<!-- generated: vllm_names[^\n]*-->\n.*?<!-- /generated -->", re.DOTALL
)


def rewrite_vllm_names_table(text: str) -> str:
    """``text`` with its vLLM names block written anew from `vllm_names.VLLM_NAMES`."""
    block = (
        f"<!-- generated: vllm_names; edit paged_llm/vllm_names.py, then run {DOCS_COMMAND} -->"
        f"\n\n{vllm_names.markdown_table()}\n\n<!-- /generated -->"
    )
    return _VLLM_NAMES_BLOCK.sub(lambda _: block, text)


def main(argv: list[str] | None = None) -> None:
    """Rewrite the generated tables of Markdown pages in place (`DOCS_COMMAND`)."""
    parser = argparse.ArgumentParser(
        prog="python -m paged_llm.settings_docs",
        description="Rewrite the tables generated from EngineArgs (the blocks between "
        "<!-- generated: EngineArgs ... --> and <!-- /generated -->) and from "
        "paged_llm/vllm_names.py (<!-- generated: vllm_names -->) in place.",
    )
    parser.add_argument("pages", nargs="+", type=Path, metavar="PAGE", help="a Markdown file")
    for page in parser.parse_args(argv).pages:
        text = page.read_text()
        rewritten = rewrite_vllm_names_table(text)
        try:
            if "<!-- generated: EngineArgs" in rewritten:
                rewritten = rewrite_generated_tables(rewritten, EngineArgs, DOCS_COMMAND)
        except ValueError as error:
            parser.error(f"{page}: {error}")
        if rewritten != text:
            page.write_text(rewritten)
        print(f"{page}: {'rewritten' if rewritten != text else 'up to date'}")


if __name__ == "__main__":
    main()
