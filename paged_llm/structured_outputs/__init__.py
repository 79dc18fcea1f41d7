"""Structured outputs: completions constrained to a JSON schema, a regex, choices or a
grammar. The parameters need nothing beyond paged_llm; the grammars need xgrammar (the
``structured`` extra), imported only when a request uses them."""

from paged_llm.structured_outputs.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
