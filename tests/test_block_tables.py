"""The Worker's persistent block tables (actors/worker/block_tables.py): a row per request, new
block ids appended in place, a step's tables gathered in the step's order, padding always 0."""

from __future__ import annotations

import numpy as np

from actorserve.actors.worker.block_tables import BlockTables


def test_a_step_gathers_the_scheduled_rows_in_its_order_padded_with_block_0():
    tables = BlockTables(rows=4, columns=2)
    a, b = tables.take_row(), tables.take_row()
    tables.write(a, 0, [7, 8, 9])  # wider than the table was: it grows
    tables.write(b, 0, [3])
    tables.write(b, 1, [4])  # appended where its blocks end
    assert tables.gather(np.array([b, a]), 3).tolist() == [[3, 4, 0], [7, 8, 9]]


def test_rows_are_reused_zeroed_and_grow_past_the_first_guess():
    tables = BlockTables(rows=2, columns=4)
    first = tables.take_row()
    tables.write(first, 0, [5, 6])
    tables.release(first, 2)
    again = tables.take_row()
    assert again == first and tables.gather(np.array([again]), 4).tolist() == [[0, 0, 0, 0]]
    rows = [again] + [tables.take_row() for _ in range(4)]  # twice past the two rows
    assert sorted(rows) == list(range(5))
    for i, row in enumerate(rows):
        tables.write(row, 0, [i + 1])
    assert tables.gather(np.array(rows), 1).ravel().tolist() == [1, 2, 3, 4, 5]


def test_clear_frees_every_row():
    tables = BlockTables(rows=2, columns=2)
    tables.write(tables.take_row(), 0, [1, 2])
    tables.clear()
    assert tables.take_row() == 0 and not tables.table.any()


def test_take_changes_names_the_rows_written_or_released_since_the_last_call():
    tables = BlockTables(rows=4, columns=4)
    assert tables.take_changes() is None  # new: a copy takes it whole
    a, b, c = tables.take_row(), tables.take_row(), tables.take_row()
    tables.write(c, 0, [1])
    tables.write(a, 0, [2, 3])
    assert tables.take_changes() == [a, c]
    assert tables.take_changes() == []
    tables.release(c, 1)
    tables.write(b, 0, [4])
    assert tables.take_changes() == [b, c]
    tables.write(a, 2, [5, 6, 7])  # past 4 columns: the table grows, every row moves
    assert tables.take_changes() is None
    tables.clear()
    assert tables.take_changes() is None and tables.take_changes() == []
