"""llama.cpp's server (``llama-server``, built by ``setup_llama_cpp.sh``) as a benchmark
peer: started on loopback on a GGUF file, given token ids, asked for greedy tokens with
EOS ignored. Standard library only: the server is a binary, not a Python package."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

START_TIMEOUT_SECONDS = 120.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class LlamaServer:
    """One ``llama-server`` process with ``slots`` sequences decoded together (its
    continuous batching), each slot holding ``context_per_slot`` tokens; stopped on exit."""

    def __init__(
        self, binary: Path, gguf: Path, *, threads: int, slots: int, context_per_slot: int
    ) -> None:
        self.slots = slots
        self._port = _free_port()
        self._command = [
            str(binary),
            "--model", str(gguf),
            "--host", "127.0.0.1",
            "--port", str(self._port),
            "--threads", str(threads),
            "--threads-batch", str(threads),
            "--parallel", str(slots),
            "--ctx-size", str(slots * context_per_slot),
            "--no-webui",
        ]  # fmt: skip
        self._env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self._process: subprocess.Popen[bytes] | None = None
        self.pid: int | None = None  # the server's, once started
        # Its log goes to a file: a pipe nobody reads would stall the server once full (and
        # its --log-disable crashes this build).
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by _stop)

    def __enter__(self) -> LlamaServer:
        self._process = subprocess.Popen(
            self._command, env=self._env, stdout=self._log, stderr=subprocess.STDOUT
        )
        self.pid = self._process.pid
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not self._healthy():
            if self._process.poll() is not None:
                self._log.seek(0)
                log = self._log.read().decode(errors="replace")
                raise RuntimeError(f"llama-server exited at start:\n{log[-2000:]}")
            if time.monotonic() > deadline:
                self._stop()
                raise RuntimeError(f"llama-server did not answer in {START_TIMEOUT_SECONDS} s")
            time.sleep(0.2)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None
        self._log.close()

    def _request(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self._port}{path}",
            data=data,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            result: dict = json.loads(response.read())
            return result

    def _healthy(self) -> bool:
        try:
            return self._request("/health").get("status") == "ok"
        except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
            return False

    def version(self) -> str:
        return str(self._request("/props").get("build_info", "unknown"))

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        """``max_tokens`` greedy tokens after the token ids ``prompt``, EOS included."""
        result = self._request(
            "/completion",
            {
                "prompt": prompt,
                "n_predict": max_tokens,
                "temperature": 0.0,
                "top_k": 1,
                "ignore_eos": True,
                "return_tokens": True,
                "cache_prompt": False,
                "stream": False,
            },
        )
        tokens: list[int] = result["tokens"]
        return tokens

    def greedy_all(self, requests: list[tuple[list[int], int]]) -> list[list[int]]:
        """Every request's tokens, in order, with ``slots`` requests in flight at a time."""
        with ThreadPoolExecutor(max_workers=self.slots) as pool:
            return list(pool.map(lambda request: self.greedy(*request), requests))
