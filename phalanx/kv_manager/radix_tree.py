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
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from phalanx.kv_manager.block_pool import BlockPool

DEFAULT_PRIORITY = 35


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
    block_id: int
    tokens: tuple[int, ...]
    extra_key: bytes
    parent: Node | None
    priority: int = DEFAULT_PRIORITY
    last_access: int = 0
    children: dict[bytes, Node] = field(default_factory=dict)
    # the children again by their first token, in insertion order: the only ones a token scan can match
    heads: dict[int, list[Node]] = field(default_factory=dict)

    @property
    def is_root(self) -> bool:
        return self.parent is None


@dataclass
class TreeMatch:
    """Result of a read-only match. ``nodes`` is a root path of fully matched blocks; when
    ``partial_node`` is set, its first ``partial_len`` tokens also match (copy-on-write)."""

    nodes: list[Node]
    partial_node: Node | None = None
    partial_len: int = 0

    def num_tokens(self, tokens_per_block: int) -> int:
        return len(self.nodes) * tokens_per_block + self.partial_len


class RadixTree:
    """Prefix index over full blocks. Mutates the pool's cached flags and eviction LRU."""

    def __init__(self, pool: BlockPool, tokens_per_block: int) -> None:
        self.pool = pool
        self.tokens_per_block = tokens_per_block
        self.root = Node(key=b"", block_id=-1, tokens=(), extra_key=b"", parent=None)
        self.nodes: dict[int, Node] = {}  # block id -> node
        self.num_evicted = 0

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
        result = TreeMatch(path)
        start = len(path) * B
        want = tokens[start:min(start + B, max_tokens)]
        if partial and want:
            result.partial_node, result.partial_len = self._longest_child_prefix(node, want, extra_key)
        return result

    def _longest_child_prefix(
        self, node: Node, want: Sequence[int], extra_key: bytes,
    ) -> tuple[Node | None, int]:
        best, best_len = None, 0
        for child in node.heads.get(want[0], ()):   # any other child shares no token with ``want``
            if child.extra_key != extra_key:
                continue
            n = _common_prefix_len(child.tokens, want)
            if n > best_len:
                best, best_len = child, n
        return best, best_len

    def covered(self, parent: Node, tokens: Sequence[int], extra_key: bytes) -> bool:
        """True if a child of ``parent`` already starts with ``tokens`` (same extra key)."""
        n = len(tokens)
        return any(c.extra_key == extra_key and len(c.tokens) >= n and c.tokens[:n] == tuple(tokens)
                   for c in (parent.heads.get(tokens[0], ()) if n else parent.children.values()))

    # -- references on cached blocks ------------------------------------------------------------
    def ref(self, node: Node) -> None:
        """A request starts holding ``node``: it stops being evictable."""
        self.pool.ref(node.block_id)

    def unref(self, node: Node, tick: int) -> None:
        """A request stops holding ``node``; at ref 0 a leaf becomes evictable at ``tick``."""
        node.last_access = tick
        if self.pool.unref(node.block_id) == 0 and not node.children:
            self.pool.add_evictable(node.block_id, node.priority, tick)

    # -- write -------------------------------------------------------------------------------
    def insert(
        self, parent: Node, key: bytes, tokens: Sequence[int], block_id: int, extra_key: bytes,
        priority: int = DEFAULT_PRIORITY,
    ) -> Node:
        """Add a block under ``parent``. The caller holds ``block_id`` (ref >= 1) and has
        checked that ``parent`` has no child with ``key``."""
        assert key not in parent.children, "duplicate key: reuse the existing node"
        node = Node(key, block_id, tuple(tokens), extra_key, parent, priority, self.pool.next_tick())
        parent.children[key] = node
        parent.heads.setdefault(node.tokens[0], []).append(node)
        self.nodes[block_id] = node
        self.pool.set_cached(block_id, True)
        if not parent.is_root:
            self.pool.discard_evictable(parent.block_id)  # no longer a leaf
        return node

    def evict(self, num_blocks: int) -> int:
        """Evict ``num_blocks`` unreferenced leaves to the free list; returns how many went."""
        done = 0
        while done < num_blocks and self.pool.num_evictable:
            self._evict_one()
            done += 1
        return done

    def _evict_one(self) -> None:
        block_id = self.pool.pop_evictable()
        node = self.nodes.pop(block_id)
        parent = node.parent
        assert parent is not None and not node.children
        del parent.children[node.key]
        heads = parent.heads[node.tokens[0]]
        heads.remove(node)
        if not heads:
            del parent.heads[node.tokens[0]]
        self.pool.set_cached(block_id, False)
        self.pool.put_free(block_id)
        self.num_evicted += 1
        if not parent.is_root and not parent.children and self.pool.ref_counts[parent.block_id] == 0:
            self.pool.add_evictable(parent.block_id, parent.priority, parent.last_access)

    # -- inspection --------------------------------------------------------------------------
    def pretty(self, max_tokens: int = 6) -> str:
        """The tree as indented lines: block id, ref count, first tokens."""
        lines = ["<root>"]

        def walk(node: Node, depth: int) -> None:
            for child in sorted(node.children.values(), key=lambda n: n.block_id):
                head = ",".join(map(str, child.tokens[:max_tokens]))
                more = ",…" if len(child.tokens) > max_tokens else ""
                ref = self.pool.ref_counts[child.block_id]
                lines.append(f"{'  ' * depth}└ block {child.block_id} ref={ref} [{head}{more}]")
                walk(child, depth + 1)

        walk(self.root, 1)
        return "\n".join(lines)


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
