"""Decode tokens/s with and without speculative decoding, one process (docs/perf.md, "Speculative decoding").

    python -m tools.bench_speculate --checkpoint golden/tiny-fp8 [--device cpu|cuda] [--threads 1]
                                    [--k 2,4,8] [--new 128] [--repeats 5] [--drafter DIR]

The prompt is repetitive (a 12-token unit, 6 times). Each configuration is warmed once and then
timed --repeats times, interleaved (off, ngram:K, ..., off, ngram:K, ...); the table gives the median
tokens/s of the whole greedy generate (prompt included), the acceptance (accepted / drafted) and
whether the tokens equal the run without speculation. `replay:K` is a drafter that proposes the
answer itself (every draft right, no drafting cost): the ceiling of verification on this engine.
"""
from __future__ import annotations

import argparse
import statistics
import time


class Replay:
    """Proposes the known answer: every draft is right (the ceiling of speculation)."""

    def __init__(self, k, prompt, answer):
        self.k, self.p, self.answer = k, len(prompt), answer

    def __str__(self):
        return f"replay:{self.k}"

    def start(self):
        return None

    def draft(self, items):
        return [self.answer[len(h) - self.p:len(h) - self.p + k] for _, h, k in items]

    def settle(self, state, history):
        pass

    def release(self, state):
        pass


def main(argv=None) -> int:
    import fast
    from fast.speculate import open_drafter
    p = argparse.ArgumentParser(prog="python -m tools.bench_speculate", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--k", default="2,4,8")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--drafter", default=None, help="a drafter checkpoint (model:DIR:K) besides ngram:K")
    a = p.parse_args(argv)
    eng = fast.Engine(a.checkpoint, device=a.device, threads=a.threads)
    V = eng.config.vocab_size
    prompt = [(97 * i + 13) % V for i in range(12)] * 6
    ref = eng.generate(prompt, a.new)
    ks = [int(k) for k in a.k.split(",")]
    configs = [("off", None)] + [(f"ngram:{k}", f"ngram:{k}") for k in ks]
    configs += [(f"replay:{k}", Replay(k, prompt, ref)) for k in ks]
    if a.drafter:
        configs += [(f"model:{a.drafter}:{k}", open_drafter(f"model:{a.drafter}:{k}", eng)) for k in ks]
    times = {name: [] for name, _ in configs}
    stats, same = {}, {}
    for rep in range(a.repeats + 1):                      # round 0 warms every configuration
        for name, spec in configs:
            t0 = time.perf_counter()
            out = eng.generate(prompt, a.new, speculate=spec)
            dt = time.perf_counter() - t0
            if rep:
                times[name].append(dt)
            same[name] = out == ref
            stats[name] = eng.speculation if spec is not None else None
    base = statistics.median(times["off"])
    print(f"{a.checkpoint}, {a.device}, threads={a.threads}, prompt {len(prompt)} (repetitive), {a.new} new tokens, "
          f"median of {a.repeats}")
    print("| drafter | tok/s | vs off | acceptance | steps per token | same tokens |")
    print("|---|---|---|---|---|---|")
    for name, _ in configs:
        med = statistics.median(times[name])
        st = stats[name]
        acc = "" if st is None else f"{st.accepted}/{st.drafted} = {st.acceptance:.2f}"
        steps = "1.00" if st is None else f"{st.verifies / st.emitted:.2f}"
        print(f"| {name} | {a.new / med:.0f} | {base / med:.2f} | {acc} | {steps} | {'yes' if same[name] else 'NO'} |")
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
