"""Execution past one device: tensor-parallel worker processes (one model sharded over
several ranks) and data-parallel replicas (several engines fed by one `LLM`)."""
