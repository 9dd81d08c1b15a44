import hashlib
import struct

from helpers import tiny_kv
from phalanx.kv_manager import block_keys, chain_key


def expected_key(parent: bytes, tokens: list[int], extra: bytes = b"") -> bytes:
    return hashlib.sha256(parent + b"".join(struct.pack("<q", t) for t in tokens) + extra).digest()


def test_chain_key_is_sha256_of_parent_tokens_extra():
    k0 = chain_key(b"", [1, 2, 3, 4])
    assert k0 == expected_key(b"", [1, 2, 3, 4])
    k1 = chain_key(k0, [5, 6, 7, 8], b"salt")
    assert k1 == expected_key(k0, [5, 6, 7, 8], b"salt")
    assert block_keys(list(range(1, 11)), 4) == [k0, expected_key(k0, [5, 6, 7, 8])]


def admit_and_finish(kv, rid, tokens, extra=b""):
    """Admit, compute everything but the last token, commit, free: like a finished request."""
    m = kv.match(tokens, extra)
    kv.admit(rid, m, len(tokens), extra)
    kv.take_copy_ops()
    kv.commit(rid, tokens, len(tokens) - 1)
    kv.free(rid)
    kv.release_copy_sources()
    return m.num_tokens


def test_exact_full_block_match_and_last_token_never_reused():
    kv = tiny_kv()
    prompt = list(range(10, 22))                      # 12 tokens = 3 blocks of 4
    admit_and_finish(kv, 1, prompt + [99])            # computes 12 prompt tokens
    m = kv.match(prompt)                              # same 12 tokens: the 12th must be computed
    assert [n.block_id for n in m.tree_match.nodes] == [0, 1]
    assert m.tree_match.partial_node.block_id == 2 and m.tree_match.partial_len == 3
    assert m.num_tokens == 11
    kv.check_integrity()


def test_partial_reuse_copies_the_common_rows():
    kv = tiny_kv()
    admit_and_finish(kv, 1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    prompt = [1, 2, 3, 4, 5, 6, 40, 41, 42]           # diverges inside block 1
    m = kv.match(prompt)
    assert m.num_tokens == 6
    cached = kv.admit(2, m, len(prompt))
    assert cached == 6
    [op] = kv.take_copy_ops()
    assert (op.src, op.num_tokens) == (1, 2) and op.dst == kv.block_table(2)[1]
    assert kv.pool.ref_counts[1] == 1                 # the source (and its path) held until released
    assert kv.pool.ref_counts[0] == 2
    kv.check_integrity()
    kv.release_copy_sources()
    assert kv.pool.ref_counts[1] == 0
    kv.check_integrity()


def test_divergent_prompts_branch_the_tree():
    kv = tiny_kv()
    admit_and_finish(kv, 1, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    admit_and_finish(kv, 2, [1, 2, 3, 4, 9, 9, 9, 9, 0])
    root_children = list(kv.tree.root.children.values())
    assert len(root_children) == 1
    branch = root_children[0]
    assert sorted(c.tokens for c in branch.children.values()) == [(5, 6, 7, 8), (9, 9, 9, 9)]
    kv.check_integrity()


def test_finished_request_tail_kept_as_partial_leaf():
    kv = tiny_kv()
    admit_and_finish(kv, 1, [1, 2, 3, 4, 5, 6, 7])    # 6 computed: block 0 full, block 1 has 2
    leaf = kv.tree.root.children[chain_key(b"", [1, 2, 3, 4])]
    [partial] = leaf.children.values()
    assert partial.tokens == (5, 6)
    m = kv.match([1, 2, 3, 4, 5, 6, 8, 9])
    assert m.num_tokens == 6
    kv.check_integrity()


def test_partial_leaf_not_stored_when_a_sibling_covers_it():
    kv = tiny_kv()
    admit_and_finish(kv, 1, [1, 2, 3, 4, 5, 6, 7, 8, 9])   # block 1 = (5,6,7,8) full
    n_before = len(kv.tree)
    admit_and_finish(kv, 2, [1, 2, 3, 4, 5, 6, 7])          # tail (5,6) is covered by (5,6,7,8)
    assert len(kv.tree) == n_before
    kv.check_integrity()


def test_extra_key_isolates_tenants_even_for_partial_reuse():
    kv = tiny_kv()
    admit_and_finish(kv, 1, [1, 2, 3, 4, 5, 6, 7, 8, 9], extra=b"tenant-a")
    assert kv.match([1, 2, 3, 4, 5, 6, 7, 8, 9], b"tenant-b").num_tokens == 0
    assert kv.match([1, 2, 3, 4, 5, 6, 7, 8, 9]).num_tokens == 0
    assert kv.match([1, 2, 3, 4, 5, 6, 7, 8, 9], b"tenant-a").num_tokens == 8


def test_eviction_takes_unreferenced_leaves_lru_first():
    kv = tiny_kv(num_blocks=6)
    admit_and_finish(kv, 1, [1, 2, 3, 4, 5, 6, 7, 8, 0])    # tree blocks 0 <- 1; block 2 freed
    admit_and_finish(kv, 2, [9, 9, 9, 9, 0])                # takes 3, 4: block 3 cached, newer
    kv.check_integrity()
    # all 6 blocks are needed: the leaves go oldest first, a parent only after its children
    order = []
    real_evict = kv.tree._evict_one

    def spy():
        order.append(kv.pool.evictable_blocks()[0])
        real_evict()

    kv.tree._evict_one = spy
    m = kv.match([50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73])
    kv.admit(3, m, 24)
    assert order == [1, 0, 3]
    assert len(kv.tree) == 0
    kv.check_integrity()


def test_referenced_blocks_are_never_evicted():
    kv = tiny_kv(num_blocks=4)
    m = kv.match([1, 2, 3, 4, 5, 6, 7, 8, 9])
    kv.admit(1, m, 9)                                        # holds 3 blocks
    kv.commit(1, [1, 2, 3, 4, 5, 6, 7, 8, 9], 8)
    import pytest

    from phalanx.kv_manager import NoFreeBlocksError
    with pytest.raises(NoFreeBlocksError):
        kv.admit(2, kv.match([7] * 9), 9)
    assert kv.block_table(1) == [0, 1, 2]
    kv.check_integrity()


def test_pretty_shows_blocks_and_refs():
    kv = tiny_kv()
    admit_and_finish(kv, 1, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    text = kv.pretty()
    assert "block 0 ref=0 [1,2,3,4]" in text and "block 1 ref=0 [5,6,7,8]" in text


def test_a_chain_of_only_children_matches_by_tokens_and_extra_key_as_the_keys_would():
    """Along a chain where each node has one child the match compares the child's tokens and
    extra key instead of hashing: it stops at the first differing block, never crosses tenants,
    and finds what the key lookup finds once a node has two children."""
    kv = tiny_kv()
    prompt = list(range(100, 124))                    # 6 blocks of 4
    admit_and_finish(kv, 1, prompt + [7], b"a")
    full = kv.match(prompt + [7], b"a")
    assert [n.block_id for n in full.tree_match.nodes] == [0, 1, 2, 3, 4, 5]
    assert kv.match(prompt + [7], b"b").num_tokens == 0          # another tenant: nothing
    changed = prompt[:9] + [0] + prompt[10:]           # block 2 differs
    assert [n.block_id for n in kv.match(changed, b"a").tree_match.nodes] == [0, 1]
    admit_and_finish(kv, 2, prompt[:8] + list(range(500, 516)), b"a")   # block 1 now has two children
    both = kv.match(prompt + [7], b"a")
    assert [n.block_id for n in both.tree_match.nodes] == [0, 1, 2, 3, 4, 5]
    other = kv.match(prompt[:8] + list(range(500, 516)), b"a")
    assert len(other.tree_match.nodes) == 5 and [n.block_id for n in other.tree_match.nodes][:2] == [0, 1]
    kv.check_integrity()


def test_a_partial_match_among_many_siblings_takes_the_longest_common_prefix():
    kv = tiny_kv()
    for rid, first in enumerate(range(1, 6)):          # five one-block prompts under the root
        admit_and_finish(kv, rid, [first, 50, 51, 52, 53])
    admit_and_finish(kv, 9, [3, 50, 60, 61, 62])       # a second root child starting with 3
    m = kv.match([3, 50, 51, 70, 71])
    assert m.tree_match.partial_node is not None and m.tree_match.partial_len == 3
    assert m.tree_match.partial_node.tokens[:3] == (3, 50, 51)
    assert kv.match([8, 50, 51, 52, 53]).tree_match.partial_node is None   # no child starts with 8
    kv.check_integrity()
