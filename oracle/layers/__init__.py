"""The oracle's modules, one file each: mhc, norm, kda, mla, indexer, moe, head (+ ops: precision rules)."""
