"""What runs past one process, below the engine: tensor-parallel collectives (`group`), the
supervision of child processes, tensor-parallel workers and data-parallel replicas alike
(`supervisor`), freeing what a finished engine held (`memory`) and finding a free port
(`ports`)."""

from paged_llm.distributed.memory import cleanup_dist_env_and_memory
from paged_llm.distributed.ports import get_open_port

__all__ = ["cleanup_dist_env_and_memory", "get_open_port"]
