"""The server's prefix cache: snapshots of a sequence's whole engine state at block boundaries of
prompts, found again by later prompts that start with the same tokens (docs/serve.md, "Prefix cache").

A trie over blocks of `block` token ids: the node at depth d (a multiple of `block`) stands for the
prompt prefix of d tokens on its path and may hold a snapshot, a fast.Cache forked from a sequence
right after its prefill reached d (every layer's state: KDA recurrent state and conv window, MLA
latents, indexer keys, gates and pool keys). A request looks up its prompt, forks the deepest snapshot
on the matching path (strictly shorter than the prompt: the last prompt token must run to give the
first token's logits) and prefills only the rest. The engine's logits of a position do not depend on
how the positions before it were split into steps (docs/contract.md), so a restored sequence gives
the bits of a cold one; tests/test_prefix_cache.py checks it.

A node is pinned (reference count) while a request holds it as the place where its next snapshot
hangs (from its lookup until it leaves); eviction (least recently used snapshot first, under `budget` bytes) drops snapshots
of any node but prunes only unpinned nodes without children and without a snapshot, so a pinned
node's path stays in the tree.

With a disk tier (prefix_disk.DiskTier, `--prefix-cache-dir`) every snapshot the trie holds is also written to a
safetensors file (Cache.export: the engines' one state layout), and a server started on the same
directory rebuilds the trie from the files' token ids at start; a file's state is read only when a
prompt first resumes from it (lazily: Engine.import_cache), then held like any snapshot. An imported
state is the exported one bit for bit, so a disk-restored request gives the bits of a resident (and
of a cold) one.

Everything here runs on the scheduler's thread (the only one touching the engine).
"""
from __future__ import annotations

import itertools
import logging

import numpy as np

from fast.core import state_bytes

from .prefix_disk import DiskTier, Refused

log = logging.getLogger("glm.serve.prefix")


def cache_bytes(config, length: int) -> int:
    """Bytes of one sequence's state at `length` positions (fast.core.state_bytes, summed)."""
    return sum(state_bytes(config, length).values())


class _Node:
    __slots__ = ("bytes", "children", "depth", "disk", "key", "parent", "pins", "snapshot", "used")

    def __init__(self, parent, key, depth):
        self.parent, self.key, self.depth = parent, key, depth
        self.children: dict[tuple, _Node] = {}
        self.snapshot = None   # a fast.Cache of `depth` positions, or None
        self.disk = None       # the name of its file in the disk tier, or None
        self.bytes = 0
        self.pins = 0
        self.used = 0


class PrefixCache:
    def __init__(self, engine, budget_bytes: int, block: int = 16, metrics=None, disk: DiskTier | None = None):
        if block < 1:
            raise ValueError(f"--prefix-block must be >= 1, got {block}")
        if budget_bytes < 0:
            raise ValueError(f"--prefix-cache-mb must be >= 0, got {budget_bytes}")
        self.engine, self.budget, self.block, self.metrics = engine, int(budget_bytes), int(block), metrics
        self.root = _Node(None, None, 0)
        self._clock = itertools.count(1)
        self.bytes = 0
        self.entries = 0       # snapshots held now
        self.snapshots = 0     # snapshots taken so far
        self.evictions = 0
        self.disk = disk
        self._on_disk: dict[str, _Node] = {}   # file name -> its node
        if disk is not None:
            for tokens, name in disk.scan():
                node = self._path(self.root, tokens, len(tokens))
                node.disk, self._on_disk[name] = name, node
        self._report()

    # -- lookup ----------------------------------------------------------------------------------
    def _blocks(self, prompt, start: int, stop: int):
        B = self.block
        for d in range(start, stop - B + 1, B):
            yield d + B, tuple(int(t) for t in prompt[d:d + B])

    def restore(self, prompt):
        """-> (cache or None, node, reach): a fork of the deepest snapshot whose prefix the prompt starts
        with and which leaves at least one prompt token to run (None: start from an empty cache); the
        node of that depth, pinned for the request (release it with `unpin`); and the depth of the
        deepest node on the prompt's path, snapshot or not: a prefix some other prompt shared, where
        this request's prefill should stop once so that the next one finds a snapshot there."""
        node, held = self.root, []
        for _, key in self._blocks(prompt, 0, len(prompt) - 1):
            child = node.children.get(key)
            if child is None:
                break
            node = child
            if node.snapshot is not None or node.disk is not None:
                held.append(node)
        reach = node.depth
        cache, at, from_disk = None, self.root, False
        for best in reversed(held):   # the deepest snapshot, in memory or else on disk
            if best.snapshot is None:
                cache = self._load(best)
                if cache is None:
                    continue
                from_disk = True
            else:
                cache = best.snapshot.fork()
                if best.disk is not None:
                    self.disk.touch(best.disk)
            best.used = next(self._clock)
            at = best
            break
        at.pins += 1
        if self.metrics is not None:
            self.metrics.prefix_lookup(at.depth, len(prompt))
        if from_disk:
            self.disk.hits += 1
            self._report()
        return cache, at, reach

    def _load(self, node: _Node):
        """The snapshot of `node` read from its file -> a cache for the request (the snapshot itself
        held in memory too when it fits the budget), or None where the file cannot be used (skipped
        with a warning and forgotten)."""
        name = node.disk
        try:
            cache = self.engine.import_cache(self.disk.read(name))
            if cache.length != node.depth:
                cache.close()
                raise Refused(f"it holds {cache.length} positions, its prefix {node.depth}")
        except Exception as e:  # noqa: BLE001 - a bad file is skipped, never fatal
            self.disk._skip(name, str(e) if isinstance(e, Refused) else f"{type(e).__name__}: {e}")
            self._forget(name)
            return None
        self.disk.touch(name)
        size = cache_bytes(self.engine.config, node.depth)
        if size > self.budget:
            return cache
        self._evict(self.budget - size)
        try:
            mine = cache.fork()
        except Exception:  # noqa: BLE001 - no room for a resident copy: the request takes the import
            return cache
        node.snapshot, node.bytes = cache, size
        self.bytes += size
        self.entries += 1
        return mine

    def _forget(self, name: str) -> None:
        """The disk tier no longer has `name` (evicted, or refused): its node loses the file."""
        node = self._on_disk.pop(name, None)
        if node is not None:
            node.disk = None
            self._prune(node)

    # -- insertion -------------------------------------------------------------------------------
    def boundary(self, fed: int, end: int, total: int, reach: int = 0) -> int:
        """Where a prefill chunk [fed, end) of a `total`-token prompt should stop: at `reach` (see
        restore) when it is inside, else at the last block boundary in (fed, end] when there is one
        (there the sequence is snapshotted after the step), else at end."""
        if fed < reach < end:
            return reach
        b = end // self.block * self.block
        return b if fed < b <= total else end

    def insert(self, node: _Node, tokens, cache, own: bool = False) -> _Node:
        """The sequence `cache` holds the first cache.length of `tokens`, a block boundary; `node` is the
        request's pinned node (a shallower prefix of the same tokens). Snapshot the cache there unless
        that prefix has one; -> the new pinned node (the pin moves down). own: keep `cache` itself as
        the snapshot (or close it), not a fork of it."""
        depth = cache.length
        if depth % self.block or depth <= node.depth:
            if own:
                cache.close()
            return node
        at = self._path(node, tokens, depth)
        at.pins += 1
        self.unpin(node)
        at.used = next(self._clock)
        if at.snapshot is None:
            size = cache_bytes(self.engine.config, depth)
            if size <= self.budget:
                self._evict(self.budget - size)
                try:
                    at.snapshot = cache if own else cache.fork()
                except Exception:  # noqa: BLE001 - e.g. out of memory: no snapshot, the request goes on
                    at.snapshot = None
                else:
                    own = False
                    at.bytes = size
                    self.bytes += size
                    self.entries += 1
                    self.snapshots += 1
                    self._write(at, tokens)
                self._report()
        if own:
            cache.close()
        return at

    def _path(self, node: _Node, tokens, depth: int) -> _Node:
        """The node of tokens[:depth] below `node` (a shallower prefix of them), made where missing."""
        at = node
        for d, key in self._blocks(tokens, node.depth, depth):
            child = at.children.get(key)
            if child is None:
                child = at.children[key] = _Node(at, key, d)
            at = child
        return at

    def _write(self, node: _Node, tokens) -> None:
        """The disk tier's file of a new snapshot (a failed write is a warning: the snapshot stays in memory)."""
        if self.disk is None or node.disk is not None:
            return
        name = self.disk.name(np.asarray(tokens[:node.depth], np.int32))
        try:
            self.disk.write(tokens[:node.depth], node.snapshot)
        except Exception as e:  # noqa: BLE001 - e.g. a full disk
            log.warning("prefix cache: could not write %s: %s: %s", self.disk.dir / name, type(e).__name__, e)
            return
        node.disk, self._on_disk[name] = name, node
        for gone in self.disk.fit():
            self._forget(gone)

    def unpin(self, node: _Node | None) -> None:
        if node is None:
            return
        node.pins -= 1
        self._prune(node)

    # -- eviction --------------------------------------------------------------------------------
    def _evict(self, room: int) -> None:
        """Drop least recently used snapshots until at most `room` bytes are held."""
        if self.bytes <= room:
            return
        held = sorted((n for n in self._nodes() if n.snapshot is not None), key=lambda n: n.used)
        for n in held:
            if self.bytes <= room:
                break
            n.snapshot.close()
            n.snapshot = None
            self.bytes -= n.bytes
            self.entries -= 1
            n.bytes = 0
            self.evictions += 1
            self._prune(n)

    def _prune(self, node: _Node) -> None:
        while (node.parent is not None and node.snapshot is None and node.disk is None and not node.children
               and node.pins == 0):
            del node.parent.children[node.key]
            node = node.parent

    def _nodes(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _report(self) -> None:
        if self.metrics is not None:
            self.metrics.prefix_state(self.budget, self.bytes, self.entries, self.snapshots, self.evictions)
            if self.disk is not None:
                d = self.disk
                self.metrics.prefix_disk_state(hits=d.hits, writes=d.writes, skipped=d.skipped,
                                               evictions=d.evictions, files=len(d.files), bytes=d.bytes,
                                               budget_bytes=d.budget)

    def clear(self) -> None:
        for n in self._nodes():
            if n.snapshot is not None:
                n.snapshot.close()
                n.snapshot = None
        self.root.children.clear()
        self._on_disk.clear()   # (the files stay: a server started on the directory finds them)
        self.bytes = self.entries = 0
