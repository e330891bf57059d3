"""GET /metrics: the server's counters in the Prometheus text format (version 0.0.4), written by hand
(no client library: a handful of counters, gauges and two histograms)."""
from __future__ import annotations

import threading
from collections import defaultdict

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _Histogram:
    def __init__(self, buckets):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out += [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]
        return out


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests = defaultdict(int)        # (endpoint, status code) -> count
        self.finished_by = defaultdict(int)     # finish reason -> count
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.steps = 0
        self.step_rows = 0
        self.step_time = _Histogram(_STEP_BUCKETS)
        self.ttft = _Histogram(_TTFT_BUCKETS)
        self.last_batch = 0
        self.peak_batch = 0
        self.mixed_steps = 0
        self.prefix_enabled = False
        self.prefix_lookups = 0          # requests that looked their prompt up
        self.prefix_hits = 0             # ... and resumed from a snapshot
        self.prefix_saved_tokens = 0     # prompt tokens not prefilled thanks to it
        self.prefix_looked_tokens = 0    # prompt tokens of the lookups
        self.prefix_budget = self.prefix_bytes = self.prefix_entries = 0
        self.prefix_snapshots = self.prefix_evictions = 0
        self.prefix_disk = None          # the disk tier's counts (--prefix-cache-dir), None when off
        self.spec_enabled = False
        self.spec_verifies = 0           # a sequence's decode steps under speculation that emitted tokens
        self.spec_drafted = 0            # draft tokens verified
        self.spec_accepted = 0           # ... and accepted

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def step(self, seconds: float, sequences: int, rows: int, mixed: bool = False) -> None:
        with self._lock:
            self.steps += 1
            self.mixed_steps += int(mixed)
            self.peak_batch = max(self.peak_batch, sequences)
            self.step_rows += rows
            self.last_batch = sequences
            self.step_time.observe(seconds)

    def token(self, first: bool, since_submit: float) -> None:
        with self._lock:
            self.generated_tokens += 1
            if first:
                self.ttft.observe(since_submit)

    def finished(self, reason: str, generated: int, prompt: int) -> None:
        with self._lock:
            self.finished_by[reason] += 1
            self.prompt_tokens += prompt

    def prefix_lookup(self, saved: int, prompt: int) -> None:
        with self._lock:
            self.prefix_lookups += 1
            self.prefix_hits += int(saved > 0)
            self.prefix_saved_tokens += saved
            self.prefix_looked_tokens += prompt

    def prefix_state(self, budget: int, held: int, entries: int, snapshots: int, evictions: int) -> None:
        with self._lock:
            self.prefix_enabled = True
            self.prefix_budget, self.prefix_bytes, self.prefix_entries = budget, held, entries
            self.prefix_snapshots, self.prefix_evictions = snapshots, evictions

    def prefix_disk_state(self, **counts: int) -> None:
        with self._lock:
            self.prefix_disk = dict(counts)

    def speculation(self, drafted: int, accepted: int) -> None:
        with self._lock:
            self.spec_enabled = True
            self.spec_verifies += 1
            self.spec_drafted += drafted
            self.spec_accepted += accepted

    def render(self, active: int, waiting: int) -> str:
        with self._lock:
            L = []

            def metric(name, kind, help_, values):
                L.append(f"# HELP {name} {help_}")
                L.append(f"# TYPE {name} {kind}")
                L.extend(values)

            metric("glm_requests_total", "counter", "HTTP requests by endpoint and status code.",
                   [f'glm_requests_total{{endpoint="{e}",code="{c}"}} {n}'
                    for (e, c), n in sorted(self.requests.items())])
            metric("glm_sequences_finished_total", "counter", "Sequences that left the batch, by reason.",
                   [f'glm_sequences_finished_total{{reason="{r}"}} {n}' for r, n in sorted(self.finished_by.items())])
            metric("glm_prompt_tokens_total", "counter", "Prompt tokens of finished sequences.",
                   [f"glm_prompt_tokens_total {self.prompt_tokens}"])
            metric("glm_generation_tokens_total", "counter", "Tokens generated.",
                   [f"glm_generation_tokens_total {self.generated_tokens}"])
            metric("glm_engine_steps_total", "counter", "Engine steps (one engine call each).",
                   [f"glm_engine_steps_total {self.steps}"])
            metric("glm_engine_step_rows_total", "counter", "Token rows over all engine steps.",
                   [f"glm_engine_step_rows_total {self.step_rows}"])
            metric("glm_engine_mixed_steps_total", "counter", "Steps with prompt chunks and decodes together.",
                   [f"glm_engine_mixed_steps_total {self.mixed_steps}"])
            metric("glm_sequences_active", "gauge", "Sequences in the running batch.",
                   [f"glm_sequences_active {active}"])
            metric("glm_sequences_waiting", "gauge", "Requests admitted and waiting for a batch slot.",
                   [f"glm_sequences_waiting {waiting}"])
            metric("glm_last_step_batch_size", "gauge", "Sequences in the last engine step.",
                   [f"glm_last_step_batch_size {self.last_batch}"])
            metric("glm_peak_step_batch_size", "gauge", "Most sequences in one engine step so far.",
                   [f"glm_peak_step_batch_size {self.peak_batch}"])
            metric("glm_engine_step_seconds", "histogram", "Wall time of one engine step.",
                   self.step_time.lines("glm_engine_step_seconds"))
            metric("glm_time_to_first_token_seconds", "histogram", "From admission to the first token.",
                   self.ttft.lines("glm_time_to_first_token_seconds"))
            if self.prefix_enabled:
                for name, kind, help_, v in (
                    ("glm_prefix_cache_lookups_total", "counter", "Requests that looked their prompt up in the prefix cache.", self.prefix_lookups),
                    ("glm_prefix_cache_hits_total", "counter", "Requests that resumed from a cached snapshot.", self.prefix_hits),
                    ("glm_prefix_cache_saved_tokens_total", "counter", "Prompt tokens restored from snapshots instead of prefilled.", self.prefix_saved_tokens),
                    ("glm_prefix_cache_lookup_tokens_total", "counter", "Prompt tokens of the requests that looked up.", self.prefix_looked_tokens),
                    ("glm_prefix_cache_snapshots_total", "counter", "Snapshots taken.", self.prefix_snapshots),
                    ("glm_prefix_cache_evictions_total", "counter", "Snapshots dropped to stay within the budget.", self.prefix_evictions),
                    ("glm_prefix_cache_entries", "gauge", "Snapshots held.", self.prefix_entries),
                    ("glm_prefix_cache_bytes", "gauge", "Bytes of the snapshots held.", self.prefix_bytes),
                    ("glm_prefix_cache_budget_bytes", "gauge", "The prefix cache's budget (--prefix-cache-mb).", self.prefix_budget),
                ):
                    metric(name, kind, help_, [f"{name} {v}"])
            if self.prefix_disk is not None:
                for key, kind, help_ in _DISK_METRICS:
                    name = f"glm_prefix_cache_disk_{key}" + ("_total" if kind == "counter" else "")
                    metric(name, kind, help_, [f"{name} {self.prefix_disk[key]}"])
            if self.spec_enabled:
                for name, help_, v in (
                    ("glm_spec_verify_steps_total", "Decode steps of a sequence under speculation (--speculate).", self.spec_verifies),
                    ("glm_spec_draft_tokens_total", "Draft tokens verified.", self.spec_drafted),
                    ("glm_spec_accepted_tokens_total", "Draft tokens accepted (equal to the token chosen at their position).", self.spec_accepted),
                ):
                    metric(name, "counter", help_, [f"{name} {v}"])
            return "\n".join(L) + "\n"


# the disk tier's metrics (tools/serve/prefix.py, DiskTier): glm_prefix_cache_disk_<key>[_total]
_DISK_METRICS = (
    ("hits", "counter", "Requests that resumed from a snapshot read from --prefix-cache-dir."),
    ("writes", "counter", "Snapshot files written."),
    ("skipped", "counter", "Files skipped: corrupt, of another server (fingerprint) or block size."),
    ("evictions", "counter", "Snapshot files deleted to stay within --prefix-cache-disk-mb."),
    ("files", "gauge", "Snapshot files of this server in the directory."),
    ("bytes", "gauge", "Bytes of those files."),
    ("budget_bytes", "gauge", "The disk tier's budget (--prefix-cache-disk-mb)."),
)
