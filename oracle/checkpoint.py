"""Checkpoint loading: config.json + safetensors, lazily memory-mapped, validated up front.

    ckpt = open_checkpoint("golden/tiny-fp8")
    ckpt.config                      # oracle.config.Config
    ckpt.release_summary()           # {"release": "fp8", "tensors": {...}, "experts": {...}, ...}
    print(ckpt.summary_text())
    r = ckpt.raw("kda.q_proj", layer=0)          # RawTensor: stored bytes as numpy arrays
    w = ckpt.weight_f32("kda.q_proj", layer=0)   # float32, decoded exactly (cached)
    ckpt.tokenizer                   # tokenizers.Tokenizer or None

The safetensors headers are parsed here (not by the safetensors library) so that a truncated file, an
offset beyond the end of the file or a malformed header is a clear error naming the file and tensor,
never a crash or an opaque message later. Data are read through numpy memory maps (never pickle).

Every problem found at open is collected and reported at once in one `CheckpointError`: every missing
tensor by full key, every wrong shape/dtype (expected vs found), truncated files, NaN codes in FP8
weights (S.1111.111), 0xFF E8M0 scales, NaN/inf in BF16/F32 tensors. Keys that the model does not use
are not an error: they are listed in `ckpt.warnings`.

The release is resolved per tensor (see oracle/names.py for the kinds):
  bf16  : BF16 storage              -> RawTensor.data u16
  f32   : F32 storage               -> data f32
  fp8   : F8_E4M3 + X.weight_scale_inv F32 [ceil(out/128), ceil(in/128)] -> data u8, scale f32
  mxfp4 : U8 [out, in/2] + X.weight_scale U8 (E8M0) [out, in/32] (routed experts only) -> data u8, scale u8
"""

from __future__ import annotations

import glob
import json
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import names as N
from .config import Config

__all__ = ["CheckpointError", "RawTensor", "Checkpoint", "open_checkpoint", "SAFETENSORS_DTYPES"]


SHOWN_PER_KIND = 8   # problems of one kind spelled out before "and N more"


def _problem_kind(problem: str) -> str:
    """The problem with its names, shapes and counts blanked: problems of one kind share it."""
    k = re.sub(r"'[^']*'", "'_'", problem)
    k = re.sub(r"\[[^\]]*\]", "[_]", k)
    return re.sub(r"\b\d+\b", "N", k)


def name_list(names, limit: int = SHOWN_PER_KIND) -> str:
    """`a, b, c` or `a, b, ... and N more` (the first `limit` names)."""
    names = list(names)
    if len(names) <= limit + 1:
        return ", ".join(names)
    return ", ".join(names[:limit]) + f" and {len(names) - limit} more"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used.

    `problems` lists every problem found (one line each, names in full); `missing` every expected
    tensor key not found. The message (str) is a summary a person can read: problems are grouped by
    kind (the same text up to names, shapes and counts), the first SHOWN_PER_KIND of each kind are
    shown, then "and N more"; long name lists are cut the same way. The total count is always stated.
    """

    def __init__(self, path: str, problems: list[str], missing: list[str] | None = None,
                 short: dict[str, str] | None = None):
        self.path = path
        self.problems = list(problems)
        self.missing = list(missing or [])
        self._short = dict(short or {})          # full problem line -> its summarized form
        super().__init__(self.summary())

    def summary(self, per_kind: int = SHOWN_PER_KIND) -> str:
        n = len(self.problems)
        head = f"checkpoint {self.path}: {n} problem{'s' if n != 1 else ''}"
        kinds: dict[str, list[str]] = {}
        for p in self.problems:
            kinds.setdefault(_problem_kind(p), []).append(p)
        lines = []
        for group in kinds.values():
            shown = group if len(group) <= per_kind + 1 else group[:per_kind]
            lines += ["  - " + self._short.get(p, p) for p in shown]
            if len(shown) < len(group):
                lines.append(f"  ... and {len(group) - len(shown)} more like the {len(shown)} above")
        if len(kinds) > 1 and n > per_kind:
            lines.append(f"  ({n} problems of {len(kinds)} kinds in all)")
        return head + ":\n" + "\n".join(lines)

    def full_text(self) -> str:
        """Every problem, one a line, names in full."""
        n = len(self.problems)
        return (f"checkpoint {self.path}: {n} problem{'s' if n != 1 else ''}:\n"
                + "\n".join("  - " + p for p in self.problems))

    def to_json(self) -> dict:
        return {"checkpoint": self.path, "problems": self.problems, "missing": self.missing}


# safetensors dtype -> (numpy dtype, itemsize)
SAFETENSORS_DTYPES: dict[str, tuple[str, int]] = {
    "BOOL": ("|b1", 1),
    "U8": ("|u1", 1),
    "I8": ("|i1", 1),
    "F8_E4M3": ("|u1", 1),
    "F8_E5M2": ("|u1", 1),
    "F8_E8M0": ("|u1", 1),
    "U16": ("<u2", 2),
    "I16": ("<i2", 2),
    "F16": ("<f2", 2),
    "BF16": ("<u2", 2),  # raw bits
    "U32": ("<u4", 4),
    "I32": ("<i4", 4),
    "F32": ("<f4", 4),
    "U64": ("<u8", 8),
    "I64": ("<i8", 8),
    "F64": ("<f8", 8),
}

MAX_HEADER = 100 * 1024 * 1024
SCAN_CHUNK = 1 << 24  # elements per chunk when scanning values


@dataclass(frozen=True)
class _Info:
    name: str  # stored key
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset
    end: int


class _File:
    """One safetensors file: header parsed and checked against the file size; data memory-mapped lazily."""

    def __init__(self, path: str, rel: str):
        self.path = path
        self.rel = rel
        self.tensors: dict[str, _Info] = {}
        self.bad: dict[str, str] = {}  # stored key -> problem (tensor unusable)
        self.problems: list[str] = []  # file-level problems
        self.metadata: dict[str, str] = {}
        self._mm: np.memmap | None = None
        self.size = 0
        self._parse()

    def _parse(self) -> None:
        try:
            self.size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    self.problems.append(f"{self.rel}: {self.size} bytes, too short for a safetensors header")
                    return
                (n,) = struct.unpack("<Q", head)
                if n > self.size - 8:
                    self.problems.append(
                        f"{self.rel}: header length {n} exceeds the file size ({self.size} bytes): truncated or not a safetensors file"
                    )
                    return
                if n > MAX_HEADER:
                    self.problems.append(f"{self.rel}: implausible header length {n}")
                    return
                raw = f.read(n)
        except OSError as e:
            self.problems.append(f"{self.rel}: cannot read ({e})")
            return
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            self.problems.append(f"{self.rel}: header is not valid JSON ({e})")
            return
        if not isinstance(header, dict):
            self.problems.append(f"{self.rel}: header is not a JSON object")
            return
        data_start = 8 + n
        data_size = self.size - data_start
        cut: list[tuple[int, str, int]] = []
        for name, ent in header.items():
            if name == "__metadata__":
                if isinstance(ent, dict):
                    self.metadata = {str(k): str(v) for k, v in ent.items()}
                continue
            where = f"{self.rel}: tensor '{name}'"
            if not isinstance(ent, dict):
                self.bad[name] = f"{where}: header entry is not an object"
                continue
            dt, shape, offs = ent.get("dtype"), ent.get("shape"), ent.get("data_offsets")
            if dt not in SAFETENSORS_DTYPES:
                self.bad[name] = f"{where}: unknown dtype {dt!r}"
                continue
            if not (isinstance(shape, list) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
                self.bad[name] = f"{where}: malformed shape {shape!r}"
                continue
            if not (
                isinstance(offs, list)
                and len(offs) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
                and 0 <= offs[0] <= offs[1]
            ):
                self.bad[name] = f"{where}: malformed data_offsets {offs!r}"
                continue
            nbytes = int(np.prod(shape, dtype=np.int64)) * SAFETENSORS_DTYPES[dt][1] if shape else SAFETENSORS_DTYPES[dt][1]
            if offs[1] - offs[0] != nbytes:
                self.bad[name] = (
                    f"{where}: data_offsets {offs} span {offs[1] - offs[0]} bytes but {dt} {shape} needs {nbytes}"
                )
                continue
            if offs[1] > data_size:
                cut.append((offs[0], name, offs[1]))
                self.bad[name] = ""  # reported once, with the file
                continue
            self.tensors[name] = _Info(name, dt, tuple(shape), data_start + offs[0], data_start + offs[1])
        if cut:
            cut.sort()
            names = ", ".join(f"'{c[1]}'" for c in cut[:5]) + (f" (+{len(cut) - 5} more)" if len(cut) > 5 else "")
            self.problems.append(
                f"{self.rel}: truncated or corrupt: the header places tensor data up to byte "
                f"{data_start + max(c[2] for c in cut)} but the file has {self.size} bytes; "
                f"{len(cut)} tensor(s) lie beyond the end: {names}"
            )

    def array(self, info: _Info) -> np.ndarray:
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        npdt, isz = SAFETENSORS_DTYPES[info.dtype]
        count = (info.end - info.begin) // isz
        a = np.frombuffer(self._mm, dtype=np.dtype(npdt), count=count, offset=info.begin)
        return a.reshape(info.shape)

    def close(self) -> None:
        self._mm = None


@dataclass(frozen=True)
class RawTensor:
    """A tensor in its stored (release) format.

    release: "bf16" (data u16 bits), "f32" (data f32), "fp8" (data u8 E4M3 codes, scale f32 scale_inv
    [ceil(R/128), ceil(C/128)]), "mxfp4" (data u8 [R, C/2], low nibble = even column, scale u8 E8M0
    [R, C/32]). `shape` is the logical (decoded) shape. Arrays are read-only memory-mapped views.
    """

    key: str  # canonical key (no prefix)
    role: str
    layer: int | None
    expert: int | None
    release: str
    shape: tuple[int, ...]
    data: np.ndarray
    scale: np.ndarray | None
    file: str  # file the data come from (relative to the checkpoint dir)
    stored_key: str  # key as stored in the file
    scale_key: str | None = None

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + (self.scale.nbytes if self.scale is not None else 0))


@dataclass
class _Slot:
    entry: N.Entry
    release: str
    file: _File
    info: _Info
    index: tuple | None = None  # alias slice
    scale_file: _File | None = None
    scale_info: _Info | None = None
    alias: bool = False
    scanned: bool = False

    def data(self) -> np.ndarray:
        a = self.file.array(self.info)
        if self.index is not None:
            a = a[self.index]
        return a

    def scale(self) -> np.ndarray | None:
        if self.scale_info is None:
            return None
        return self.scale_file.array(self.scale_info)


def _numerics():
    """The oracle's format decoders (imported lazily; tests may substitute this function)."""
    from . import numerics

    return numerics


_KIND_EXPECT = {
    N.LINEAR: "BF16, F8_E4M3 (+ weight_scale_inv F32) or F32",
    N.F32: "F32 (or BF16)",
    N.BF16: "BF16 (or F32)",
}


def _fmt(dtype: str, shape) -> str:
    return f"{dtype} {list(shape)}"


# ---------------------------------------------------------------- value scans


def _scan(kind: str, a: np.ndarray) -> tuple[int, int, int]:
    """Scan a raw array chunk by chunk: (bad count, first flat index of a bad/inf value or -1, inf count).

    kind 'bf16' / 'f32': bad = NaN, inf counted apart; 'fp8': bad = E4M3 NaN code (S.1111.111);
    'e8m0': bad = 0xFF.
    """
    flat = a.reshape(-1)
    bad = inf = 0
    first = -1
    for s in range(0, flat.size, SCAN_CHUNK):
        c = flat[s : s + SCAN_CHUNK]
        if kind == "bf16":
            m = c & np.uint16(0x7FFF)
            nb, ni = m > 0x7F80, m == 0x7F80
        elif kind == "f32":
            m = c.view(np.uint32) & np.uint32(0x7FFFFFFF)
            nb, ni = m > 0x7F800000, m == 0x7F800000
        elif kind == "fp8":
            nb, ni = (c & np.uint8(0x7F)) == 0x7F, None
        elif kind == "e8m0":
            nb, ni = c == 0xFF, None
        else:
            raise AssertionError(kind)
        either = nb if ni is None else (nb | ni)
        if first < 0 and either.any():
            first = s + int(np.argmax(either))
        bad += int(np.count_nonzero(nb))
        inf += 0 if ni is None else int(np.count_nonzero(ni))
    return bad, first, inf


# ---------------------------------------------------------------- the checkpoint


class Checkpoint:
    """An opened, validated checkpoint. Use open_checkpoint()."""

    def __init__(self, path: str, *, verify: bool = True, allow_missing_lm_head: bool = False):
        self.path = os.path.abspath(os.fspath(path))
        self.verify = verify
        self.warnings: list[str] = []
        self.metadata: dict[str, dict[str, str]] = {}
        self._slots: dict[str, _Slot] = {}
        self._cache: dict[str, np.ndarray] = {}
        self._files: list[_File] = []
        self.tokenizer = None
        problems: list[str] = []

        if not os.path.isdir(self.path):
            raise CheckpointError(self.path, ["not a directory (a checkpoint is a directory with config.json and *.safetensors)"])
        cfg_path = os.path.join(self.path, "config.json")
        if not os.path.isfile(cfg_path):
            raise CheckpointError(self.path, ["config.json is missing"])
        self.config: Config = Config.from_json(cfg_path)  # ConfigError names the field
        cfg = self.config

        # ---- files
        index_path = os.path.join(self.path, "model.safetensors.index.json")
        weight_map: dict[str, str] | None = None
        if os.path.isfile(index_path):
            try:
                with open(index_path, "rb") as f:
                    idx = json.loads(f.read().decode("utf-8"))
                weight_map = idx.get("weight_map") if isinstance(idx, dict) else None
                if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                    problems.append("model.safetensors.index.json: no valid 'weight_map' object")
                    weight_map = None
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                problems.append(f"model.safetensors.index.json: cannot be read ({e})")
        names_on_disk = sorted(os.path.basename(p) for p in glob.glob(os.path.join(self.path, "*.safetensors")))
        listed = sorted(set(weight_map.values())) if weight_map else []
        for fn in listed:
            if fn not in names_on_disk:
                problems.append(f"{fn}: listed in model.safetensors.index.json but missing from the directory")
        if not names_on_disk:
            problems.append("no *.safetensors file in the directory")
        for fn in names_on_disk:
            if weight_map is not None and fn not in listed:
                self.warnings.append(f"{fn}: not listed in model.safetensors.index.json (read anyway)")
            fobj = _File(os.path.join(self.path, fn), fn)
            self._files.append(fobj)
            self.metadata[fn] = fobj.metadata
            problems.extend(fobj.problems)

        # ---- canonical map: canonical key -> (file, info); bad entries remembered
        stored: dict[str, tuple[_File, _Info]] = {}
        bad: dict[str, str] = {}
        self.prefixes: set[str] = set()
        ignored_nontext: list[str] = []
        for fobj in self._files:
            for sk in list(fobj.tensors) + list(fobj.bad):
                ck, pfx = N.strip_prefix(sk)
                if _non_text(sk, ck):
                    ignored_nontext.append(sk)
                    continue
                if ck in stored or ck in bad:
                    other = stored[ck][0].rel if ck in stored else "?"
                    problems.append(f"{fobj.rel}: tensor '{sk}' duplicates '{ck}' already found in {other}")
                    continue
                if sk in fobj.bad:
                    bad[ck] = fobj.bad[sk]
                else:
                    stored[ck] = (fobj, fobj.tensors[sk])
                if ck != "lm_head.weight" and (N.parse_key(ck) is not None or ck.endswith(("_scale_inv", "_scale"))):
                    self.prefixes.add(pfx)
        if weight_map is not None:
            present = {i.name: f.rel for f in self._files for i in f.tensors.values()}
            present.update({k: f.rel for f in self._files for k in f.bad})
            for k, fn in sorted(weight_map.items()):
                if fn in names_on_disk and present.get(k) != fn:
                    where = f"found in {present[k]}" if k in present else "not in any file"
                    problems.append(f"model.safetensors.index.json: maps '{k}' to {fn}, but it is {where}")
        if ignored_nontext:
            self.warnings.append(f"ignored {len(ignored_nontext)} non-text tensor(s) (vision/MTP), e.g. {ignored_nontext[0]!r}")

        # ---- resolve every expected tensor
        consumed: set[str] = set()
        missing: list[str] = []
        short: dict[str, str] = {}
        self.has_lm_head = cfg.has_lm_head
        for entry in N.expected(cfg):
            slot, probs, used = self._resolve(cfg, entry, stored, bad)
            consumed.update(used)
            probs = [p for p in probs if p]  # "" = already reported with its file
            if slot is None and not probs and not used:
                if entry.spec.role == "lm_head" and allow_missing_lm_head:
                    self.has_lm_head = False
                    self.warnings.append("lm_head.weight is absent (allowed): the model has no output head")
                    continue
                missing.append(entry.key)
                continue
            problems.extend(probs)
            if slot is not None:
                self._slots[entry.key] = slot
        if missing:
            unreadable = any(f.problems for f in self._files)
            what = "not found (the unreadable file(s) above may hold them)" if unreadable else "missing"
            line = f"{len(missing)} tensor(s) {what}: " + ", ".join(missing)
            short[line] = f"{len(missing)} tensor(s) {what}: " + name_list(missing)
            problems.append(line)

        for ck, (fobj, info) in stored.items():
            if ck not in consumed:
                self.warnings.append(f"{fobj.rel}: unexpected tensor '{info.name}' ({_fmt(info.dtype, info.shape)}) ignored")
        for ck, msg in bad.items():
            if ck not in consumed and msg:
                problems.append(msg)

        # ---- values
        if verify and not problems:
            for slot in self._slots.values():
                problems.extend(self._scan_slot(slot))

        # ---- tokenizer
        tok_path = os.path.join(self.path, "tokenizer.json")
        if os.path.isfile(tok_path):
            try:
                from tokenizers import Tokenizer

                self.tokenizer = Tokenizer.from_file(tok_path)
            except Exception as e:  # noqa: BLE001 - report any tokenizer failure as a load problem
                problems.append(f"tokenizer.json: cannot be loaded ({type(e).__name__}: {e})")

        if problems:
            self.close()
            raise CheckpointError(self.path, problems, missing=missing, short=short)

    # ------------------------------------------------------------ resolution
    def _resolve(self, cfg, entry: N.Entry, stored, bad) -> tuple[_Slot | None, list[str], list[str]]:
        key, t = entry.key, entry.spec
        if key in bad:
            return None, [bad[key]], [key]
        loc = stored.get(key)
        index = None
        alias_shape = None
        used = [key]
        if loc is None:
            for al in N.aliases(cfg, entry):
                if al.key in stored:
                    loc = stored[al.key]
                    index, alias_shape = al.index, al.stored_shape
                    used = [al.key]
                    break
                if al.key in bad:
                    return None, [bad[al.key]], [al.key]
            if loc is None:
                return None, [], []
        fobj, info = loc
        S = t.shape(cfg)
        where = f"{fobj.rel}: tensor '{info.name}'"
        dt = info.dtype
        if index is not None:  # alias of a fused/packed in-memory tensor: plain BF16/F32 only
            want = alias_shape if alias_shape is not None else S
            if dt not in ("BF16", "F32"):
                return None, [f"{where}: found {_fmt(dt, info.shape)}, expected BF16 or F32 {list(want)}"], used
            if info.shape != tuple(want):
                return None, [f"{where}: shape {list(info.shape)}, expected {list(want)}"], used
            return _Slot(entry, "bf16" if dt == "BF16" else "f32", fobj, info, index=index, alias=True), [], used
        alias = used[0] != key

        if dt in ("BF16", "F32"):
            if info.shape != S:
                return None, [f"{where}: shape {list(info.shape)} ({dt}), expected {list(S)}"], used
            return _Slot(entry, "bf16" if dt == "BF16" else "f32", fobj, info, alias=alias), [], used

        if dt == "F8_E4M3" and t.kind == N.LINEAR:
            probs = []
            if info.shape != S:
                probs.append(f"{where}: shape {list(info.shape)} (F8_E4M3), expected {list(S)}")
            sk = N.fp8_scale_key(used[0])
            used.append(sk)
            SS = N.fp8_scale_shape(S)
            if sk in bad:
                probs.append(bad[sk])
            elif sk not in stored:
                probs.append(
                    f"{where}: FP8 weight without its scale '{N.fp8_scale_key(info.name)}' (F32 {list(SS)}) (missing)"
                )
            else:
                sf, si = stored[sk]
                if si.dtype != "F32" or si.shape != SS:
                    probs.append(
                        f"{sf.rel}: tensor '{si.name}': found {_fmt(si.dtype, si.shape)}, expected F32 {list(SS)}"
                    )
            if probs:
                return None, probs, used
            sf, si = stored[sk]
            return _Slot(entry, "fp8", fobj, info, scale_file=sf, scale_info=si, alias=alias), [], used

        if dt == "U8" and t.kind == N.LINEAR:
            if not t.mxfp4_ok:
                return None, [
                    f"{where}: found {_fmt(dt, info.shape)} (MXFP4?), but MXFP4 is allowed only for routed experts; "
                    f"expected {_KIND_EXPECT[t.kind]} {list(S)}"
                ], used
            probs = []
            if S[1] % N.MXFP4_GROUP != 0:
                return None, [f"{where}: MXFP4 needs in-features divisible by 32, got {S[1]}"], used
            PS, SS = N.mxfp4_packed_shape(S), N.mxfp4_scale_shape(S)
            if info.shape != PS:
                probs.append(f"{where}: shape {list(info.shape)} (U8 MXFP4), expected {list(PS)} for logical {list(S)}")
            sk = N.mxfp4_scale_key(used[0])
            used.append(sk)
            if sk in bad:
                probs.append(bad[sk])
            elif sk not in stored:
                probs.append(
                    f"{where}: MXFP4 weight without its scale '{N.mxfp4_scale_key(info.name)}' (U8 E8M0 {list(SS)}) (missing)"
                )
            else:
                sf, si = stored[sk]
                if si.dtype not in ("U8", "F8_E8M0") or si.shape != SS:
                    probs.append(
                        f"{sf.rel}: tensor '{si.name}': found {_fmt(si.dtype, si.shape)}, expected U8 (E8M0) {list(SS)}"
                    )
            if probs:
                return None, probs, used
            sf, si = stored[sk]
            return _Slot(entry, "mxfp4", fobj, info, scale_file=sf, scale_info=si, alias=alias), [], used

        expect = _KIND_EXPECT[t.kind]
        if t.mxfp4_ok:
            expect = expect.replace(" or F32", ", U8 MXFP4 (+ weight_scale) or F32")
        return None, [f"{where}: found {_fmt(dt, info.shape)}, expected {expect} {list(S)}"], used

    def _scan_slot(self, slot: _Slot) -> list[str]:
        if slot.scanned:
            return []
        probs: list[str] = []
        where = f"{slot.file.rel}: tensor '{slot.info.name}'"
        data = slot.data()
        if slot.release in ("bf16", "f32"):
            nan, first, inf = _scan(slot.release, data)
            if nan or inf:
                what = " and ".join(x for x in (f"{nan} NaN" if nan else "", f"{inf} inf" if inf else "") if x)
                probs.append(f"{where} ({slot.release.upper()}): {what} value(s), first at flat index {first}")
        elif slot.release == "fp8":
            nan, first, _ = _scan("fp8", data)
            if nan:
                probs.append(f"{where} (F8_E4M3): {nan} NaN code(s) (0x7F/0xFF), first at flat index {first}")
            s = slot.scale()
            nan, first, inf = _scan("f32", s)
            if nan or inf:
                probs.append(
                    f"{slot.scale_file.rel}: tensor '{slot.scale_info.name}' (F32 scale_inv): "
                    f"{nan + inf} non-finite value(s), first at flat index {first}"
                )
        elif slot.release == "mxfp4":
            s = slot.scale()
            nan, first, _ = _scan("e8m0", s)
            if nan:
                probs.append(
                    f"{slot.scale_file.rel}: tensor '{slot.scale_info.name}' (E8M0 scale): {nan} NaN scale(s) (0xFF), "
                    f"first at flat index {first}"
                )
        if not probs:
            slot.scanned = True
        return probs

    # ------------------------------------------------------------ API
    def _slot(self, name: str, layer: int | None, expert: int | None) -> _Slot:
        cfg = self.config
        if name in ("lm_head", "lm_head.weight") and not cfg.has_lm_head:
            name = "embed"  # tied head
        entry = N.resolve(cfg, name, layer, expert)
        slot = self._slots.get(entry.key)
        if slot is None:
            raise KeyError(f"{entry.key} is not in this checkpoint")
        if not slot.scanned:  # opened with verify=False: check values on first use
            probs = self._scan_slot(slot)
            if probs:
                raise CheckpointError(self.path, probs)
        return slot

    def raw(self, name: str, layer: int | None = None, expert: int | None = None) -> RawTensor:
        """The stored arrays of one tensor. `name`: role ('kda.q_proj'), template or canonical key."""
        s = self._slot(name, layer, expert)
        e = s.entry
        return RawTensor(
            key=e.key,
            role=e.spec.role,
            layer=e.layer,
            expert=e.expert,
            release=s.release,
            shape=e.spec.shape(self.config),
            data=s.data(),
            scale=s.scale(),
            file=s.file.rel,
            stored_key=s.info.name,
            scale_key=s.scale_info.name if s.scale_info is not None else None,
        )

    def weight_f32(self, name: str, layer: int | None = None, expert: int | None = None) -> np.ndarray:
        """The tensor decoded exactly to float32 (read-only array, cached per tensor)."""
        s = self._slot(name, layer, expert)
        key = s.entry.key
        w = self._cache.get(key)
        if w is None:
            w = decode(self.raw(name, layer, expert))
            w.setflags(write=False)
            self._cache[key] = w
        return w

    def release_of(self, name: str, layer: int | None = None, expert: int | None = None) -> str:
        return self._slot(name, layer, expert).release

    def has(self, name: str, layer: int | None = None, expert: int | None = None) -> bool:
        try:
            self._slot(name, layer, expert)
            return True
        except KeyError:
            return False

    def keys(self) -> list[str]:
        """Canonical keys of every tensor the model uses, in name-table order."""
        return list(self._slots)

    def clear_cache(self) -> None:
        self._cache.clear()

    def release_summary(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        linear: dict[str, int] = {}
        experts: dict[str, set[int]] = {}
        nbytes = 0
        aliases = 0
        for slot in self._slots.values():
            r = slot.release
            counts[r] = counts.get(r, 0) + 1
            if slot.entry.spec.kind == N.LINEAR:
                linear[r] = linear.get(r, 0) + 1
            if slot.entry.spec.per_expert:
                experts.setdefault(r, set()).add(slot.entry.layer)
            nbytes += slot.info.end - slot.info.begin if slot.index is None else 0
            if slot.scale_info is not None:
                nbytes += slot.scale_info.end - slot.scale_info.begin
            aliases += slot.alias
        quant = [q for q in ("fp8", "mxfp4") if linear.get(q)]
        if quant:
            release = "+".join(quant)
        elif set(linear) == {"bf16"}:
            release = "bf16"
        elif set(linear) == {"f32"}:
            release = "f32"
        else:
            release = "mixed(" + "+".join(sorted(linear)) + ")"
        return {
            "release": release,
            "tensors": dict(sorted(counts.items())),
            "linear": dict(sorted(linear.items())),
            "experts": {k: sorted(v) for k, v in sorted(experts.items())},
            "files": [f.rel for f in self._files],
            "prefixes": sorted(self.prefixes),
            "bytes": nbytes,
            "aliases_used": aliases,
            "has_lm_head": self.has_lm_head,
            "tied_embeddings": self.config.tie_word_embeddings,
            "tokenizer": self.tokenizer is not None,
            "warnings": len(self.warnings),
        }

    def summary_text(self) -> str:
        s = self.release_summary()
        c = self.config
        lines = [
            f"checkpoint  {self.path}",
            f"release     {s['release']}   ({len(self._slots)} tensors, {s['bytes'] / 2**20:.1f} MiB in "
            f"{len(s['files'])} file(s); prefix {', '.join(repr(p) for p in s['prefixes']) or 'none'})",
            "tensors     " + ", ".join(f"{k}: {v}" for k, v in s["tensors"].items()),
            "linear      " + ", ".join(f"{k}: {v}" for k, v in s["linear"].items()),
        ]
        if s["experts"]:
            lines.append(
                "experts     " + "; ".join(f"{k} in layers {','.join(map(str, v))}" for k, v in s["experts"].items())
            )
        lines.append(
            f"model       {c.num_hidden_layers} layers (KDA {list(c.kda_layers)}, MLA {list(c.mla_layers)}, "
            f"MoE {list(c.moe_layers)}), D={c.hidden_size}, V={c.vocab_size}, "
            f"{c.n_routed_experts} experts top {c.num_experts_per_tok}"
        )
        head = "tied to embed_tokens" if c.tie_word_embeddings else ("lm_head" if self.has_lm_head else "absent")
        lines.append(f"head        {head}; tokenizer {'yes' if self.tokenizer is not None else 'no'}")
        if self.warnings:
            lines.append(f"warnings    {len(self.warnings)}: " + self.warnings[0] + (" ..." if len(self.warnings) > 1 else ""))
        return "\n".join(lines)

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._cache.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Checkpoint {self.path} release={self.release_summary()['release']}>"


def _non_text(stored_key: str, canonical: str) -> bool:
    """Keys of the multimodal model's other parts or of the MTP layer: not ours, not an error."""
    if canonical.startswith(("visual.", "vision_tower.", "vision_model.", "multi_modal_projector.", "mtp.")):
        return True
    if stored_key.startswith(("model.visual.", "visual.", "model.vision")):
        return True
    return ".shared_head." in canonical


def decode(raw: RawTensor) -> np.ndarray:
    """RawTensor -> float32 array of raw.shape, exact (uses oracle.numerics)."""
    if raw.release == "f32":
        return np.array(raw.data, dtype=np.float32, copy=True).reshape(raw.shape)
    nx = _numerics()
    if raw.release == "bf16":
        u = np.ascontiguousarray(raw.data)
        u = u.reshape(1, -1) if u.ndim == 1 else u.reshape(u.shape[0], -1)  # the decoder takes a matrix
        w = np.asarray(nx.decode_bf16_weight(u), dtype=np.float32)
    elif raw.release == "fp8":
        w = np.asarray(
            nx.decode_fp8_weight(np.ascontiguousarray(raw.data), np.ascontiguousarray(raw.scale)), dtype=np.float32
        )
    elif raw.release == "mxfp4":
        w = np.asarray(
            nx.decode_mxfp4_weight(np.ascontiguousarray(raw.data), np.ascontiguousarray(raw.scale)), dtype=np.float32
        )
    else:
        raise AssertionError(raw.release)
    return w.reshape(raw.shape)


def open_checkpoint(path: str | os.PathLike, *, verify: bool = True, allow_missing_lm_head: bool = False) -> Checkpoint:
    """Open and validate a checkpoint directory.

    verify=True scans every value at open (NaN/inf, FP8 NaN codes, 0xFF E8M0 scales); with
    verify=False the scan happens per tensor on first raw()/weight_f32() access instead.
    allow_missing_lm_head=True accepts a checkpoint without lm_head.weight (e.g. a save of the peer's
    Glm5NextTextModel, which has no head); then `has_lm_head` is False.
    Raises ConfigError for a bad config.json field and CheckpointError for everything else.
    """
    return Checkpoint(os.fspath(path), verify=verify, allow_missing_lm_head=allow_missing_lm_head)
