"""Adapters that let other tools drive an `LLM`; each imports its tool, an optional extra,
only when it is imported itself."""
