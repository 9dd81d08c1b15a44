"""KVCacheManager: which blocks each request holds, prefix reuse, commit and free.

Pure Python: no torch. The tensors live in the executor's KV pool; this object only decides
block ids and copy operations.

The blocks of one request, for ``tokens_per_block`` B::

    block index   0 .. len(nodes)-1            len(nodes) .. len(block_ids)-1
    held as       tree nodes (a root path,     private blocks: being written, or a
                  committed or matched)        copy-on-write destination of a partial hit

A block is committed to the tree once all of its B token positions have KV computed
(``commit``); a committed block whose key already exists is swapped for the existing one and
its private copy is freed, so a prefix is stored once. When a request ends, its last,
partly-filled block is kept as a partial leaf (tokens < B) unless a sibling already covers it,
so a later prompt can reuse every computed token, not only whole blocks.

Life of a request: ``match`` (read-only) → ``admit`` → (``grow`` → step → ``commit``)* →
``free``. ``take_copy_ops`` hands the copies (partial reuse, the host tier's moves) to the next forward;
``release_copy_sources`` drops the sources once that forward is launched.

With ``num_host_blocks`` a host tier keeps the blocks the device evicts (TensorRT-LLM's
secondary pool): an evicted full block is offloaded, its node staying in the tree on the host,
and a later match that reaches it onboards it into a fresh device block. The moves are
``CopyOp``s of kind ``OFFLOAD`` (device block → host block) and ``ONBOARD`` (host block → device
block) in the same ordered list as the partial-reuse copies: run in order before the next
forward, each sees the rows the ops before it left: an offload precedes an onboard of the same
host block and the onboard into the device block it freed; an onboard precedes the offload that
reuses its host block.

``invalidate`` starts a new epoch (new weights, or KV memory that was released): the epoch is
part of every key from then on, so no later request can match a block computed before, and the
cached blocks nobody holds are freed at once. Requests that hold blocks keep them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from phalanx.kv_manager.block_pool import BlockPool, NoFreeBlocksError
from phalanx.kv_manager.radix_tree import DEFAULT_PRIORITY, Node, RadixTree, TreeMatch, chain_key

COPY, OFFLOAD, ONBOARD = 0, 1, 2   # a CopyOp's kind: device → device, device → host, host → device


@dataclass(frozen=True)
class CopyOp:
    """Copy rows ``[0, num_tokens)`` of block ``src`` into block ``dst`` (all layers, K and V):
    both device blocks (``COPY``), or a device block into a host block (``OFFLOAD``) or back
    (``ONBOARD``), whole blocks."""

    src: int
    dst: int
    num_tokens: int
    kind: int = COPY


@dataclass
class PrefixMatch:
    """A read-only match of a prompt against the cache (see ``KVCacheManager.match``)."""

    tree_match: TreeMatch
    num_tokens: int        # tokens whose KV can be reused
    num_unreferenced: int  # matched blocks that are cached but held by nobody (they leave
                           # the available count once admitted)


@dataclass
class _Sequence:
    block_ids: list[int]
    nodes: list[Node]
    extra_key: bytes
    priority: int
    tokens: Sequence[int] = ()                        # the request's tokens (as of the last commit)
    num_computed: int = 0                             # positions with KV written (last commit)


class KVCacheManager:
    """Block bookkeeping for all requests of one KV pool.

    ``num_blocks`` blocks of ``tokens_per_block`` tokens. With ``enable_block_reuse`` off
    nothing is matched or committed; with ``enable_partial_reuse`` off only whole blocks match.
    ``num_host_blocks`` > 0 (with reuse on) adds the host tier.
    """

    def __init__(
        self, num_blocks: int, tokens_per_block: int = 32, enable_block_reuse: bool = True,
        enable_partial_reuse: bool = True, num_host_blocks: int = 0,
    ) -> None:
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        self.tokens_per_block = tokens_per_block
        self.enable_block_reuse = enable_block_reuse
        self.enable_partial_reuse = enable_partial_reuse
        self.pool = BlockPool(num_blocks)
        self.host = BlockPool(num_host_blocks) if num_host_blocks > 0 and enable_block_reuse else None
        self.tree = RadixTree(self.pool, tokens_per_block, self.host, self._offload)
        self._seqs: dict[int, _Sequence] = {}
        self._copy_ops: list[CopyOp] = []
        self._copy_sources: list[list[Node]] = []  # root paths held until the copy's forward is launched
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.epoch = b""                            # appended to every extra key (see ``invalidate``)

    # -- sizes -----------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation can get now: free plus unreferenced cached ones."""
        return self.pool.num_available

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-unused blocks count as free)."""
        return 1.0 - self.pool.num_available / self.pool.num_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.host.num_blocks if self.host is not None else 0

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def num_held_blocks(self, request_id: int) -> int:
        seq = self._seqs.get(request_id)
        return len(seq.block_ids) if seq else 0

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._seqs

    def block_table(self, request_id: int) -> list[int]:
        """The request's block ids in position order (do not mutate)."""
        return self._seqs[request_id].block_ids

    # -- match (read-only) -----------------------------------------------------------------
    def match(self, tokens: Sequence[int], extra_key: bytes = b"", reuse: bool = True) -> PrefixMatch:
        """How much of ``tokens`` can be reused; mutates nothing.

        The last token is never reused (it must be computed to produce logits), so at most
        ``len(tokens) - 1`` tokens match. ``reuse=False`` gives the empty match (a request
        that must compute every position).
        """
        max_tokens = len(tokens) - 1
        if not self.enable_block_reuse or not reuse or max_tokens < 1:
            return PrefixMatch(TreeMatch([]), 0, 0)
        tm = self.tree.match(tokens, extra_key + self.epoch, max_tokens, self.enable_partial_reuse)
        refs = self.pool.ref_counts
        unreferenced = sum(1 for n in tm.nodes if refs[n.block_id] == 0)
        if tm.partial_node is not None and refs[tm.partial_node.block_id] == 0:
            unreferenced += 1
        return PrefixMatch(tm, tm.num_tokens(self.tokens_per_block), unreferenced)

    def whole_blocks(self, match: PrefixMatch) -> PrefixMatch:
        """``match`` without its partial block: a partial hit holds its copy source beside the
        request's own blocks until the copy runs, one block more than the request; where that
        block does not fit, the whole blocks of the hit may."""
        tm = match.tree_match
        refs = self.pool.ref_counts
        return PrefixMatch(TreeMatch(list(tm.nodes), host_nodes=list(tm.host_nodes)),
                           (len(tm.nodes) + len(tm.host_nodes)) * self.tokens_per_block,
                           sum(1 for n in tm.nodes if refs[n.block_id] == 0))

    def num_blocks_to_admit(self, match: PrefixMatch, num_slots: int) -> int:
        """Available blocks that ``admit(match, num_slots)`` would consume (a host block takes a
        fresh one)."""
        new = max(0, self.num_blocks_for(num_slots) - len(match.tree_match.nodes))
        return new + match.num_unreferenced

    # -- request lifecycle -----------------------------------------------------------------
    def admit(
        self, request_id: int, match: PrefixMatch, num_slots: int, extra_key: bytes = b"",
        priority: int = DEFAULT_PRIORITY,
    ) -> int:
        """Start holding blocks for a request: the matched prefix plus fresh blocks for
        positions ``[0, num_slots)``. Returns the number of reused (cached) tokens.

        Raises ``NoFreeBlocksError`` (changing nothing) when ``num_blocks_to_admit`` exceeds
        the available blocks. A partial hit queues a ``CopyOp`` for the next forward, and so
        does each matched host block (``ONBOARD``, into the fresh block of its position).
        """
        if request_id in self._seqs:
            raise ValueError(f"request {request_id} already holds blocks")
        if self.num_blocks_to_admit(match, num_slots) > self.pool.num_available:
            raise NoFreeBlocksError(f"request {request_id} needs more blocks than are available")
        tm = match.tree_match
        held = [n.block_id for n in tm.nodes]
        self.pool.ref_all(held)  # hold the prefix before allocating, so it cannot be evicted
        hosted = [n.host_id for n in tm.host_nodes]
        if hosted:
            assert self.host is not None and tm.partial_node is None
            self.host.ref_all(hosted)   # pinned: the allocation's offloads may not take their host blocks
        if tm.partial_node is not None:
            # The copy source is held with its whole path, so a held node always has held
            # ancestors even if this request ends before the copy runs.
            source_path = tm.nodes + [tm.partial_node]
            self.pool.ref_all(held + [tm.partial_node.block_id])
        fresh = self._allocate(self.num_blocks_for(num_slots) - len(tm.nodes))
        if tm.partial_node is not None:
            self._copy_ops.append(CopyOp(tm.partial_node.block_id, fresh[0], tm.partial_len))
            self._copy_sources.append(source_path)
        assert len(fresh) >= len(tm.host_nodes)   # (the slots reach past the match)
        for node, block_id in zip(tm.host_nodes, fresh, strict=False):
            assert self.host is not None
            self.host.unref(node.host_id)
            self._copy_ops.append(CopyOp(node.host_id, block_id, self.tokens_per_block, ONBOARD))
            self.tree.promote(node, block_id)
        seq = _Sequence(held + fresh, list(tm.nodes) + list(tm.host_nodes), extra_key + self.epoch, priority)
        self._seqs[request_id] = seq
        return match.num_tokens

    def grow(self, request_id: int, num_slots: int) -> bool:
        """Make sure positions ``[0, num_slots)`` have blocks. False (changing nothing) if
        there are not enough available blocks."""
        seq = self._seqs[request_id]
        need = self.num_blocks_for(num_slots) - len(seq.block_ids)
        if need <= 0:
            return True
        if need > self.pool.num_available:
            return False
        seq.block_ids.extend(self._allocate(need))
        return True

    def commit(self, request_id: int, tokens: Sequence[int], num_computed_tokens: int) -> None:
        """Enter into the tree every full block whose KV is computed.

        ``tokens`` are the request's tokens (prompt + output); positions below
        ``num_computed_tokens`` have their KV written (or, on a GPU stream, queued before any
        later reader or writer). A block equal to one already cached is swapped for it.
        """
        if not self.enable_block_reuse:
            return
        seq = self._seqs[request_id]
        seq.tokens, seq.num_computed = tokens, num_computed_tokens
        B = self.tokens_per_block
        num_full = min(num_computed_tokens // B, len(seq.block_ids))
        while len(seq.nodes) < num_full:
            i = len(seq.nodes)
            parent = seq.nodes[-1] if seq.nodes else self.tree.root
            block_tokens = tokens[i * B:(i + 1) * B]
            key = chain_key(parent.key, block_tokens, seq.extra_key)
            existing = parent.children.get(key)
            if existing is not None and not existing.on_device:   # computed again: its host copy goes
                self.tree.promote(existing, seq.block_ids[i], copied=False)
                seq.nodes.append(existing)
            elif existing is not None:
                self.tree.ref(existing)
                self.pool.unref(seq.block_ids[i])
                seq.block_ids[i] = existing.block_id
                seq.nodes.append(existing)
            else:
                seq.nodes.append(self.tree.insert(parent, key, block_tokens, seq.block_ids[i],
                                                  seq.extra_key, seq.priority))

    def free(self, request_id: int) -> None:
        """Release every block of a request: private blocks go to the free list, tree blocks
        become evictable once unreferenced (their contents stay matchable until evicted)."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        if self.enable_block_reuse:
            self._cache_partial_block(seq)
        for block_id in seq.block_ids[len(seq.nodes):]:
            self.pool.unref(block_id)
        tick = self.pool.next_tick()
        for node in reversed(seq.nodes):
            self.tree.unref(node, tick)

    def invalidate(self, epoch: bytes) -> int:
        """Make every block cached so far unmatchable (a new ``epoch`` in every key from now on)
        and free the cached blocks no request holds. Returns how many were freed."""
        if epoch == self.epoch:
            raise ValueError("invalidate needs a new epoch")
        self.epoch = self.tree.live_key = epoch
        freed = self.tree.evict(self.pool.num_blocks, offload=False)
        self.tree.drop_host()
        return freed

    def record_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """Count a prefix-cache lookup for metrics (tokens asked, tokens reused)."""
        self.num_queried_tokens += num_prompt_tokens
        self.num_hit_tokens += num_hit_tokens

    def _cache_partial_block(self, seq: _Sequence) -> None:
        """Keep the computed part of the first private block as a partial leaf."""
        i, B = len(seq.nodes), self.tokens_per_block
        if seq.num_computed <= i * B or i >= len(seq.block_ids) or seq.num_computed >= (i + 1) * B:
            return
        parent = seq.nodes[-1] if seq.nodes else self.tree.root
        tokens = tuple(seq.tokens[i * B:seq.num_computed])
        if self.tree.covered(parent, tokens, seq.extra_key):
            return  # a sibling already holds these tokens: let this block go
        key = chain_key(parent.key, tokens, seq.extra_key)
        seq.nodes.append(self.tree.insert(parent, key, tokens, seq.block_ids[i], seq.extra_key, seq.priority))

    # -- the copies (partial hits, the host tier) ---------------------------------------------------------
    def take_copy_ops(self) -> list[CopyOp]:
        """The copies the next forward must run before anything else (and clear them)."""
        ops, self._copy_ops = self._copy_ops, []
        return ops

    def release_copy_sources(self) -> None:
        """Drop the holds on copy sources; call once the forward that copies is launched."""
        tick = self.pool.next_tick()
        for path in self._copy_sources:
            for node in reversed(path):
                self.tree.unref(node, tick)
        self._copy_sources = []

    # -- internals -------------------------------------------------------------------------
    def _offload(self, block_id: int, host_id: int) -> None:
        self._copy_ops.append(CopyOp(block_id, host_id, self.tokens_per_block, OFFLOAD))

    def _allocate(self, n: int) -> list[int]:
        if n <= 0:
            return []
        short = n - self.pool.num_free
        if short > 0 and self.tree.evict(short) < short:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.pool.num_available} available")
        return self.pool.take_free(n)

    # -- inspection --------------------------------------------------------------------------
    def pretty(self) -> str:
        """Pool counts, each request's block table and the tree, as text."""
        p = self.pool
        lines = [f"KVCacheManager: {p.num_blocks} blocks × {self.tokens_per_block} tokens; "
                 f"free {p.num_free}, cached-unreferenced {p.num_cached_unreferenced}, "
                 f"evictable leaves {p.num_evictable}"]
        if self.host is not None:
            lines.append(f"  host tier: {self.host.num_blocks} blocks, {len(self.tree.host_nodes)} cached, "
                         f"evictable leaves {self.host.num_evictable}")
        for rid, seq in sorted(self._seqs.items()):
            lines.append(f"  request {rid}: blocks {seq.block_ids} (first {len(seq.nodes)} in tree)")
        lines.append(self.tree.pretty())
        return "\n".join(lines)

    def check_integrity(self) -> None:
        """Assert the invariants; raises ``AssertionError`` naming the first one broken.

        free + cached-unreferenced + referenced == num_blocks; every ref count equals its
        holders; the evictable set is exactly the unreferenced cached leaves of the device tier;
        a referenced tree node has referenced ancestors; keys chain. With a host tier: its
        blocks are free or hold exactly the host nodes, none pinned between calls; host nodes
        are the tails of root paths; its evictable set is exactly the device nodes' copies and
        the host nodes without children.
        """
        p, tree = self.pool, self.tree
        holders = [0] * p.num_blocks
        for seq in self._seqs.values():
            for b in seq.block_ids:
                holders[b] += 1
            assert seq.block_ids[:len(seq.nodes)] == [n.block_id for n in seq.nodes], "nodes/blocks out of step"
        for path in self._copy_sources:
            for node in path:
                holders[node.block_id] += 1
        assert holders == p.ref_counts, f"ref counts {p.ref_counts} != holders {holders}"
        free = list(p._free)
        assert len(set(free)) == len(free), "a block is on the free list twice"
        for b in free:
            assert p.ref_counts[b] == 0 and not p.cached[b], f"free block {b} is held or cached"
        assert set(tree.nodes) == {b for b in range(p.num_blocks) if p.cached[b]}, "cached flags != tree"
        unref_cached = [b for b in tree.nodes if p.ref_counts[b] == 0]
        assert len(unref_cached) == p.num_cached_unreferenced, "cached-unreferenced count drifted"
        referenced = sum(1 for c in p.ref_counts if c > 0)
        assert len(free) + len(unref_cached) + referenced == p.num_blocks, "blocks lost or double-counted"
        leaves = {b for b in unref_cached if not tree.nodes[b].device_children}
        assert set(p._evictable) == leaves, f"evictable {sorted(p._evictable)} != leaves {sorted(leaves)}"
        every = [tree.root, *tree.nodes.values(), *(n for n in tree.host_nodes.values() if not n.on_device)]
        assert sum(len(h) for n in every for h in n.heads.values()) == len(every) - 1, \
            "the first-token index holds a node twice or one not in the tree"
        for node in every:
            assert node.device_children == sum(c.on_device for c in node.children.values()), "device children count"
        for b, node in tree.nodes.items():
            parent = node.parent
            assert node.block_id == b and (node.host_id == -1 or tree.host_nodes.get(node.host_id) is node), \
                f"block {b} misfiled"
            assert parent is not None and parent.children.get(node.key) is node, f"block {b} detached"
            assert sum(c is node for c in parent.heads.get(node.tokens[0], ())) == 1, f"block {b} heads"
            assert node.key == chain_key(parent.key, node.tokens, node.extra_key), f"block {b} key"
            assert 0 < len(node.tokens) <= self.tokens_per_block, f"block {b} token count"
            if len(node.tokens) < self.tokens_per_block:
                assert not node.children, f"partial block {b} has children"
            if p.ref_counts[b] > 0 and not parent.is_root:
                assert p.ref_counts[parent.block_id] > 0, f"block {b} held but parent not"
        self._check_host_tier()

    def _check_host_tier(self) -> None:
        h, tree = self.host, self.tree
        if h is None:
            assert not tree.host_nodes, "host nodes without a host tier"
            return
        free = list(h._free)
        assert len(set(free)) == len(free), "a host block is on the free list twice"
        assert not any(h.ref_counts), "a host block is still pinned"
        assert set(tree.host_nodes) == {b for b in range(h.num_blocks) if h.cached[b]}, "host cached flags != tree"
        assert len(free) + len(tree.host_nodes) == h.num_blocks, "host blocks lost or double-counted"
        assert h.num_cached_unreferenced == len(tree.host_nodes), "host cached count drifted"
        for hid, node in tree.host_nodes.items():
            parent = node.parent
            assert node.host_id == hid, f"host block {hid} misfiled"
            assert parent is not None and parent.children.get(node.key) is node, f"host block {hid} detached"
            assert len(node.tokens) == self.tokens_per_block, f"host block {hid} is partial"
            if node.on_device:   # a device node's copy
                assert tree.nodes.get(node.block_id) is node, f"host block {hid} copies a block not in the tree"
                continue
            assert not node.device_children, f"host block {hid} has a device child"
            assert node.key == chain_key(parent.key, node.tokens, node.extra_key), f"host block {hid} key"
        droppable = {hid for hid, n in tree.host_nodes.items() if n.on_device or not n.children}
        assert set(h._evictable) == droppable, \
            f"host evictable {sorted(h._evictable)} != copies and leaves {sorted(droppable)}"
