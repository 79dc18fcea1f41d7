"""Batch jobs over files, shared by the `paged-llm` command, ``run-batch`` and Ray Data:
their input rows, their crash-safe output, and the runner that joins them to an `LLM`."""
