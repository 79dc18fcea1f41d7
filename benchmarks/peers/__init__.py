"""Other engines the throughput benchmark compares paged_llm with, each in an environment of
its own: a setup script that makes it, and a standalone worker that runs under it."""
