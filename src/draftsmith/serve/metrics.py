"""Prometheus metrics of the serving engine, in their own ``CollectorRegistry`` (served at ``/metrics``).

Exposed names (prometheus_client appends ``_total`` to counters; the names below are what a scrape
shows, vLLM's ``spec_decode`` names under the ``draftsmith:`` prefix, DESIGN.md §7):

    draftsmith:spec_decode_num_drafts_total                      verify steps with >= 1 drafted token
    draftsmith:spec_decode_num_draft_tokens_total                drafted tokens
    draftsmith:spec_decode_num_accepted_tokens_total             accepted drafted tokens
    draftsmith:spec_decode_num_accepted_tokens_per_pos_total{position="i"}   drafts whose token i was accepted
    draftsmith:prompt_tokens_total, draftsmith:generation_tokens_total
    draftsmith:request_success_total{finished_reason="stop"|"length"}
    draftsmith:time_to_first_token_seconds      histogram: request arrival -> first token emitted (prefill)
    draftsmith:time_per_output_token_seconds    histogram: (latency - TTFT) / (tokens - 1), tokens > 1
    draftsmith:e2e_request_latency_seconds      histogram: request arrival -> last token
    draftsmith:num_requests_running             gauge: sequences in the running batch (vLLM's name)
    draftsmith:num_requests_waiting             gauge: requests queued, not yet running (prefilling included)

From a scrape: acceptance rate = accepted / draft tokens; acceptance length τ = 1 + accepted / drafts.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from draftsmith.core.generate import SpecStats

PREFIX = "draftsmith:"
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
LATENCY_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
)


class EngineMetrics:
    """The engine's counters and histograms, registered in ``self.registry`` (never the global one).

    Args:
        num_speculative_tokens: k; the per-position counter is created at 0 for positions 0..k-1 so a
            scrape shows every position before the first request.
        registry: where to register (a fresh ``CollectorRegistry`` by default).
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, num_speculative_tokens: int = 0, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.num_drafts = Counter(
            PREFIX + "spec_decode_num_drafts", "Verify steps with at least one drafted token.", registry=r
        )
        self.num_draft_tokens = Counter(PREFIX + "spec_decode_num_draft_tokens", "Drafted tokens proposed.", registry=r)
        self.num_accepted_tokens = Counter(
            PREFIX + "spec_decode_num_accepted_tokens", "Drafted tokens accepted by verification.", registry=r
        )
        self.accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this 0-based position was accepted.",
            ["position"],
            registry=r,
        )
        for position in range(num_speculative_tokens):
            self.accepted_per_pos.labels(position=str(position))
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens of finished requests.", registry=r
        )
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Request arrival to first emitted token (queue wait + prefill).",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "(latency - TTFT) / (tokens - 1) of requests with more than one token.",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Request arrival to last token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

        self.requests_running = Gauge(PREFIX + "num_requests_running", "Sequences in the running batch.", registry=r)
        self.requests_waiting = Gauge(
            PREFIX + "num_requests_waiting", "Requests waiting to run (queued or being prefilled).", registry=r
        )

    def set_queue(self, running: int, waiting: int) -> None:
        """The scheduler's load after a step: rows running, requests waiting."""
        self.requests_running.set(running)
        self.requests_waiting.set(waiting)

    def record_spec(self, stats: SpecStats) -> None:
        """Add one sequence's speculation counters."""
        self.num_drafts.inc(stats.num_drafts)
        self.num_draft_tokens.inc(stats.num_draft_tokens)
        self.num_accepted_tokens.inc(stats.num_accepted_tokens)
        for position, count in enumerate(stats.accepted_per_pos):
            self.accepted_per_pos.labels(position=str(position)).inc(count)

    def record_request(
        self, prompt_tokens: int, completion_tokens: int, finish_reason: str, ttft_s: float | None, latency_s: float
    ) -> None:
        """Add one finished request: token counts, finish reason, TTFT / TPOT / latency."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.request_success.labels(finished_reason=finish_reason).inc()
        self.latency.observe(latency_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if completion_tokens > 1:
                self.tpot.observe((latency_s - ttft_s) / (completion_tokens - 1))

    def render(self) -> bytes:
        """The Prometheus text exposition of ``self.registry``."""
        return generate_latest(self.registry)
