"""Prompts as the tools take them: --ids, --prompt (tokenized by the checkpoint's tokenizer), or the
canonical `long` prompt of the golden set; and how many new tokens."""
from __future__ import annotations

from pathlib import Path

from .golden import canonical_prompts


def load_tokenizer(checkpoint):
    """The checkpoint's tokenizer.json as a `tokenizers.Tokenizer`, or None."""
    path = Path(checkpoint) / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(path))


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"--ids must be comma-separated integers, got {text!r}") from None


DEFAULT_NEW = 8      # --max-new of run, diff and trace (the canonical prompts' new tokens too)
MIN_NEW = 1          # a run generates at least one token: 0 would hash the prompt's logits only


def max_new(text: str) -> int:
    """argparse type of --max-new: an integer >= MIN_NEW (one rule for every command)."""
    import argparse
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= {MIN_NEW}, got {text!r}") from None
    if n < MIN_NEW:
        raise argparse.ArgumentTypeError(f"must be >= {MIN_NEW} (the number of tokens to generate), got {n}")
    return n


def prompt_ids(args, side) -> tuple[list[int], int]:
    """--ids / --prompt (tokenized by the checkpoint's tokenizer) / the canonical `long` prompt."""
    n = args.max_new
    if args.ids is not None and args.prompt is not None:
        raise ValueError("give --ids or --prompt, not both")
    if args.ids is not None:
        ids = parse_ids(args.ids)
        if not ids:
            raise ValueError("--ids is empty")
    elif args.prompt is not None:
        from oracle.checkpoint import open_checkpoint
        tok = getattr(open_checkpoint(args.checkpoint), "tokenizer", None)
        if tok is None:
            raise ValueError(f"{args.checkpoint} has no tokenizer.json: use --ids")
        ids = tok.encode(args.prompt).ids
    else:
        ids, default_n = canonical_prompts(side.config.vocab_size)["long"]
        n = default_n if n is None else n
    if n is None:
        n = DEFAULT_NEW
    if n < MIN_NEW:
        raise ValueError(f"--max-new must be >= {MIN_NEW}, got {n}")
    V = side.config.vocab_size
    bad = [t for t in ids if not 0 <= t < V]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {V})")
    return ids, n
