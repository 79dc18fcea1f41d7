"""How every seed of paged_llm is derived, so a request draws the same numbers wherever it
runs: in one engine or on any data-parallel replica, in a first run or a resumed job."""

from __future__ import annotations

import hashlib
import json


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed determined by ``parts`` (the same in every run and on every machine);
    ``derive_seed(0, 1)`` and ``derive_seed(0, "1")`` differ."""
    digest = hashlib.blake2b(json.dumps(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def request_seed(engine_seed: int, arrival_serial: int) -> int:
    """The base seed of a request without a seed of its own: the engine's seed with the
    request's arrival number, so that rerunning the same submission reproduces its draws."""
    return derive_seed(engine_seed, arrival_serial)
