"""``phalanx bench prefix``: the prefix-index study.

Replays token traces through three prefix indexes holding the same number of KV tokens (and
ours again with a host tier three times that size beside it, ``radix32+host``):

* ``hashed16`` — vLLM's design: a flat map of chained hashes of full 16-token blocks, LRU over
  unreferenced blocks; a hit is the run of leading full blocks found.
* ``radix32`` — ours: ``kv_manager.KVCacheManager`` itself (32-token blocks keyed by chained
  SHA-256, partial reuse of the next block by copy-on-write, a request's tail kept).
* ``token_radix`` — SGLang's design: a radix tree over tokens, hits of any length, LRU over
  leaves, capacity counted in tokens.

Each request in a trace is a prompt plus the output it produced; the index is asked for the
prompt (never its last token, which must be computed), then everything the request computed
is inserted. Reported per (trace, memory pressure, index): hit rate (reused prompt tokens /
prompt tokens), evictions, index entries at the end, CPU microseconds per request.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from phalanx.bench.serve import need_matplotlib
from phalanx.kv_manager import KVCacheManager

Trace = list[tuple[list[int], list[int]]]   # (prompt, output) per request, in arrival order


# -- the three indexes ------------------------------------------------------------------------------
class HashedBlocks:
    """vLLM-style: chained hashes of full blocks in a flat map, LRU eviction."""

    name = "hashed16"

    def __init__(self, capacity_tokens: int, block: int = 16) -> None:
        self.block, self.capacity = block, max(1, capacity_tokens // block)
        self.blocks: OrderedDict[bytes, None] = OrderedDict()   # LRU order: oldest first
        self.evictions = 0

    def _keys(self, tokens: Sequence[int]) -> list[bytes]:
        keys, h = [], b""
        for i in range(len(tokens) // self.block):
            chunk = tokens[i * self.block:(i + 1) * self.block]
            h = hashlib.sha256(h + struct.pack(f"<{len(chunk)}q", *chunk)).digest()
            keys.append(h)
        return keys

    def lookup(self, prompt: Sequence[int]) -> int:
        n = 0
        for key in self._keys(prompt[:len(prompt) - 1]):
            if key not in self.blocks:
                break
            self.blocks.move_to_end(key)
            n += self.block
        return n

    def insert(self, tokens: Sequence[int]) -> None:
        keys = self._keys(tokens)
        for key in keys:
            if key in self.blocks:
                self.blocks.move_to_end(key)
                continue
            while len(self.blocks) >= self.capacity:
                self.blocks.popitem(last=False)
                self.evictions += 1
            self.blocks[key] = None

    def entries(self) -> int:
        return len(self.blocks)


class OurRadix:
    """Ours: the engine's own KVCacheManager, driven as the scheduler drives it."""

    name = "radix32"

    def __init__(self, capacity_tokens: int, block: int = 32) -> None:
        self.kv = KVCacheManager(max(2, capacity_tokens // block), block)
        self._next = 0

    def lookup(self, prompt: Sequence[int]) -> int:
        return self.kv.match(list(prompt)).num_tokens

    def insert(self, tokens: Sequence[int]) -> None:
        """Admit, compute and free a request holding ``tokens`` (as many as the cache fits)."""
        rid, self._next = self._next, self._next + 1
        tokens = list(tokens)[:self.kv.num_blocks * self.kv.tokens_per_block]
        self.kv.admit(rid, self.kv.match(tokens), len(tokens))
        self.kv.take_copy_ops()
        self.kv.commit(rid, tokens, len(tokens))
        self.kv.free(rid)
        self.kv.release_copy_sources()

    @property
    def evictions(self) -> int:
        return self.kv.tree.num_evicted

    def entries(self) -> int:
        return len(self.kv.tree)


class OurRadixHost(OurRadix):
    """Ours with ``kv_cache_config.host_cache_size``: the same device blocks, and a host tier of
    ``HOST_FACTOR`` times as many that keeps what the device evicts (a hit there is onboarded)."""

    name = "radix32+host"
    HOST_FACTOR = 3

    def __init__(self, capacity_tokens: int, block: int = 32) -> None:
        n = max(2, capacity_tokens // block)
        self.kv = KVCacheManager(n, block, num_host_blocks=self.HOST_FACTOR * n)
        self._next = 0

    def entries(self) -> int:   # (a device node's host copy is the same entry)
        return len(self.kv.tree) + sum(not n.on_device for n in self.kv.tree.host_nodes.values())


@dataclass(eq=False)
class _TNode:
    tokens: tuple[int, ...]
    parent: _TNode | None
    children: dict[int, _TNode] = field(default_factory=dict)
    last_access: int = 0


class TokenRadix:
    """SGLang-style: a radix tree over tokens (edges split at divergence), LRU over leaves,
    capacity in tokens."""

    name = "token_radix"

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens
        self.root = _TNode((), None)
        self.size = 0
        self.tick = 0
        self.evictions = 0

    def _walk(self, tokens: Sequence[int], split: bool) -> tuple[_TNode, int]:
        """Deepest node matching a prefix of tokens and the matched length (splitting an edge
        at the divergence point when ``split``)."""
        node, i = self.root, 0
        self.tick += 1
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            n = 0
            while n < len(child.tokens) and i + n < len(tokens) and child.tokens[n] == tokens[i + n]:
                n += 1
            child.last_access = self.tick
            if n < len(child.tokens):
                if not split:
                    return child, i + n
                mid = _TNode(child.tokens[:n], node, {child.tokens[n]: child}, self.tick)
                node.children[tokens[i]] = mid
                child.tokens, child.parent = child.tokens[n:], mid
                return mid, i + n
            node, i = child, i + n
        return node, i

    def lookup(self, prompt: Sequence[int]) -> int:
        _, n = self._walk(prompt[:len(prompt) - 1], split=False)
        return n

    def insert(self, tokens: Sequence[int]) -> None:
        tokens = list(tokens)[:self.capacity]
        node, n = self._walk(tokens, split=True)
        rest = tuple(tokens[n:])
        if not rest:
            return
        self._evict(len(rest), protect=node)
        leaf = _TNode(rest, node, last_access=self.tick)
        node.children[rest[0]] = leaf
        self.size += len(rest)

    def _evict(self, need: int, protect: _TNode) -> None:
        guarded = set()
        p: _TNode | None = protect
        while p is not None:
            guarded.add(id(p))
            p = p.parent
        while self.size + need > self.capacity:
            leaves = [n for n in self._nodes() if not n.children and id(n) not in guarded]
            if not leaves:
                return
            victim = min(leaves, key=lambda n: n.last_access)
            del victim.parent.children[victim.tokens[0]]
            self.size -= len(victim.tokens)
            self.evictions += 1

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def entries(self) -> int:
        return sum(1 for _ in self._nodes())


INDEXES = (HashedBlocks, OurRadix, TokenRadix, OurRadixHost)


def replay(index, trace: Trace) -> dict[str, float]:
    hits = prompt_tokens = 0
    t0 = time.perf_counter()
    for prompt, output in trace:
        hits += index.lookup(prompt)
        prompt_tokens += len(prompt)
        index.insert(prompt + output[:-1] if output else prompt)
    dt = time.perf_counter() - t0
    return {"hit_rate": hits / max(1, prompt_tokens), "hit_tokens": hits, "prompt_tokens": prompt_tokens,
            "evictions": index.evictions, "entries": index.entries(), "us_per_request": dt / max(1, len(trace)) * 1e6}


# -- traces ----------------------------------------------------------------------------------------------
def _rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 50_000) for _ in range(n)]


def trace_system_prompt(rng: random.Random, n: int = 200, system: int = 600) -> Trace:
    sp = _rand(rng, system)
    return [(sp + _rand(rng, rng.randrange(20, 120)), _rand(rng, rng.randrange(20, 100))) for _ in range(n)]


def trace_multi_turn(rng: random.Random, conversations: int = 24, turns: int = 6) -> Trace:
    hist = [_rand(rng, rng.randrange(50, 300)) for _ in range(conversations)]
    out: Trace = []
    for _ in range(turns):
        order = list(range(conversations))
        rng.shuffle(order)
        for c in order:
            reply = _rand(rng, rng.randrange(30, 120))
            out.append((list(hist[c]), reply))
            hist[c] = hist[c] + reply + _rand(rng, rng.randrange(10, 60))
    return out


def trace_agent_tree(rng: random.Random, roots: int = 6, depth: int = 3, fan: int = 3) -> Trace:
    out: Trace = []

    def grow(ctx: list[int], d: int) -> None:
        reply = _rand(rng, rng.randrange(20, 80))
        out.append((ctx, reply))
        if d < depth:
            for _ in range(fan):
                grow(ctx + reply + _rand(rng, rng.randrange(10, 40)), d + 1)

    for _ in range(roots):
        grow(_rand(rng, rng.randrange(200, 400)), 0)
    return out


def trace_rag(rng: random.Random, docs: int = 12, questions: int = 200) -> Trace:
    corpus = [_rand(rng, rng.randrange(300, 900)) for _ in range(docs)]
    sp = _rand(rng, 100)
    return [(sp + corpus[min(docs - 1, int(rng.expovariate(0.35)))] + _rand(rng, rng.randrange(10, 40)),
             _rand(rng, rng.randrange(20, 80))) for _ in range(questions)]


def trace_random(rng: random.Random, n: int = 200) -> Trace:
    return [(_rand(rng, rng.randrange(100, 600)), _rand(rng, rng.randrange(20, 100))) for _ in range(n)]


TRACES: dict[str, Callable[[random.Random], Trace]] = {
          "system_prompt": trace_system_prompt, "multi_turn": trace_multi_turn, "agent_tree": trace_agent_tree,
          "rag": trace_rag, "random": trace_random}


def working_set(trace: Trace) -> int:
    """Distinct tokens a perfect prefix cache would hold (tokens of the token radix unbounded)."""
    idx = TokenRadix(1 << 40)
    for prompt, output in trace:
        idx.insert(prompt + output[:-1] if output else prompt)
    return idx.size


def study(seed: int = 0, pressures: dict[str, float] | None = None) -> list[dict]:
    pressures = pressures or {"low": 1.0, "high": 0.25}
    rows = []
    for tname, make in TRACES.items():
        trace = make(random.Random(seed))
        ws = working_set(trace)
        for pname, frac in pressures.items():
            cap = max(64, int(ws * frac))
            for cls in INDEXES:
                r = replay(cls(cap), trace)
                rows.append({"trace": tname, "pressure": pname, "capacity_tokens": cap, "working_set": ws,
                             "index": cls.name, **r})
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    traces = list(dict.fromkeys(r["trace"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, pressure in zip(axes, ("low", "high"), strict=True):
        names = [c.name for c in INDEXES]
        for j, idx in enumerate(names):
            vals = [next(r["hit_rate"] for r in rows if r["trace"] == t and r["pressure"] == pressure
                         and r["index"] == idx) for t in traces]
            w = 0.8 / len(names)
            ax.bar([i + (j - (len(names) - 1) / 2) * w for i in range(len(traces))], vals, width=w, label=idx)
        ax.set_xticks(range(len(traces)), traces, rotation=20)
        ax.set_title(f"{pressure} memory pressure")
        ax.set_ylabel("prompt tokens reused")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="phalanx bench prefix", description=__doc__)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default=None, help="JSON report")
    ap.add_argument("--plot", default=None, help="PNG of hit rates")
    a = ap.parse_args(argv)
    if a.plot:
        need_matplotlib(ap)
    rows = study(a.seed)
    print(f"{'trace':14s} {'pressure':8s} {'index':12s} {'hit rate':>8s} {'evict':>7s} {'entries':>8s} {'us/req':>8s}")
    for r in rows:
        print(f"{r['trace']:14s} {r['pressure']:8s} {r['index']:12s} {r['hit_rate']:8.3f} {r['evictions']:7d} "
              f"{r['entries']:8d} {r['us_per_request']:8.1f}")
    if a.output:
        with open(a.output, "w") as f:
            json.dump({"settings": vars(a), "rows": rows}, f, indent=2)
    if a.plot:
        plot(rows, a.plot)
    return 0
