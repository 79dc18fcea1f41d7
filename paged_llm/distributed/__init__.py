"""What runs past one process, below the engine: tensor-parallel collectives (`group`) and
the supervision of child processes, tensor-parallel workers and data-parallel replicas
alike (`supervisor`)."""
