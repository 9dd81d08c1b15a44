"""Radix tree of full KV blocks keyed by chained SHA-256 digests.

Pure Python: no torch. Nodes hold block ids and the tokens of their block, never tensors.

Keys chain through the tree, so equal keys mean equal whole prefixes::

    key(block i) = SHA-256( key(block i-1) ‖ tokens of block i as little-endian int64 ‖ extra key )
    key(block -1) = b""                         (the root)

The extra key (``cache_salt``, a LoRA id, ...) enters every block, so two requests with
different extra keys never share a block, not even through partial reuse.

Matching walks full blocks by key, then (partial reuse) scans the children of the last match
for the longest common token prefix; the caller copies those rows into a fresh block
(copy-on-write), which gives token-granular hits with 32-token metadata. Only leaves may hold
fewer than B tokens (the tail of a finished request); their keys never equal a full block's,
so only the token scan finds them.

Only unreferenced leaves are evicted, lowest retention priority first, LRU within a priority;
a parent becomes evictable when its last child goes.

With a host tier (a second ``BlockPool`` of host block ids), an evicted full block is not
forgotten but offloaded: its node stays in the tree holding a host block instead of a device
block, and the caller copies the rows out before the device block is written again::

    node         block_id   host_id   children          device evictable when    host block goes when
    device       >= 0       -1        device or host    unreferenced, no device  -
                                                        children
    device with  >= 0       >= 0      device or host    the same (no copy: it    any time, before any
    a host copy                                         becomes a host node)     host node (a duplicate)
    host         -1         >= 0      host only         -                        no children (the node
                                                                                 leaves the tree)

so the host-only nodes of any root path are its tail. A match returns them after the device
nodes; admitting it takes fresh device blocks for them (``promote``), the caller copies the rows
back in, and the host block stays as the node's copy: evicted again, the node goes back to the
host without a transfer. A block that finds no host block (the host tier full of pinned or
inner nodes) is dropped with the host nodes below it; so are partial leaves, which only a token
scan of device children would match, and blocks of an older epoch (``live_key``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from phalanx.kv_manager.block_pool import BlockPool

DEFAULT_PRIORITY = 35
COPY_PRIORITY = -1   # the host tier drops a device node's copy before any block held only there


_PACKERS: dict[int, struct.Struct] = {}


def chain_key(parent_key: bytes, tokens: Sequence[int], extra_key: bytes = b"") -> bytes:
    """SHA-256(parent key ‖ tokens as little-endian int64 ‖ extra key)."""
    n = len(tokens)
    packer = _PACKERS.get(n)
    if packer is None:
        packer = _PACKERS[n] = struct.Struct(f"<{n}q")
    return hashlib.sha256(parent_key + packer.pack(*tokens) + extra_key).digest()


def block_keys(
    tokens: Sequence[int], tokens_per_block: int, extra_key: bytes = b"", start: int = 0,
    parent_key: bytes = b"",
) -> list[bytes]:
    """Chained keys of the full blocks of ``tokens`` from block index ``start`` on.

    ``parent_key`` must be the key of block ``start - 1`` (b"" when start is 0).
    """
    keys: list[bytes] = []
    key = parent_key
    B = tokens_per_block
    for i in range(start, len(tokens) // B):
        key = chain_key(key, tokens[i * B:(i + 1) * B], extra_key)
        keys.append(key)
    return keys


@dataclass(eq=False)
class Node:
    """One full block in the tree."""

    key: bytes
    block_id: int                     # the device block, or -1 on the host tier
    tokens: tuple[int, ...]
    extra_key: bytes
    parent: Node | None
    priority: int = DEFAULT_PRIORITY
    last_access: int = 0
    children: dict[bytes, Node] = field(default_factory=dict)
    # the children again by their first token, in insertion order: the only ones a token scan can match
    heads: dict[int, list[Node]] = field(default_factory=dict)
    host_id: int = -1                 # its host block (a host node's, or a device node's copy)
    device_children: int = 0          # children on the device tier

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def on_device(self) -> bool:
        return self.block_id >= 0


@dataclass
class TreeMatch:
    """Result of a read-only match. ``nodes`` is a root path of fully matched device blocks and
    ``host_nodes`` its continuation on the host tier; when ``partial_node`` is set (a device
    child of the last device node), its first ``partial_len`` tokens also match (copy-on-write)."""

    nodes: list[Node]
    partial_node: Node | None = None
    partial_len: int = 0
    host_nodes: list[Node] = field(default_factory=list)

    def num_tokens(self, tokens_per_block: int) -> int:
        return (len(self.nodes) + len(self.host_nodes)) * tokens_per_block + self.partial_len


class RadixTree:
    """Prefix index over full blocks. Mutates the pool's cached flags and eviction LRU (and the
    host pool's, with a host tier: ``on_offload(device block, host block)`` is called for each
    block copied there, in order; a node with a host copy goes back without a call)."""

    def __init__(self, pool: BlockPool, tokens_per_block: int, host: BlockPool | None = None,
                 on_offload: Callable[[int, int], None] | None = None) -> None:
        self.pool = pool
        self.tokens_per_block = tokens_per_block
        self.root = Node(key=b"", block_id=-1, tokens=(), extra_key=b"", parent=None)
        self.nodes: dict[int, Node] = {}  # block id -> node (the device tier)
        self.num_evicted = 0               # device blocks freed by eviction (offloaded or dropped)
        self.host = host
        self.host_nodes: dict[int, Node] = {}   # host block id -> node (the host tier)
        self.on_offload = on_offload
        self._offloading = host is not None    # (off while ``evict(offload=False)`` runs)
        self.live_key = b""                    # the end of every matchable extra key (the manager's epoch):
                                               # an older block is dropped, not offloaded
        self.num_offloaded = 0             # blocks moved to the host tier
        self.num_onboarded = 0             # blocks copied back (``promote``)

    def __len__(self) -> int:
        return len(self.nodes)

    # -- read --------------------------------------------------------------------------------
    def match(
        self, tokens: Sequence[int], extra_key: bytes, max_tokens: int, partial: bool = True,
    ) -> TreeMatch:
        """Longest cached prefix of ``tokens[:max_tokens]``; mutates nothing.

        Keys are computed while walking, so a miss costs one hash, not one per block; a node
        with one child (most of a long cached prefix) compares that child's tokens instead.
        """
        B = self.tokens_per_block
        node, path = self.root, []
        n = max_tokens // B
        blocks: tuple[int, ...] = ()
        child: Node | None
        for i in range(n):
            children = node.children
            if len(children) == 1:   # the one child matches iff its tokens and extra key do (its key chains them)
                if not blocks:
                    blocks = tuple(tokens[:n * B])
                (child,) = children.values()
                if child.extra_key != extra_key or child.tokens != blocks[i * B:(i + 1) * B]:
                    break
            else:
                child = children.get(chain_key(node.key, tokens[i * B:(i + 1) * B], extra_key))
                if child is None:
                    break
            path.append(child)
            node = child
        on_device = len(path)
        while on_device and not path[on_device - 1].on_device:   # the host tier is a root path's tail
            on_device -= 1
        result = TreeMatch(path[:on_device], host_nodes=path[on_device:])
        start = len(path) * B
        want = tokens[start:min(start + B, max_tokens)]
        if partial and want and (node.is_root or node.on_device):
            result.partial_node, result.partial_len = self._longest_child_prefix(node, want, extra_key)
        return result

    def _longest_child_prefix(
        self, node: Node, want: Sequence[int], extra_key: bytes,
    ) -> tuple[Node | None, int]:
        best, best_len = None, 0
        for child in node.heads.get(want[0], ()):   # any other child shares no token with ``want``
            if child.extra_key != extra_key or child.block_id < 0:   # (a host block is not copied from)
                continue
            n = _common_prefix_len(child.tokens, want)
            if n > best_len:
                best, best_len = child, n
        return best, best_len

    def covered(self, parent: Node, tokens: Sequence[int], extra_key: bytes) -> bool:
        """True if a device child of ``parent`` already starts with ``tokens`` (same extra key;
        a host child serves no partial hit)."""
        n = len(tokens)
        return any(c.block_id >= 0 and c.extra_key == extra_key and len(c.tokens) >= n and c.tokens[:n] == tuple(tokens)
                   for c in (parent.heads.get(tokens[0], ()) if n else parent.children.values()))

    # -- references on cached blocks ------------------------------------------------------------
    def ref(self, node: Node) -> None:
        """A request starts holding ``node``: it stops being evictable."""
        self.pool.ref(node.block_id)

    def unref(self, node: Node, tick: int) -> None:
        """A request stops holding ``node``; at ref 0 a node without device children becomes
        evictable at ``tick``."""
        node.last_access = tick
        if self.pool.unref(node.block_id) == 0 and not node.device_children:
            self.pool.add_evictable(node.block_id, node.priority, tick)

    # -- write -------------------------------------------------------------------------------
    def insert(
        self, parent: Node, key: bytes, tokens: Sequence[int], block_id: int, extra_key: bytes,
        priority: int = DEFAULT_PRIORITY,
    ) -> Node:
        """Add a device block under ``parent`` (a device node or the root). The caller holds
        ``block_id`` (ref >= 1) and has checked that ``parent`` has no child with ``key``."""
        assert key not in parent.children, "duplicate key: reuse the existing node"
        node = Node(key, block_id, tuple(tokens), extra_key, parent, priority, self.pool.next_tick())
        parent.children[key] = node
        parent.heads.setdefault(node.tokens[0], []).append(node)
        self._gain_device_child(parent)
        self.nodes[block_id] = node
        self.pool.set_cached(block_id, True)
        return node

    def promote(self, node: Node, block_id: int, copied: bool = True) -> None:
        """Move a host node back to the device tier at ``block_id`` (held by the caller, ref >= 1,
        its rows copied in from the host block, or computed equal: ``copied`` false). The host
        block stays as its copy, which the host tier may drop at any time. ``node``'s parent is
        on the device (host nodes are a path's tail)."""
        host, parent = self.host, node.parent
        assert host is not None and not node.on_device and parent is not None
        hid = node.host_id
        assert host.ref_counts[hid] == 0, f"host block {hid} is pinned"
        node.block_id = block_id
        self.nodes[block_id] = node
        self.pool.set_cached(block_id, True)
        self._gain_device_child(parent)
        host.add_evictable(hid, COPY_PRIORITY, self.pool.next_tick())   # a copy: dropped first, LRU
        self.num_onboarded += copied

    def evict(self, num_blocks: int, offload: bool = True) -> int:
        """Free ``num_blocks`` device blocks by evicting unreferenced leaves; returns how many
        went. With a host tier (and ``offload``) a full block moves there rather than going."""
        done = 0
        self._offloading = offload and self.host is not None
        try:
            while done < num_blocks and self.pool.num_evictable:
                self._evict_one()
                done += 1
        finally:
            self._offloading = self.host is not None
        return done

    def drop_host(self) -> int:
        """Forget every host block (``invalidate``): host nodes leave the tree, device nodes
        lose their copies. Returns how many went."""
        n = len(self.host_nodes)
        for node in list(self.host_nodes.values()):
            if node.host_id in self.host_nodes:   # (not yet dropped with an ancestor)
                self._drop_host_block(node)
        return n

    def _gain_device_child(self, parent: Node) -> None:
        parent.device_children += 1
        if not parent.is_root:
            self.pool.discard_evictable(parent.block_id)  # no longer a leaf of the device tier

    def _evict_one(self) -> None:
        block_id = self.pool.pop_evictable()
        node = self.nodes[block_id]
        assert node.parent is not None and not node.device_children
        worth = len(node.tokens) == self.tokens_per_block and node.extra_key.endswith(self.live_key)
        self.num_evicted += 1
        keep = self._offloading and worth
        hid = (node.host_id if node.host_id >= 0 else self._host_block()) if keep else None
        if hid is None:
            self._drop(node)                   # (its host copy, if any, with it)
            return
        host = self.host
        assert host is not None and self.on_offload is not None
        if node.host_id < 0:                   # (a node with a host copy moves there as it is)
            self.on_offload(block_id, hid)     # the rows leave before the device block is written again
            node.host_id = hid
            self.host_nodes[hid] = node
            host.set_cached(hid, True)
            host.unref(hid)                    # cached, held by nobody
            self.num_offloaded += 1
        else:
            host.discard_evictable(hid)        # no longer a copy: a host node, kept while it has children
        self._free_device(node)
        if not node.children:
            host.add_evictable(hid, node.priority, node.last_access)

    def _lose_device_child(self, parent: Node) -> None:
        parent.device_children -= 1
        if not parent.is_root and not parent.device_children and self.pool.ref_counts[parent.block_id] == 0:
            self.pool.add_evictable(parent.block_id, parent.priority, parent.last_access)

    def _host_block(self) -> int | None:
        """A free host block, or None: a device node's copy is dropped for it first, else a host
        leaf (lowest retention priority, least recently used)."""
        host = self.host
        if host is None:
            return None
        if not host.num_free:
            if not host.num_evictable:
                return None
            self._drop_host_block(self.host_nodes[host.pop_evictable()])
        return host.take_free(1)[0]

    def _drop_host_block(self, node: Node) -> None:
        """Let a node's host block go: a device node's copy, or a host node with the host nodes
        below it."""
        if node.on_device:
            self._free_host(node)
        else:
            self._drop(node)

    def _free_host(self, node: Node) -> None:
        """Return a node's host block to the host tier's free list."""
        host, hid = self.host, node.host_id
        assert host is not None and hid >= 0
        host.discard_evictable(hid)
        del self.host_nodes[hid]
        host.set_cached(hid, False)
        host.put_free(hid)
        node.host_id = -1

    def _free_device(self, node: Node) -> None:
        """Return a node's device block to the pool's free list (its parent loses a device child)."""
        assert node.parent is not None
        del self.nodes[node.block_id]
        self.pool.set_cached(node.block_id, False)
        self.pool.put_free(node.block_id)
        node.block_id = -1
        self._lose_device_child(node.parent)

    def _drop(self, node: Node) -> None:
        """Take ``node`` and the host nodes below it out of the tree, freeing their blocks."""
        for child in list(node.children.values()):
            assert not child.on_device, "a device node under a dropped one"
            self._drop(child)
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        heads = parent.heads[node.tokens[0]]
        heads.remove(node)
        if not heads:
            del parent.heads[node.tokens[0]]
        on_device = node.on_device
        if node.host_id >= 0:
            self._free_host(node)
        if on_device:
            self._free_device(node)
        elif not parent.on_device and not parent.is_root and not parent.children:
            host = self.host
            assert host is not None
            if not host.ref_counts[parent.host_id]:   # (a pinned one waits for its promotion)
                host.add_evictable(parent.host_id, parent.priority, parent.last_access)

    # -- inspection --------------------------------------------------------------------------
    def pretty(self, max_tokens: int = 6) -> str:
        """The tree as indented lines: block id and ref count (or host block), first tokens."""
        lines = ["<root>"]

        def walk(node: Node, depth: int) -> None:
            for child in sorted(node.children.values(), key=lambda n: (n.block_id, n.host_id)):
                head = ",".join(map(str, child.tokens[:max_tokens]))
                more = ",…" if len(child.tokens) > max_tokens else ""
                where = (f"block {child.block_id} ref={self.pool.ref_counts[child.block_id]}" if child.on_device
                         else f"host block {child.host_id}")
                if child.on_device and child.host_id >= 0:
                    where += f" (copy in host block {child.host_id})"
                lines.append(f"{'  ' * depth}└ {where} [{head}{more}]")
                walk(child, depth + 1)

        walk(self.root, 1)
        return "\n".join(lines)


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
