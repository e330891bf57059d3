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

With a disk tier (DiskTier, `--prefix-cache-dir`) every snapshot the trie holds is also written to a
safetensors file (Cache.export: the engines' one state layout), and a server started on the same
directory rebuilds the trie from the files' token ids at start; a file's state is read only when a
prompt first resumes from it (lazily: Engine.import_cache), then held like any snapshot. An imported
state is the exported one bit for bit, so a disk-restored request gives the bits of a resident (and
of a cold) one.

Everything here runs on the scheduler's thread (the only one touching the engine).
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import os
from pathlib import Path

import numpy as np

from fast.core import state_bytes

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


class _Refused(Exception):
    """A file of the disk tier that this server does not use (the message says why)."""


class DiskTier:
    """Snapshots as files of one directory: `<sha256 of the token ids>.safetensors`, each holding the
    state arrays of Cache.export (f32, the engines' layout), `length` (int64) and `tokens` (int32, the
    prefix), with metadata format, fingerprint (the server's system_fingerprint: checkpoint identity,
    engine, project and sampling versions), length, block and sha256 (over every array). Files of
    another fingerprint or format, corrupt ones and ones whose name is not their tokens' hash are
    skipped with a warning and left alone; this server's own files are kept within `budget` bytes,
    least recently used (file mtime) first out."""

    FORMAT = "glm-exact-prefix-snapshot-v1"

    def __init__(self, directory, budget_bytes: int, fingerprint: str, block: int):
        if budget_bytes <= 0:
            raise ValueError(f"--prefix-cache-disk-mb must be > 0, got {budget_bytes / (1 << 20)}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.budget, self.fingerprint, self.block = int(budget_bytes), fingerprint, int(block)
        self.files: dict[str, int] = {}   # name -> bytes, this server's files
        self.hits = self.writes = self.skipped = self.evictions = 0

    @staticmethod
    def name(tokens) -> str:
        return hashlib.sha256(np.asarray(tokens, "<i4").tobytes()).hexdigest()[:40] + ".safetensors"

    @staticmethod
    def _digest(arrays: dict) -> str:
        h = hashlib.sha256()
        for k in sorted(arrays):
            a = np.ascontiguousarray(arrays[k])
            h.update(f"{k}|{a.dtype.str}|{a.shape}|".encode())
            h.update(a.tobytes())
        return h.hexdigest()

    def _skip(self, name: str, why: str) -> None:
        self.skipped += 1
        log.warning("prefix cache: skipping %s: %s", self.dir / name, why)

    def scan(self):
        """-> [(tokens, name)] of this server's files, the directory then kept within the budget."""
        from safetensors import safe_open
        found = []
        for path in sorted(self.dir.glob("*.safetensors")):
            try:
                with safe_open(str(path), framework="np") as f:
                    meta = f.metadata() or {}
                    if meta.get("format") != self.FORMAT:
                        raise _Refused(f"not a prefix snapshot (format {meta.get('format')!r})")
                    if meta.get("fingerprint") != self.fingerprint:
                        raise _Refused(f"made by another server ({meta.get('fingerprint')!r}; this one is "
                                       f"{self.fingerprint!r})")
                    tokens = f.get_tensor("tokens")
            except _Refused as e:
                self._skip(path.name, str(e))
                continue
            except Exception as e:  # noqa: BLE001 - any unreadable file is skipped, never fatal
                self._skip(path.name, f"unreadable ({type(e).__name__}: {e})")
                continue
            if tokens.ndim != 1 or tokens.dtype != np.int32 or tokens.size == 0 or self.name(tokens) != path.name:
                self._skip(path.name, "its token ids do not match its name")
                continue
            if tokens.size % self.block:
                self._skip(path.name, f"a prefix of {tokens.size} tokens, not a multiple of --prefix-block {self.block}")
                continue
            self.files[path.name] = path.stat().st_size
            found.append((tuple(int(t) for t in tokens), path.name))
        gone = set(self.fit())
        return [(t, n) for t, n in found if n not in gone]

    def read(self, name: str) -> dict:
        """The state arrays of a file (checked against its digest and metadata) for Engine.import_cache."""
        from safetensors import safe_open
        with safe_open(str(self.dir / name), framework="np") as f:
            meta = f.metadata() or {}
            arrays = {k: f.get_tensor(k) for k in f.keys()}
        if meta.get("fingerprint") != self.fingerprint or meta.get("format") != self.FORMAT:
            raise _Refused("its metadata changed since the start")
        if self._digest(arrays) != meta.get("sha256"):
            raise _Refused("its arrays do not match their sha256 (a corrupt file)")
        tokens = arrays.pop("tokens")
        if self.name(tokens) != name or int(arrays["length"]) != tokens.size:
            raise _Refused("its token ids or length do not match its name")
        return arrays

    def write(self, tokens, cache) -> None:
        """The file of a snapshot `cache` of the prefix `tokens` (written once: a file of the same tokens
        holds the same bits; written to a temporary name, then renamed)."""
        from safetensors.numpy import save_file
        name = self.name(tokens)
        if name in self.files:
            self.touch(name)
            return
        arrays = cache.export()
        arrays["tokens"] = np.asarray(tokens, np.int32)
        meta = {"format": self.FORMAT, "fingerprint": self.fingerprint, "length": str(int(arrays["length"])),
                "block": str(self.block), "sha256": self._digest(arrays)}
        tmp = self.dir / f".{name}.{os.getpid()}.tmp"
        try:
            save_file(arrays, str(tmp), metadata=meta)
            os.replace(tmp, self.dir / name)
        finally:
            tmp.unlink(missing_ok=True)
        self.files[name] = (self.dir / name).stat().st_size
        self.writes += 1

    def touch(self, name: str) -> None:
        try:
            os.utime(self.dir / name)
        except OSError:
            pass

    def remove(self, name: str) -> None:
        self.files.pop(name, None)
        try:
            (self.dir / name).unlink()
        except OSError:
            pass

    def fit(self) -> list[str]:
        """Delete this server's least recently used files (oldest mtime) until they fit the budget ->
        the names deleted."""
        total, gone = sum(self.files.values()), []
        if total <= self.budget:
            return gone
        def mtime(n):
            try:
                return (self.dir / n).stat().st_mtime_ns
            except OSError:
                return 0
        for n in sorted(self.files, key=mtime):
            if total <= self.budget:
                break
            total -= self.files[n]
            self.remove(n)
            self.evictions += 1
            gone.append(n)
        return gone

    @property
    def bytes(self) -> int:
        return sum(self.files.values())


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
                raise _Refused(f"it holds {cache.length} positions, its prefix {node.depth}")
        except Exception as e:  # noqa: BLE001 - a bad file is skipped, never fatal
            self.disk._skip(name, str(e) if isinstance(e, _Refused) else f"{type(e).__name__}: {e}")
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
