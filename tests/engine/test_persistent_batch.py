"""The persistent batch custom logits processors see: vLLM's `BatchUpdate` semantics (holes
filled lowest first, then condensed from the end), checked on examples and, as a property,
by a processor-side mirror kept with `process_dict_updates`."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from paged_llm.engine.persistent_batch import PersistentBatch
from paged_llm.engine.sequence import Sequence
from paged_llm.logits_processors import BatchUpdate, MoveDirectionality, process_dict_updates
from tests.engine.helpers import make_seq

UNI = MoveDirectionality.UNIDIRECTIONAL


def _rows(batch: PersistentBatch, seqs: list[Sequence]) -> tuple[BatchUpdate | None, list[int]]:
    """The update and, per row, the seq_id it holds."""
    update, order = batch.update(seqs)
    return update, [seqs[index].seq_id for index in order]


def test_rows_stay_put_and_the_first_step_adds_in_step_order() -> None:
    a, b, c = (make_seq([1, 2]) for _ in range(3))
    batch = PersistentBatch()
    update, rows = _rows(batch, [a, b, c])
    assert update is not None and update.batch_size == 3
    assert [(row, params) for row, params, _, _ in update.added] == [
        (0, a.sampling_params),
        (1, b.sampling_params),
        (2, c.sampling_params),
    ]
    assert rows == [a.seq_id, b.seq_id, c.seq_id]
    # The same sequences in another step order: no change, rows kept.
    update, rows = _rows(batch, [c, a, b])
    assert update is None and rows == [a.seq_id, b.seq_id, c.seq_id]


def test_a_new_sequence_fills_the_lowest_hole_and_the_rest_is_condensed() -> None:
    a, b, c, d, e = (make_seq([1]) for _ in range(5))
    batch = PersistentBatch()
    batch.update([a, b, c, d])
    # b (row 1) and c (row 2) leave, e joins: e takes row 1, d moves from 3 to 2. Every
    # vacated row is refilled, so none is reported removed (vLLM's convention).
    update, rows = _rows(batch, [d, e, a])
    assert update is not None
    assert [row for row, *_ in update.added] == [1]
    assert list(update.moved) == [(3, 2, UNI)]
    assert list(update.removed) == []
    assert rows == [a.seq_id, e.seq_id, d.seq_id]


def test_trailing_holes_are_removed_without_moves() -> None:
    a, b, c, d = (make_seq([1]) for _ in range(4))
    batch = PersistentBatch()
    batch.update([a, b, c, d])
    # b and d leave: c moves down into row 1; row 3 (and row 2, vacated by the move) go.
    update, rows = _rows(batch, [a, c])
    assert update is not None
    assert list(update.moved) == [(2, 1, UNI)]
    assert list(update.removed) == [3]
    assert rows == [a.seq_id, c.seq_id]
    update, rows = _rows(batch, [])
    assert update is not None and update.batch_size == 0 and list(update.removed) == [1, 0]


def test_the_output_list_handed_out_grows_with_the_sequence() -> None:
    seq = make_seq([5, 6])
    batch = PersistentBatch()
    update, _ = batch.update([seq])
    assert update is not None
    (_, _, prompt, output) = update.added[0]
    assert prompt == [5, 6] and output == []
    seq.token_ids += [7, 8]
    assert batch.update([seq])[0] is None
    assert output == [7, 8]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 11), unique=True, max_size=8), max_size=12))
def test_a_mirror_kept_with_process_dict_updates_matches_the_rows(steps: list[list[int]]) -> None:
    pool = [make_seq([1]) for _ in range(12)]
    batch = PersistentBatch()
    mirror: dict[int, int] = {}
    previous: dict[int, int] = {}  # seq_id -> row in the previous step
    for step in steps:
        seqs = [pool[i] for i in step]
        update, order = batch.update(seqs)
        process_dict_updates(mirror, update, lambda params, prompt, output: id(output))
        rows = [seqs[index].seq_id for index in order]
        assert sorted(order) == list(range(len(seqs)))
        # A sequence that samples again keeps its row unless a move brought it down.
        moved = {source for source, _, _ in update.moved} if update else set()
        for row, seq_id in enumerate(rows):
            if seq_id in previous and previous[seq_id] not in moved:
                assert previous[seq_id] == row
        if update is None:
            assert rows == [seq_id for seq_id, _ in sorted(previous.items(), key=lambda x: x[1])]
        else:
            assert update.batch_size == len(seqs)
            assert not {row for row, *_ in update.added} & set(update.removed)
        # The mirror holds one entry per row, each the live list handed out for its sequence.
        assert sorted(mirror) == list(range(len(seqs)))
        outputs = {seq_id: id(batch._outputs[seq_id]) for seq_id in rows}
        assert [mirror[row] for row in range(len(seqs))] == [outputs[s] for s in rows]
        previous = {seq_id: row for row, seq_id in enumerate(rows)}
