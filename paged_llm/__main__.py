"""``python -m paged_llm``: the `paged-llm` command line."""

from paged_llm.cli import main

raise SystemExit(main())
