"""The block pool: room for tokens, preemption from the tail, FCFS admission, nothing leaked."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from actorserve.actors.block_pool import BlockPool
from actorserve.messages.blocks import BlockNeed


def consistent(pool: BlockPool) -> bool:
    held = [b for table in pool.tables.values() for b in table]
    return sorted(held + list(pool._free)) == list(range(pool.num_blocks))


def test_a_request_gets_ceil_tokens_over_block_size_blocks():
    pool = BlockPool(10, 16)
    granted, preempted, denied = pool.allocate_step([BlockNeed("a", 17, True)])
    assert [len(g.new_block_ids) for g in granted] == [2] and not preempted and not denied
    granted, _, _ = pool.allocate_step([BlockNeed("a", 32, False)])
    assert granted[0].new_block_ids == []  # 32 tokens still fit in 2 blocks
    granted, _, _ = pool.allocate_step([BlockNeed("a", 33, False)])
    assert len(granted[0].new_block_ids) == 1 and pool.num_free == 7


def test_running_requests_preempt_from_the_tail_of_the_priority_order():
    pool = BlockPool(4, 16)
    pool.allocate_step(
        [BlockNeed("a", 16, True), BlockNeed("b", 16, True), BlockNeed("c", 32, True)]
    )
    assert pool.num_free == 0
    granted, preempted, denied = pool.allocate_step(
        [BlockNeed("a", 17, False), BlockNeed("b", 17, False), BlockNeed("c", 33, False)]
    )
    assert preempted == ["c"]  # the last one loses its blocks, a and b grow
    assert [g.request_id for g in granted] == ["a", "b"] and not denied
    assert "c" not in pool.tables and consistent(pool)


def test_a_request_preempts_itself_when_nothing_behind_it_can_give_way():
    pool = BlockPool(2, 16)
    pool.allocate_step([BlockNeed("a", 16, True)])
    pool.allocate_step([BlockNeed("b", 16, True)])
    granted, preempted, _ = pool.allocate_step(
        [BlockNeed("a", 16, False), BlockNeed("b", 17, False)]
    )
    assert [g.request_id for g in granted] == ["a"] and preempted == ["b"]


def test_new_requests_are_admitted_in_order_and_none_jumps_the_queue():
    pool = BlockPool(10, 16, watermark=0.1)
    pool.allocate_step([BlockNeed("running", 16, True)])
    granted, _, denied = pool.allocate_step(
        [
            BlockNeed("running", 17, False),
            BlockNeed("big", 16 * 8, True),
            BlockNeed("small", 1, True),
        ]
    )
    assert [g.request_id for g in granted] == ["running"]
    assert denied == ["big", "small"]  # big would break the watermark; small must wait behind it


def test_an_idle_pool_admits_a_request_that_takes_every_block():
    pool = BlockPool(4, 16)
    granted, _, denied = pool.allocate_step([BlockNeed("all", 64, True)])
    assert len(granted[0].new_block_ids) == 4 and not denied


def test_free_is_idempotent():
    pool = BlockPool(4, 16)
    pool.allocate_step([BlockNeed("a", 20, True)])
    assert pool.free("a") == 2 and pool.free("a") == 0 and pool.free("never") == 0
    assert pool.num_free == 4


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(1, 80), st.booleans()), max_size=60)
)
def test_random_steps_keep_the_pool_consistent_and_everything_comes_back(ops):
    pool = BlockPool(12, 8)
    sizes: dict[str, int] = {}
    for rid, grow, finish in ops:
        if finish and rid in pool.tables:
            pool.free(rid)
            sizes.pop(rid, None)
            continue
        running = [BlockNeed(r, n, False) for r, n in sizes.items() if r != rid]
        target = min(sizes.get(rid, 0) + grow, 96)
        need = BlockNeed(rid, target, rid not in pool.tables)
        granted, preempted, denied = pool.allocate_step(running + [need])
        for r in preempted:
            sizes.pop(r, None)
        for g in granted:
            if g.request_id == rid:
                sizes[rid] = target
        for r, table in pool.tables.items():
            assert len(table) * 8 >= sizes.get(r, 0)
        assert consistent(pool)
    for rid in list(pool.tables):
        pool.free(rid)
    assert pool.num_free == 12 and consistent(pool)
