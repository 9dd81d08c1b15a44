"""The KV cache's host tier: blocks the device evicts are offloaded, found again by a match and
onboarded into fresh device blocks. Pure Python: the block contents are simulated by lists that
the recorded ``CopyOp``s move, so every reused position is checked against the token it holds."""

from __future__ import annotations

import random

import pytest

from phalanx.kv_manager import KVCacheManager
from phalanx.kv_manager.manager import COPY, OFFLOAD, ONBOARD

B = 4


class Store:
    """Simulated pools: each device and host block is a list of the tokens whose KV it holds."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.dev: list[list[int | None]] = [[None] * B for _ in range(kv.num_blocks)]
        self.host: list[list[int | None]] = [[None] * B for _ in range(kv.num_host_blocks)]
        self.ops: list = []          # every op run, in order

    @property
    def kinds(self) -> list[int]:
        return [op.kind for op in self.ops]

    def run_ops(self) -> None:
        """What the executor does before a forward: the ops in order."""
        for op in self.kv.take_copy_ops():
            self.ops.append(op)
            if op.kind == COPY:
                self.dev[op.dst][:op.num_tokens] = self.dev[op.src][:op.num_tokens]
            elif op.kind == OFFLOAD:
                assert op.num_tokens == B
                self.host[op.dst] = list(self.dev[op.src])
            else:
                assert op.kind == ONBOARD and op.num_tokens == B
                self.dev[op.dst] = list(self.host[op.src])
        self.kv.release_copy_sources()

    def check_tree(self) -> None:
        """Every block the tree holds (device blocks, host blocks, device nodes' host copies)
        holds its node's tokens: right after the ops, before a forward reads them."""
        tree = self.kv.tree
        for node in tree.nodes.values():
            assert self.dev[node.block_id][:len(node.tokens)] == list(node.tokens), f"device block {node.block_id}"
        for hid, node in tree.host_nodes.items():
            assert self.host[hid] == list(node.tokens), f"host block {hid} ({'copy' if node.on_device else 'node'})"

    def compute(self, rid: int, tokens: list[int], start: int, end: int) -> None:
        """A forward writing positions [start, end) of a request."""
        table = self.kv.block_table(rid)
        for i in range(start, end):
            self.dev[table[i // B]][i % B] = tokens[i]

    def check_reused(self, rid: int, tokens: list[int], n: int) -> None:
        table = self.kv.block_table(rid)
        got = [self.dev[table[i // B]][i % B] for i in range(n)]
        assert got == tokens[:n], f"request {rid}: reused rows hold {got}, not {tokens[:n]}"


def _serve(kv: KVCacheManager, store: Store, rid: int, tokens: list[int]) -> int:
    """Admit a prompt, check the rows it reuses, compute the rest, commit; returns the hit."""
    m = kv.match(tokens)
    hit = kv.admit(rid, m, len(tokens))
    store.run_ops()
    store.check_reused(rid, tokens, hit)
    store.compute(rid, tokens, hit, len(tokens))
    kv.commit(rid, tokens, len(tokens))
    kv.check_integrity()
    return hit


def test_an_evicted_prefix_is_offloaded_then_onboarded_with_its_rows():
    kv = KVCacheManager(6, B, num_host_blocks=8)
    store = Store(kv)
    a = list(range(100, 113))            # 3 full blocks + 1 token
    assert _serve(kv, store, 1, a) == 0
    kv.free(1)
    b = list(range(200, 217))            # 4 full blocks + 1: the device must evict a's blocks
    _serve(kv, store, 2, b)
    assert OFFLOAD in store.kinds and len(kv.tree.host_nodes) >= 1
    kv.free(2)
    kv.check_integrity()
    m = kv.match(a + [7, 8])
    assert m.tree_match.host_nodes, "the offloaded blocks are found on the host"
    assert m.num_tokens == 12             # a's three full blocks (its partial tail is not offloaded)
    onboarded_before = kv.tree.num_onboarded
    assert _serve(kv, store, 3, a + [7, 8]) == 12
    assert ONBOARD in store.kinds and kv.tree.num_onboarded > onboarded_before
    assert not kv.match(a + [7, 8]).tree_match.host_nodes, "onboarded blocks are on the device again"


def test_without_a_host_tier_the_evicted_prefix_is_gone():
    kv = KVCacheManager(6, B)
    store = Store(kv)
    a = list(range(100, 113))
    _serve(kv, store, 1, a)
    kv.free(1)
    _serve(kv, store, 2, list(range(200, 217)))
    kv.free(2)
    assert kv.match(a + [7]).num_tokens < 12
    assert OFFLOAD not in store.kinds and kv.num_host_blocks == 0


def test_the_host_tier_drops_its_least_recently_used_leaves_and_never_a_pinned_block():
    kv = KVCacheManager(4, B, num_host_blocks=3)
    store = Store(kv)
    for rid, base in enumerate((100, 200, 300, 400), 1):   # four prompts of 3 full blocks + 1, a 4-block device
        _serve(kv, store, rid, list(range(base, base + 13)))
        kv.free(rid)
    kv.check_integrity()
    assert len(kv.tree.host_nodes) <= 3
    # the newest evicted prompt is still on the host, the oldest is not
    assert kv.match(list(range(100, 114))).num_tokens == 0
    assert kv.match(list(range(300, 314))).num_tokens > 0
    # admitting a host hit whose allocation must offload more (host full) keeps its own host blocks
    hit = _serve(kv, store, 9, list(range(300, 314)))
    assert hit > 0


def test_a_block_computed_again_takes_its_host_node_back():
    kv = KVCacheManager(6, B, num_host_blocks=8)
    store = Store(kv)
    a = list(range(100, 109))             # 2 full blocks + 1
    _serve(kv, store, 1, a)
    kv.free(1)
    _serve(kv, store, 2, list(range(200, 221)))   # pushes a's blocks to the host
    kv.free(2)
    a_blocks = {tuple(a[0:4]), tuple(a[4:8])}
    assert a_blocks <= {n.tokens for n in kv.tree.host_nodes.values()}
    # a request that does not reuse the cache computes a's blocks itself and commits them
    m = kv.match(a, reuse=False)
    kv.admit(3, m, len(a))
    store.run_ops()
    store.compute(3, a, 0, len(a))
    kv.commit(3, a, len(a))
    kv.check_integrity()
    path = kv.tree.match(a, b"", 8).nodes
    assert [n.on_device for n in path] == [True, True], "a's nodes are on the device again"
    assert not [n for n in kv.tree.host_nodes.values() if not n.on_device and n.tokens in a_blocks], \
        "no host node beside the device ones: the host blocks stayed as their copies (or went)"
    kv.free(3)
    assert kv.match(a).num_tokens == 8 and not kv.match(a).tree_match.host_nodes


def test_invalidate_forgets_the_host_tier():
    kv = KVCacheManager(4, B, num_host_blocks=8)
    store = Store(kv)
    _serve(kv, store, 1, list(range(100, 113)))
    kv.free(1)
    _serve(kv, store, 2, list(range(200, 213)))
    kv.free(2)
    assert kv.tree.host_nodes
    kv.invalidate(b"new")
    kv.check_integrity()
    assert not kv.tree.host_nodes and kv.host is not None and kv.host.num_free == 8
    assert kv.match(list(range(100, 113))).num_tokens == 0


def test_block_reuse_off_makes_no_host_tier():
    kv = KVCacheManager(4, B, enable_block_reuse=False, num_host_blocks=8)
    assert kv.num_host_blocks == 0


@pytest.mark.parametrize("seed", range(12))
def test_random_traffic_keeps_every_reused_row_right(seed):
    """Shared prefixes, concurrent requests, prompts that skip the cache, partial hits, a
    small device pool and a smaller host tier: after each step's ops every reused position
    of every admitted request holds its token, and the invariants hold."""
    rng = random.Random(seed)
    kv = KVCacheManager(14, B, num_host_blocks=rng.choice([3, 6, 10]))
    store = Store(kv)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 14))] for _ in range(5)]
    running: dict[int, list[int]] = {}
    rid = 0
    admitted = 0
    for _step in range(300):
        # schedule (as the scheduler does, before the step's ops run): some running requests
        # grow by a token; up to three requests are admitted
        decoding = [r for r in running if rng.random() < 0.3 and kv.grow(r, len(running[r]) + 1)]
        new: list[tuple[int, list[int], int]] = []
        for _ in range(rng.randrange(0, 4)):
            tokens = list(rng.choice(prefixes)) + [rng.randrange(1000) for _ in range(rng.randrange(1, 7))]
            reuse = rng.random() > 0.15
            m = kv.match(tokens, reuse=reuse)
            if kv.num_blocks_to_admit(m, len(tokens)) > kv.num_available_blocks:
                if m.tree_match.partial_node is None:
                    continue
                m = kv.whole_blocks(m)
                if kv.num_blocks_to_admit(m, len(tokens)) > kv.num_available_blocks:
                    continue
            rid += 1
            new.append((rid, tokens, kv.admit(rid, m, len(tokens))))
        # the forward: the ops in order, then the rows it computes
        store.run_ops()
        store.check_tree()
        for r, tokens, hit in new:
            store.check_reused(r, tokens, hit)
            store.compute(r, tokens, hit, len(tokens))
            running[r] = tokens
            admitted += 1
        for r in decoding:
            tokens = running[r]
            tokens.append(rng.randrange(1000))
            store.compute(r, tokens, len(tokens) - 1, len(tokens))
        # after it: commits, and some requests finish
        for r, tokens in list(running.items()):
            kv.commit(r, tokens, len(tokens))
            if rng.random() < 0.4:
                kv.free(r)
                del running[r]
        kv.check_integrity()
    assert admitted > 100
    assert OFFLOAD in store.kinds and ONBOARD in store.kinds, "the traffic exercised both moves"


def _serve_one(kv: KVCacheManager, store: Store, rid: int, tokens: list[int], free: bool = True) -> int:
    hit = _serve(kv, store, rid, tokens)
    if free:
        kv.free(rid)
        kv.check_integrity()
    return hit


def test_a_host_sibling_does_not_stop_a_finished_tail_from_being_kept_for_partial_reuse():
    """A host child can serve no partial hit, so it must not count as covering the tail a
    request leaves behind: partial reuse finds as much with the tier as without it."""
    def hits(host_blocks: int) -> tuple[int, int]:
        kv = KVCacheManager(5, B, num_host_blocks=host_blocks)
        store = Store(kv)
        _serve_one(kv, store, 1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
        _serve_one(kv, store, 2, list(range(50, 63)))      # pushes [5..8] (and the tail [9]) out
        h3 = _serve_one(kv, store, 3, [1, 2, 3, 4, 5, 6, 7])
        h4 = _serve_one(kv, store, 4, [1, 2, 3, 4, 5, 6, 7, 99])   # request 3's tail [5, 6, 7]
        return h3, h4
    assert hits(8) == hits(0) == (4, 7)


def test_blocks_of_an_older_epoch_are_dropped_not_offloaded():
    """After ``invalidate`` nothing can match the blocks still held by requests of the old
    epoch: when they are evicted they must not take host blocks from matchable ones."""
    kv = KVCacheManager(10, B, num_host_blocks=4)
    store = Store(kv)
    old = list(range(100, 117))
    _serve_one(kv, store, 1, old, free=False)          # runs across a weight update
    kv.invalidate(b"v2")
    good = list(range(200, 217))
    _serve_one(kv, store, 2, good)
    _serve_one(kv, store, 3, list(range(300, 317)), free=False)   # pushes `good` to the host
    assert kv.match(good + [1]).num_tokens == 16
    kv.free(1)
    _serve_one(kv, store, 4, list(range(400, 417)))    # evicts the old epoch's blocks
    assert not [n for n in kv.tree.host_nodes.values() if n.tokens[0] in range(100, 117)]
    assert kv.match(good + [1]).num_tokens == 16


def test_only_copied_blocks_count_as_onboarded():
    kv = KVCacheManager(6, B, num_host_blocks=8)
    store = Store(kv)
    a = list(range(100, 109))
    _serve_one(kv, store, 1, a)
    _serve_one(kv, store, 2, list(range(200, 221)))
    assert len(kv.match(a).tree_match.host_nodes) == 2, "a's blocks are on the host"
    kv.admit(3, kv.match(a, reuse=False), len(a))      # computes a's blocks again: promoted, not copied
    store.run_ops()
    store.compute(3, a, 0, len(a))
    kv.commit(3, a, len(a))
    assert ONBOARD not in store.kinds and kv.tree.num_onboarded == 0


def test_an_onboarded_block_evicted_again_goes_back_to_the_host_without_a_copy():
    """Onboarding keeps the host block as the device node's copy (vLLM's and SGLang's host
    caches keep theirs too): evicted again, the node returns to the host with no transfer, and
    the rows it holds there are still right."""
    kv = KVCacheManager(6, B, num_host_blocks=16)
    store = Store(kv)
    a = list(range(100, 113))
    _serve_one(kv, store, 1, a)
    _serve_one(kv, store, 2, list(range(200, 221)))      # a's blocks to the host
    assert _serve_one(kv, store, 3, a[:-1] + [7]) == 12   # onboarded; their host blocks kept as copies
    copies = [n for n in kv.tree.host_nodes.values() if n.on_device]
    assert len(copies) == 3
    blocks, hosts = {n.block_id for n in copies}, [n.host_id for n in copies]
    store.ops.clear()
    _serve_one(kv, store, 4, list(range(300, 321)))      # a's blocks evicted again
    assert all(not n.on_device for n in copies) and [n.host_id for n in copies] == hosts, "back where they were"
    assert OFFLOAD in {op.kind for op in store.ops}
    assert not [op for op in store.ops if op.kind == OFFLOAD and op.src in blocks], "with no transfer"
    assert _serve_one(kv, store, 5, a[:-1] + [8]) == 12   # and their rows are right (checked by _serve)


def test_the_host_tier_drops_copies_before_it_runs_out():
    """A device node's host copy is droppable at any time: a full host tier of copies still
    takes offloads."""
    kv = KVCacheManager(8, B, num_host_blocks=3)
    store = Store(kv)
    _serve_one(kv, store, 1, list(range(100, 113)))
    _serve_one(kv, store, 2, list(range(200, 229)))      # 7 blocks: 100's three go to the host
    _serve_one(kv, store, 3, list(range(100, 113)))      # back: three copies fill the host tier
    assert len(kv.tree.host_nodes) == 3 and all(n.on_device for n in kv.tree.host_nodes.values())
    store.ops.clear()
    _serve_one(kv, store, 4, list(range(300, 329)))      # evicts 200's blocks: the copies make room
    assert OFFLOAD in store.kinds


@pytest.mark.parametrize("salt", ["\x00epoch1", "epoch1", "\x00", "é\x00epoch1"])
def test_no_cache_salt_spells_a_later_epochs_keys(salt):
    """Blocks a salted request holds across a weight update (computed under the old weights)
    must not match an unsalted request of the new epoch, whatever the salt (the engine's epoch
    bytes hold 0xfe, never in UTF-8)."""
    from phalanx.pyexecutor.rollout import epoch_key
    kv = KVCacheManager(16, B)
    toks = list(range(1, 14))
    kv.admit(1, kv.match(toks, salt.encode()), len(toks), salt.encode())
    kv.commit(1, toks, len(toks))
    kv.invalidate(epoch_key(1))
    kv.free(1)
    assert kv.match(toks).num_tokens == 0
    kv.check_integrity()


def test_a_full_host_tier_drops_a_copy_before_a_block_held_only_there():
    """A device node's copy is a duplicate: it goes first even when it is newer than a block the
    host tier alone holds (dropped by age alone, the older host-only block would go)."""
    kv = KVCacheManager(8, B, num_host_blocks=2)
    store = Store(kv)
    a, b = list(range(100, 105)), list(range(200, 205))
    _serve_one(kv, store, 1, a)
    _serve_one(kv, store, 2, b)
    big = list(range(300, 332))                             # all 8 blocks, not kept: a's and b's go to the host
    kv.admit(3, kv.match(big), len(big))
    store.run_ops()
    kv.free(3)
    assert kv.match(a).tree_match.host_nodes and kv.match(b).tree_match.host_nodes
    _serve_one(kv, store, 4, b[:4] + [9], free=False)     # b onboarded and held: its host block a copy, newer
    assert sum(n.on_device for n in kv.tree.host_nodes.values()) == 1
    _serve_one(kv, store, 5, list(range(400, 413)))
    _serve_one(kv, store, 6, list(range(500, 513)))        # offloads into the full tier
    assert kv.match(a).num_tokens == 4, "a, held only on the host, outlived b's copy"
