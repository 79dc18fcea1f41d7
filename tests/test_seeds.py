"""Seeds: one derivation for every request, stable across runs, machines and resumes."""

from __future__ import annotations

from paged_llm.seeds import derive_seed, request_seed


def test_derived_seeds_are_stable_and_depend_on_every_part() -> None:
    assert derive_seed(0, "a") == derive_seed(0, "a")
    assert (
        len({derive_seed(0, "a"), derive_seed(1, "a"), derive_seed(0, "b"), derive_seed(0, 1)}) == 4
    )
    assert derive_seed(0, 1) != derive_seed(0, "1")
    assert 0 <= derive_seed(2**40, "x" * 1000) < 2**63


def test_a_requests_seed_follows_the_engine_seed_and_its_arrival() -> None:
    assert request_seed(7, 3) == derive_seed(7, 3)
    assert len({request_seed(7, 3), request_seed(7, 4), request_seed(8, 3)}) == 3
