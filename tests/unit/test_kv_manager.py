import random

import pytest

from helpers import tiny_kv
from phalanx.kv_manager import NoFreeBlocksError


def test_admit_grow_commit_free_exact_blocks():
    kv = tiny_kv()
    tokens = list(range(1, 7))                         # 6 tokens
    m = kv.match(tokens)
    assert m.num_tokens == 0 and kv.num_blocks_to_admit(m, 6) == 2
    assert kv.admit(1, m, 6) == 0
    assert kv.block_table(1) == [0, 1]
    kv.commit(1, tokens, 6)                            # block 0 full -> in the tree
    assert len(kv.tree) == 1 and kv.pool.cached[0] and not kv.pool.cached[1]
    tokens += [7, 8, 9]
    assert kv.grow(1, 9)
    assert kv.block_table(1) == [0, 1, 2]
    kv.commit(1, tokens, 8)
    assert len(kv.tree) == 2
    kv.check_integrity()
    kv.free(1)
    assert kv.pool.ref_counts[:3] == [0, 0, 0]
    assert kv.pool.num_free == 14 and kv.pool.num_cached_unreferenced == 2
    kv.check_integrity()


def test_duplicate_commit_swaps_to_the_cached_block():
    kv = tiny_kv()
    tokens = [5, 6, 7, 8, 9]
    kv.admit(1, kv.match(tokens), 5)
    kv.admit(2, kv.match(tokens), 5)                   # admitted before 1 committed: no hit
    assert kv.block_table(1) == [0, 1] and kv.block_table(2) == [2, 3]
    kv.commit(1, tokens, 4)
    kv.commit(2, tokens, 4)                            # same key: 2 now shares block 0
    assert kv.block_table(2) == [0, 3]
    assert kv.pool.ref_counts[0] == 2 and kv.pool.ref_counts[2] == 0
    assert 2 in list(kv.pool._free)
    kv.check_integrity()


def test_admit_refuses_when_short_and_changes_nothing():
    kv = tiny_kv(num_blocks=3)
    kv.admit(1, kv.match([1] * 8), 8)
    with pytest.raises(NoFreeBlocksError):
        kv.admit(2, kv.match([2] * 8), 8)
    assert 2 not in kv and kv.pool.num_free == 1
    assert not kv.grow(1, 13)
    assert kv.block_table(1) == [0, 1]
    kv.check_integrity()


def test_matched_unreferenced_blocks_count_against_availability():
    kv = tiny_kv(num_blocks=4)
    kv.admit(1, kv.match([1, 2, 3, 4, 5]), 5)
    kv.commit(1, [1, 2, 3, 4, 5], 4)
    kv.free(1)                                         # block 0 cached, unreferenced
    m = kv.match([1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13])
    assert m.num_tokens == 4 and m.num_unreferenced == 1
    assert kv.num_blocks_to_admit(m, 12) == 2 + 1
    kv.admit(2, m, 12)
    assert kv.block_table(2)[0] == 0
    kv.check_integrity()


def test_usage_counts_only_referenced_blocks():
    kv = tiny_kv(num_blocks=4)
    kv.admit(1, kv.match([1, 2, 3, 4, 5]), 5)
    assert kv.usage == 0.5
    kv.commit(1, [1, 2, 3, 4, 5], 4)
    kv.free(1)
    assert kv.usage == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_integrity_under_random_workload(seed):
    """Thousands of random admits, grows, commits, copies and frees keep every invariant."""
    rng = random.Random(seed)
    kv = tiny_kv(num_blocks=24, tokens_per_block=4)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 14))] for _ in range(6)]
    live: dict[int, list] = {}
    next_id, ops = 0, 0
    while ops < 4000:
        ops += 1
        action = rng.random()
        if action < 0.35 or not live:
            tokens = list(rng.choice(prefixes)) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            extra = rng.choice([b"", b"", b"salt"])
            m = kv.match(tokens, extra)
            slots = min(len(tokens), m.num_tokens + rng.randrange(1, 8))
            try:
                kv.admit(next_id, m, slots, extra)
            except NoFreeBlocksError:
                continue
            live[next_id] = [tokens, slots]
            next_id += 1
        elif action < 0.7:
            rid = rng.choice(list(live))
            tokens, computed = live[rid]
            if computed < len(tokens):
                step = min(len(tokens) - computed, rng.randrange(1, 6))
            else:
                tokens.append(rng.randrange(50))
                step = 1
            if kv.grow(rid, computed + step):
                live[rid][1] = computed + step
                kv.commit(rid, tokens, computed + step)
        elif action < 0.8:
            kv.take_copy_ops()
            kv.release_copy_sources()
        else:
            rid = rng.choice(list(live))
            kv.free(rid)
            del live[rid]
        kv.check_integrity()
    for rid in list(live):
        kv.free(rid)
    kv.take_copy_ops()
    kv.release_copy_sources()
    kv.check_integrity()
    assert kv.pool.num_available == kv.num_blocks
    assert kv.tree.num_evicted > 0


def test_invalidate_makes_old_blocks_unmatchable_and_frees_the_unheld():
    kv = tiny_kv()
    old = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    kv.admit(1, kv.match(old), len(old))
    kv.commit(1, old, len(old))
    kv.free(1)                                         # cached, held by nobody
    kv.admit(2, kv.match(old), len(old))               # a request that keeps running (holds its blocks)
    held = list(kv.block_table(2))
    assert kv.match(old).num_tokens == 8
    kv.invalidate(b"v1")
    assert kv.pool.num_cached_unreferenced == 0
    assert kv.match(old).num_tokens == 0               # computed before: never served again
    assert kv.block_table(2) == held                   # the holder keeps its KV
    kv.check_integrity()
    kv.commit(2, old + [14], len(old) + 1)             # what it commits stays under its old key
    kv.free(2)
    assert kv.match(old + [14]).num_tokens == 0
    new = [1, 2, 3, 4, 5]
    kv.admit(3, kv.match(new), 5)
    kv.commit(3, new, 5)
    kv.free(3)
    assert kv.match(new).num_tokens == 4               # the new epoch caches as before
    kv.check_integrity()
    with pytest.raises(ValueError, match="new epoch"):
        kv.invalidate(b"v1")


def test_invalidate_frees_every_unheld_cached_block():
    kv = tiny_kv()
    for rid, start in enumerate((10, 30, 50)):
        toks = list(range(start, start + 9))
        kv.admit(rid, kv.match(toks), 9)
        kv.commit(rid, toks, 9)
        kv.free(rid)
    cached = kv.pool.num_cached_unreferenced
    assert cached > 0
    assert kv.invalidate(b"e") == cached
    assert kv.pool.num_cached_unreferenced == 0 and len(kv.tree) == 0
    kv.check_integrity()
