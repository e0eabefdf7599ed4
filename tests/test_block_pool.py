"""The block pool: room for tokens, preemption from the tail, FCFS admission, prefix caching,
swap, and (property-based) ref counts, free queue and tables that stay consistent."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from actorserve.actors.block_manager.block_pool import BlockPool
from actorserve.messages.blocks import BlockNeed

BS = 16


def new(rid, tokens, count=None, computed=0):
    return BlockNeed(rid, computed, len(tokens) if count is None else count, True, list(tokens))


def running(rid, computed, count, appended=(), lookahead=0):
    return BlockNeed(rid, computed, count, False, list(appended), lookahead=lookahead)


def consistent(pool: BlockPool) -> None:
    """Every block: ref_count == appearances in tables; free exactly when ref_count is 0."""
    held = Counter(b for table in pool.tables.values() for b in table)
    for block in pool.blocks:
        assert block.ref_count == held[block.block_id], block.block_id
        assert (block.block_id in pool._free) == (block.ref_count == 0), block.block_id
    for h, block_id in pool.cached.items():
        assert pool.blocks[block_id].hash == h
    cpu = [b for blocks in pool.swapped.values() for b in blocks] + pool._cpu_free
    assert sorted(cpu) == list(range(pool.num_cpu_blocks))


def test_a_request_gets_ceil_tokens_over_block_size_blocks():
    pool = BlockPool(10, BS)
    out = pool.allocate_step([new("a", range(17))])
    assert [len(g.block_ids) for g in out.granted] == [2] and not out.preempted
    out = pool.allocate_step([running("a", 17, 15, [1])])
    assert out.granted[0].block_ids == []  # 32 tokens still fit in 2 blocks
    out = pool.allocate_step([running("a", 32, 1, [2])])
    assert len(out.granted[0].block_ids) == 1 and pool.num_free == 7
    consistent(pool)


def test_running_requests_preempt_from_the_tail_of_the_priority_order():
    pool = BlockPool(4, BS, prefix_caching=False)
    pool.allocate_step([new("a", [1] * 16), new("b", [2] * 16), new("c", [3] * 32)])
    assert pool.num_free == 0
    out = pool.allocate_step([running("a", 16, 1), running("b", 16, 1), running("c", 32, 1)])
    assert out.preempted == ["c"]  # the last one loses its blocks, a and b grow
    assert [g.request_id for g in out.granted] == ["a", "b"] and not out.denied
    assert "c" not in pool.tables
    consistent(pool)


def test_an_overlapped_step_that_would_preempt_is_refused_and_changes_nothing():
    pool = BlockPool(4, BS, prefix_caching=False)
    pool.allocate_step([new("a", [1] * 16), new("b", [2] * 16), new("c", [3] * 32)])
    tables = {rid: list(t) for rid, t in pool.tables.items()}
    needs = [running("a", 16, 1, [7]), running("b", 16, 1, [8]), new("d", [4] * 5)]
    out = pool.allocate_step(needs, overlapped=True)
    assert out.denied == ["a", "b", "d"] and not (out.granted or out.preempted or out.swapped)
    assert pool.tables == tables and pool.tokens["a"] == [1] * 16  # not even the tokens
    consistent(pool)


def test_an_overlapped_step_that_fits_is_granted_as_usual():
    pool = BlockPool(8, BS, prefix_caching=False)
    pool.allocate_step([new("a", [1] * 16), new("b", [2] * 20)])
    out = pool.allocate_step(
        [running("a", 16, 1), running("b", 20, 1), new("c", [3] * 40)], 64, True
    )
    assert [g.request_id for g in out.granted] == ["a", "b", "c"] and not out.preempted
    consistent(pool)


def test_a_request_preempts_itself_when_nothing_behind_it_can_give_way():
    pool = BlockPool(2, BS)
    pool.allocate_step([new("a", [1] * 16)])
    pool.allocate_step([new("b", [2] * 16)])
    out = pool.allocate_step([running("a", 15, 1), running("b", 16, 1)])
    assert [g.request_id for g in out.granted] == ["a"] and out.preempted == ["b"]


def test_new_requests_are_admitted_in_order_and_none_jumps_the_queue():
    pool = BlockPool(10, BS, watermark=0.1)
    pool.allocate_step([new("running", [1] * 16)])
    out = pool.allocate_step(
        [running("running", 16, 1), new("big", [2] * 16 * 8), new("small", [3])]
    )
    assert [g.request_id for g in out.granted] == ["running"]
    assert out.denied == ["big", "small"]  # big would break the watermark; small waits behind it
    assert "big" not in pool.tokens and "small" not in pool.tokens


def test_an_idle_pool_admits_a_request_that_takes_every_block():
    pool = BlockPool(4, BS)
    out = pool.allocate_step([new("all", [7] * 64)])
    assert len(out.granted[0].block_ids) == 4 and not out.denied


def test_a_cached_prefix_is_reused_and_at_least_one_token_is_recomputed():
    pool = BlockPool(20, BS)
    system = list(range(100, 164))  # 4 full blocks
    out = pool.allocate_step([new("a", system + [1, 2, 3])])
    first = out.granted[0]
    assert first.num_computed == 0 and first.num_new_tokens == 67
    pool.free("a")  # its blocks stay cached while free
    consistent(pool)
    out = pool.allocate_step([new("b", system + [9, 9])])
    grant = out.granted[0]
    assert grant.num_computed == 64 and grant.num_new_tokens == 2
    assert grant.block_ids[:4] == first.block_ids[:4]
    out = pool.allocate_step([new("c", system)])  # the whole prompt cached: redo its last block
    assert out.granted[0].num_computed == 48 and out.granted[0].num_new_tokens == 16
    assert pool.hit_tokens == 64 + 48
    consistent(pool)


def test_the_new_token_budget_is_spent_after_prefix_hits_and_chunks_the_last_admitted():
    pool = BlockPool(40, BS)
    system = list(range(200, 264))  # 4 full blocks
    pool.allocate_step([new("first", system + [1])])
    pool.free("first")
    needs = [new(f"r{i}", system + [i] * 10) for i in range(4)] + [new("late", [9] * 40)]
    out = pool.allocate_step(needs, new_token_budget=45)
    assert [g.num_new_tokens for g in out.granted] == [10, 10, 10, 10, 5]
    assert [g.num_computed for g in out.granted] == [64, 64, 64, 64, 0]
    out = pool.allocate_step([new("next", [3] * 5)], new_token_budget=0)
    assert out.denied == ["next"] and "next" not in pool.tokens
    consistent(pool)


def test_a_hash_match_with_other_tokens_is_not_a_hit():
    pool = BlockPool(10, BS)
    pool.allocate_step([new("a", list(range(40)))])
    block = pool.blocks[pool.tables["a"][0]]
    block.tokens = tuple(range(1, 17))  # as if a colliding hash had been stored
    out = pool.allocate_step([new("b", list(range(40)))])
    assert out.granted[0].num_computed == 0


def test_free_is_idempotent_and_evicts_least_recently_freed_first():
    pool = BlockPool(4, BS)
    pool.allocate_step([new("a", list(range(20)))])
    a_full, a_partial = pool.tables["a"]
    assert pool.free("a") == 2 and pool.free("a") == 0 and pool.free("never") == 0
    assert pool.num_free == 4
    pool.allocate_step([new("b", [5] * 40)])  # 3 blocks: the 2 never used, then a's last one
    assert a_partial in pool.tables["b"] and a_full not in pool.tables["b"]
    assert pool.cached[pool.blocks[a_full].hash] == a_full  # a's full block is still cached
    consistent(pool)


def test_swap_out_and_back_in_keeps_the_request_and_its_computed_tokens():
    pool = BlockPool(4, BS, num_cpu_blocks=4, swap=True, prefix_caching=False)
    pool.allocate_step([new("a", [1] * 32), new("b", [2] * 32)])
    out = pool.allocate_step([running("a", 32, 1), running("b", 32, 1)])
    assert out.swapped == ["b"] and out.preempted == []
    assert len(out.swap_out) == 2 and pool.num_cpu_free == 2
    consistent(pool)
    pool.free("a")
    out = pool.allocate_step([new("b", [2] * 33, count=1, computed=32)])
    grant = out.granted[0]
    assert grant.num_computed == 32 and len(grant.block_ids) == 3
    assert [gpu for _, gpu in out.swap_in] == grant.block_ids[:2]
    assert pool.num_cpu_free == 4
    consistent(pool)


def test_lookahead_room_comes_from_spare_blocks_only_and_never_preempts():
    pool = BlockPool(10, BS, watermark=0.2, prefix_caching=False)  # 2 blocks of watermark
    pool.allocate_step([new("a", [1] * 16), new("b", [2] * 16)])
    out = pool.allocate_step([running("a", 16, 1, [5], lookahead=BS), running("b", 16, 1, [6])])
    a, b = out.granted
    assert len(a.block_ids) == 2  # one for the step's token, one of room beyond it
    assert len(b.block_ids) == 1 and pool.num_free == 5
    out = pool.allocate_step([running("a", 17, 1, [7], lookahead=BS)])
    assert out.granted[0].block_ids == []  # 18 tokens + 16 of room: its 3 blocks hold them
    pool.allocate_step([new("c", [3] * 48)])  # 3 blocks: 2 free, both the watermark
    out = pool.allocate_step([running("a", 18, 15, [8] * 15, lookahead=BS)])
    assert out.granted[0].block_ids == [] and not out.preempted  # 33 tokens: no room spared
    out = pool.allocate_step([running("a", 33, 16, lookahead=BS), running("b", 17, 1)])
    assert len(out.granted[0].block_ids) == 1 and len(out.granted[1].block_ids) == 0
    assert not out.preempted and pool.num_free == 1
    consistent(pool)


def test_a_request_swapped_out_with_lookahead_room_comes_back_only_when_all_of_it_fits():
    pool = BlockPool(6, BS, watermark=0.0, prefix_caching=False, num_cpu_blocks=6, swap=True)
    pool.allocate_step([new("a", [1] * 16)])
    pool.allocate_step([running("a", 16, 1, [5], lookahead=BS)])  # 3 blocks for 17 tokens
    pool.allocate_step([new("b", [2] * 48)])  # the 3 others
    out = pool.allocate_step([running("b", 48, 1, [6]), running("a", 17, 1, [7])])
    assert out.swapped == ["a"] and pool.num_free == 2
    out = pool.allocate_step([new("a", [1] * 18, count=1, computed=17)])
    assert out.denied == ["a"] and pool.num_free == 2  # 3 blocks to bring back, 2 free
    pool.free("b")
    out = pool.allocate_step([new("a", [1] * 18, count=1, computed=17)])
    assert len(out.granted[0].block_ids) == 3 and len(out.swap_in) == 3
    consistent(pool)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from("abcdef"),
            st.integers(1, 70),
            st.sampled_from(["step", "step", "finish", "fork"]),
            st.integers(0, 3),
        ),
        max_size=50,
    ),
    st.booleans(),
)
def test_random_steps_keep_the_pool_consistent_and_everything_comes_back(ops, swap):
    """Allocate, append, cache hits, fork, preempt (recompute or swap), swap back in, free,
    lookahead."""
    pool = BlockPool(14, 8, num_cpu_blocks=10, swap=swap)
    prefixes = [[7] * 24, [8] * 16, [9] * 5, []]
    state: dict[str, list[int]] = {}  # running: [computed, tokens the pool knows]
    waiting: dict[str, tuple[int, int]] = {}  # preempted or swapped: (tokens, computed kept)

    def step_need(rid: str, grow: int) -> BlockNeed:
        computed, total = state[rid]
        if computed < total:  # mid-prefill: more of the prompt
            return running(rid, computed, min(grow, total - computed), lookahead=lookahead)
        state[rid][1] += 1  # decode: one sampled token told, one computed
        return running(rid, computed, 1, [3], lookahead=lookahead)

    for rid, grow, op, prefix in ops:
        lookahead = 8 * (prefix % 2)  # half the steps ask for a block of room beyond the step
        if op == "finish":
            pool.free(rid)
            state.pop(rid, None)
            waiting.pop(rid, None)
            consistent(pool)
            continue
        parents = [r for r, (c, _) in state.items() if c >= 2 and r != rid]
        if op == "fork" and (rid in state or rid in waiting or rid in pool.tables or not parents):
            op = "step"
        needs = [step_need(r, 1) for r in state if r != rid]
        if op == "fork":
            computed = state[parents[0]][0]
            needs.append(BlockNeed(rid, computed - 1, 1, True, [1] * computed, fork_of=parents[0]))
        elif rid in state:
            needs.append(step_need(rid, grow))
        elif rid in waiting:
            total, kept = waiting[rid]
            needs.append(new(rid, [1] * total, max(1, total - kept), kept))
        else:
            tokens = prefixes[prefix] + [ord(rid)] * grow
            needs.append(new(rid, tokens))
        totals = {n.request_id: len(n.token_ids) for n in needs if n.is_new}
        out = pool.allocate_step(needs)
        for g in out.granted:
            if g.request_id in totals:
                waiting.pop(g.request_id, None)
                state[g.request_id] = [0, totals[g.request_id]]
            state[g.request_id][0] = g.num_computed + g.num_new_tokens
        for r in out.preempted + out.swapped:
            computed, total = state.pop(r)
            waiting[r] = (total, computed if r in out.swapped else 0)
        for r in out.denied:
            state.pop(r, None)
        for r, table in pool.tables.items():
            assert len(table) * 8 >= state[r][0]
        consistent(pool)
    for rid in list(pool.tables) + list(pool.swapped):
        pool.free(rid)
    assert pool.num_free == 14 and pool.num_cpu_free == 10
    consistent(pool)


def test_a_fork_shares_full_blocks_and_copies_the_partial_one_on_write():
    pool = BlockPool(10, BS)
    prompt = list(range(300, 340))  # 40 tokens: blocks 0, 1 full, block 2 partial
    parent = pool.allocate_step([new("p", prompt)]).granted[0].block_ids
    fork = BlockNeed("c", 39, 1, True, prompt, fork_of="p")
    out = pool.allocate_step([running("p", 40, 1, [7]), fork])
    child = out.granted[1]
    assert child.num_computed == 39 and child.num_new_tokens == 1
    assert child.block_ids[:2] == parent[:2] and child.block_ids[2] != parent[2]
    assert out.copies == [(parent[2], child.block_ids[2])]
    assert [pool.blocks[b].ref_count for b in parent] == [2, 2, 1]
    consistent(pool)
    pool.free("p")
    assert [pool.blocks[b].ref_count for b in child.block_ids] == [1, 1, 1]
    consistent(pool)


def test_a_fork_at_a_block_boundary_copies_nothing():
    pool = BlockPool(10, BS)
    prompt = list(range(400, 433))  # 33 tokens: the fork shares 32, writes a block of its own
    pool.allocate_step([new("p", prompt)])
    out = pool.allocate_step([BlockNeed("c", 32, 1, True, prompt, fork_of="p")])
    assert out.copies == [] and len(out.granted[0].block_ids) == 3
    assert out.granted[0].block_ids[:2] == pool.tables["p"][:2]
    consistent(pool)


def test_a_fork_whose_sample_0_is_gone_waits():
    pool = BlockPool(10, BS)
    out = pool.allocate_step([BlockNeed("c", 10, 1, True, list(range(11)), fork_of="gone")])
    assert out.denied == ["c"] and "c" not in pool.tables
