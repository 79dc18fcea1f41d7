"""Ray is an optional extra: `import paged_llm` never imports it, and without it
`paged_llm.ray` and ``paged-llm generate --ray-address`` name the extra to install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.jobs.files import cli_env

WITHOUT_RAY = """
import sys
import paged_llm, paged_llm.cli
assert not any(name == "ray" or name.startswith("ray.") for name in sys.modules), "ray imported"
sys.modules["ray"] = None  # as if Ray were not installed
try:
    import paged_llm.ray
except ImportError as error:
    print("import:", error)
code = paged_llm.cli.main(["generate", "-i", sys.argv[1], "-o", sys.argv[2], "--ray-address", "auto"])
print("exit code:", code)
"""


def test_without_ray_paged_llm_imports_and_the_ray_parts_name_the_extra(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": 1, "prompt": "Hello"}\n')
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_RAY, str(source), str(tmp_path / "out")],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert (
        'import: paged_llm.ray needs Ray Data, an optional extra: pip install "paged_llm[ray]"'
        in done.stdout
    )
    assert "exit code: 1" in done.stdout
    assert 'pip install "paged_llm[ray]"' in done.stderr
