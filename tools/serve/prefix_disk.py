"""The prefix cache's disk tier (`oracle serve --prefix-cache-dir`): snapshots as safetensors files that
survive a restart (docs/serve.md, "Prefix cache", the disk tier). prefix.py's trie decides what is
written and read; this module owns the files: names, metadata, checks and the disk budget.
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import numpy as np

log = logging.getLogger("glm.serve.prefix")


class Refused(Exception):
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
                        raise Refused(f"not a prefix snapshot (format {meta.get('format')!r})")
                    if meta.get("fingerprint") != self.fingerprint:
                        raise Refused(f"made by another server ({meta.get('fingerprint')!r}; this one is "
                                       f"{self.fingerprint!r})")
                    tokens = f.get_tensor("tokens")
            except Refused as e:
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
            raise Refused("its metadata changed since the start")
        if self._digest(arrays) != meta.get("sha256"):
            raise Refused("its arrays do not match their sha256 (a corrupt file)")
        tokens = arrays.pop("tokens")
        if self.name(tokens) != name or int(arrays["length"]) != tokens.size:
            raise Refused("its token ids or length do not match its name")
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
