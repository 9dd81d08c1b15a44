import pytest

from phalanx.kv_manager import BlockPool, NoFreeBlocksError


def test_take_and_return_free_blocks_in_order():
    pool = BlockPool(4)
    assert pool.take_free(2) == [0, 1]
    assert pool.ref_counts == [1, 1, 0, 0]
    assert pool.num_free == 2
    assert pool.unref(0) == 0
    assert pool.take_free(3) == [2, 3, 0]


def test_take_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(2)
    with pytest.raises(NoFreeBlocksError):
        pool.take_free(3)
    assert pool.num_free == 2


def test_unreferenced_cached_block_is_counted_not_freed():
    pool = BlockPool(3)
    [b] = pool.take_free(1)
    pool.set_cached(b, True)
    pool.unref(b)
    assert pool.num_free == 2 and pool.num_cached_unreferenced == 1 and pool.num_available == 3
    pool.ref(b)
    assert pool.num_cached_unreferenced == 0 and pool.num_available == 2


def test_eviction_order_priority_then_lru():
    pool = BlockPool(8)
    pool.add_evictable(5, priority=35, tick=3)
    pool.add_evictable(6, priority=35, tick=1)
    pool.add_evictable(7, priority=80, tick=0)
    pool.add_evictable(4, priority=10, tick=9)
    assert pool.evictable_blocks() == [4, 6, 5, 7]
    pool.discard_evictable(6)
    assert [pool.pop_evictable() for _ in range(3)] == [4, 5, 7]
    with pytest.raises(NoFreeBlocksError):
        pool.pop_evictable()


def test_double_release_is_an_error():
    pool = BlockPool(1)
    [b] = pool.take_free(1)
    pool.unref(b)
    with pytest.raises(RuntimeError):
        pool.unref(b)
