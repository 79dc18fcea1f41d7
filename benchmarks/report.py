"""Helpers the benchmark scripts share: machine description, tables, JSON output."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(device: str, threads: int) -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "cpu": cpu_model_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def machine_line(machine: dict[str, Any], device: str, dtype: str) -> str:
    """One line of `machine_info` for a report's header."""
    return (
        f"Machine: {machine['cpu']} ({machine['cpu_count']} CPUs)"
        + (f", GPU {machine['gpu']}" if "gpu" in machine else "")
        + f"; torch {machine['torch']}, transformers {machine['transformers']}, "
        f"torch threads {machine['torch_threads']}; device {device}, dtype {dtype}"
    )


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: the first column left-aligned (names), the others right-aligned."""

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:,.2f}" if abs(value) < 1000 else f"{value:,.0f}"
        return str(value)

    lines = [list(headers), *([cell(v) for v in row] for row in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(headers))]
    formatted = [
        "  ".join(
            value.ljust(width) if i == 0 else value.rjust(width)
            for i, (value, width) in enumerate(zip(line, widths, strict=True))
        )
        for line in lines
    ]
    formatted.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(formatted)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # default=str: argument namespaces hold Paths.
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
