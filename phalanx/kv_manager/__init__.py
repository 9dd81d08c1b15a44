"""Paged KV cache bookkeeping in pure Python (no torch): block pool, radix tree, manager.

The tensors themselves live in ``phalanx.pyexecutor.kv_pool``; this package only decides block ids.
"""

from phalanx.kv_manager.block_pool import BlockPool, NoFreeBlocksError
from phalanx.kv_manager.manager import CopyOp, KVCacheManager, PrefixMatch
from phalanx.kv_manager.radix_tree import DEFAULT_PRIORITY, Node, RadixTree, block_keys, chain_key

__all__ = [
    "BlockPool", "NoFreeBlocksError", "CopyOp", "KVCacheManager", "PrefixMatch",
    "DEFAULT_PRIORITY", "Node", "RadixTree", "block_keys", "chain_key",
]
