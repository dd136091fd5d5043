"""Prometheus metrics of the serving engine, in their own ``CollectorRegistry`` (served at ``/metrics``).

Two families, both on by default:

``draftsmith:`` (prometheus_client appends ``_total`` to counters; the names below are what a scrape shows, vLLM's
``spec_decode`` names under the ``draftsmith:`` prefix, DESIGN.md §7), recorded when a request ends (aborted
requests are not counted here):

    draftsmith:spec_decode_num_drafts_total                      verify steps with >= 1 drafted token
    draftsmith:spec_decode_num_draft_tokens_total                drafted tokens
    draftsmith:spec_decode_num_accepted_tokens_total             accepted drafted tokens
    draftsmith:spec_decode_num_accepted_tokens_per_pos_total{position="i"}   drafts whose token i was accepted
    draftsmith:prompt_tokens_total, draftsmith:generation_tokens_total
    draftsmith:request_success_total{finished_reason="stop"|"length"|"abort"|"error"}   (abort: cancelled,
                                                 e.g. the client went away; error: the request failed)
    draftsmith:time_to_first_token_seconds      histogram: request arrival -> first token emitted (prefill)
    draftsmith:time_per_output_token_seconds    histogram: (latency - TTFT) / (tokens - 1), tokens > 1
    draftsmith:e2e_request_latency_seconds      histogram: request arrival -> last token
    draftsmith:num_requests_running             gauge: sequences in the running batch (vLLM's name)
    draftsmith:num_requests_waiting             gauge: requests queued, not yet running (prefilling included)

With ``"num_speculative_tokens": "auto"`` (``core.adaptive``), also:

    draftsmith:spec_decode_chosen_k             histogram: k chosen per request per verify step (0: a plain step)
    draftsmith:cost_model_verify_seconds{batch_size, tokens_per_row}    gauge: the measured cost model
    draftsmith:cost_model_draft_seconds{batch_size, num_speculative_tokens}

``vllm:`` (``VllmMetrics``): vLLM's own names, labels (``model_name``, ``engine="0"``), bucket boundaries and
observation points, copied from ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``), ``vllm/v1/metrics/
buckets.py``, ``vllm/v1/metrics/stats.py`` (``IterationStats``) and ``vllm/v1/spec_decode/metrics.py``, so that
vLLM's dashboards and alerts read a draftsmith server unchanged. Recorded as they happen: prompt tokens and TTFT
at a request's first token, generation tokens and one inter-token latency per emitted chunk (vLLM observes one
gap per engine step that gave the request tokens, however many tokens the step accepted), spec-decode counters
per verify step, and per finished request (``finished_reason`` stop / length / abort / error; every reason's
series exists at 0 from startup) its latency phases:

    queue     queued -> scheduled (first prefill chunk)      prefill   scheduled -> first token
    decode    first token -> last token                      inference scheduled -> last token
    e2e       arrival -> end

From a scrape: acceptance rate = accepted / draft tokens; acceptance length τ = 1 + accepted / drafts.
"""

from __future__ import annotations

from typing import Sequence

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
        model_name: the ``model_name`` label of the ``vllm:`` series (the served model name).
        max_model_len: tops the ``vllm:`` token-count histograms' buckets (vLLM's ``request_tokens`` family).
        speculative: whether the ``vllm:spec_decode_*`` series exist (vLLM creates them with a speculative config
            only; default: k > 0).
        vllm_names: also register the ``vllm:`` series (``VllmMetrics``; ``self.vllm``, None when False).
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(
        self,
        num_speculative_tokens: int = 0,
        registry: CollectorRegistry | None = None,
        *,
        model_name: str = "draftsmith",
        max_model_len: int = 2048,
        speculative: bool | None = None,
        vllm_names: bool = True,
    ):
        speculative = num_speculative_tokens > 0 if speculative is None else speculative
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
        for reason in ("stop", "length", "abort", "error"):  # every series exists before the first request
            self.request_success.labels(finished_reason=reason)
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
        self.vllm = (
            VllmMetrics(r, model_name, max_model_len, num_speculative_tokens, speculative) if vllm_names else None
        )
        self.chosen_k: Histogram | None = None  # adaptive speculation only (set_cost_model)

    def set_cost_model(self, cost, k_max: int, policy=None) -> None:
        """Expose adaptive speculation's measured ``core.adaptive.CostModel`` (gauges), with ``policy`` (a
        ``core.adaptive.AdaptivePolicy``) the costs it measures live outside the decode work, and create the
        histogram of chosen k (buckets 0..k_max)."""
        r = self.registry
        if policy is not None:
            live = Gauge(
                PREFIX + "adaptive_overhead_seconds",
                "Seconds adaptive speculation prices outside the decode work, measured live: between two steps "
                "(per step), emitting a row's chunk (per chunk) and each token (per token), a drafter's catch-up on "
                "the positions its plain steps left (per row and per position).",
                ["part"],
                registry=r,
            )
            live.labels(part="between_steps").set_function(lambda: policy.between_s)
            live.labels(part="emit_per_chunk").set_function(lambda: policy.emission.per_chunk)
            live.labels(part="emit_per_token").set_function(lambda: policy.emission.per_token)
            live.labels(part="catch_up_per_row").set_function(lambda: policy.catch_up.per_chunk)
            live.labels(part="catch_up_per_position").set_function(lambda: policy.catch_up.per_token)
        verify = Gauge(
            PREFIX + "cost_model_verify_seconds",
            "Measured seconds of one verify forward over batch_size rows of tokens_per_row tokens.",
            ["batch_size", "tokens_per_row"],
            registry=r,
        )
        draft = Gauge(
            PREFIX + "cost_model_draft_seconds",
            "Measured seconds in the drafter for num_speculative_tokens drafts in each of batch_size rows.",
            ["batch_size", "num_speculative_tokens"],
            registry=r,
        )
        for b, row_v, row_d in zip(cost.batch_sizes, cost.verify_s, cost.draft_s):
            for t, s in zip(cost.verify_tokens, row_v):
                verify.labels(batch_size=str(b), tokens_per_row=str(t)).set(s)
            for k, s in zip(cost.draft_ks, row_d):
                draft.labels(batch_size=str(b), num_speculative_tokens=str(k)).set(s)
        Gauge(
            PREFIX + "cost_model_start_seconds_per_position",
            "Measured seconds of a drafter start (a row's first draft) per context position it reads.",
            registry=r,
        ).set(cost.start_s_per_position)
        self.chosen_k = Histogram(
            PREFIX + "spec_decode_chosen_k",
            "k chosen by adaptive speculation per request per verify step (0: a plain step).",
            buckets=tuple(range(k_max + 1)),
            registry=r,
        )

    def record_choice(self, k: int) -> None:
        """One request's verify step drafted with a k chosen live (``set_cost_model`` first)."""
        if self.chosen_k is not None:
            self.chosen_k.observe(k)

    def set_queue(self, running: int, waiting: int, kv_cache_usage: float | None = None) -> None:
        """The scheduler's load after a step: rows running, requests waiting, the KV budget's used fraction."""
        self.requests_running.set(running)
        self.requests_waiting.set(waiting)
        if self.vllm is not None:
            self.vllm.set_queue(running, waiting, kv_cache_usage)

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

    def render(self, names: Sequence[str] = ()) -> bytes:
        """The Prometheus text exposition of ``self.registry``; with ``names``, of those samples only (the
        ``name[]`` query of prometheus_client's own handler, ``prometheus_client/exposition.py``, which vLLM's
        ``/metrics`` serves). A full render costs ~5-8 ms here (500-700 lines, mostly vLLM's histograms); a
        restricted one ~0.1 ms, which is what a poller that watches a few gauges should ask for."""
        registry = self.registry.restricted_registry(names) if names else self.registry
        return generate_latest(registry)


# vLLM's bucket families (vllm/v1/metrics/buckets.py), copied verbatim.
VLLM_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)  # fmt: skip
VLLM_TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
VLLM_REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
VLLM_FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vllm/v1/engine/__init__.py


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's ``request_tokens`` family, ``buckets.py``)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class VllmMetrics:
    """The ``vllm:`` series vLLM's ``PrometheusStatLogger`` exposes that have a meaning here (module docstring).

    Not exposed: prefix-cache, KV-connector, LoRA, preemption-by-reason and multimodal series (no such
    machinery). ``vllm:kv_cache_usage_perc`` is the fraction of the KV budget the scheduler plans for
    (max_num_seqs x max_model_len tokens) that the running rows' caches hold (no paged blocks here).
    ``vllm:num_preemptions_total`` stays 0 (rows are never preempted).

    Args:
        registry: where to register. model_name: the ``model_name`` label. max_model_len: tops the token-count
            buckets. num_speculative_tokens: positions of the per-position counter. speculative: whether the
            spec-decode series exist.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        max_model_len: int,
        num_speculative_tokens: int = 0,
        speculative: bool = False,
    ):
        r, labels = registry, ["model_name", "engine"]
        values = (model_name, "0")

        def one(kind, name, doc, **kw):
            return kind(name, doc, labels, registry=r, **kw).labels(*values)

        self.running = one(Gauge, "vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = one(Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage = one(
            Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage (of the planned budget)."
        )
        self.num_preemptions = one(Counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = one(Counter, "vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = one(Counter, "vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels + ["finished_reason"],
            registry=r,
        )
        self.request_success = {reason: success.labels(*values, reason) for reason in VLLM_FINISH_REASONS}
        tokens = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = one(
            Histogram, "vllm:request_prompt_tokens", "Number of prefill tokens processed.", buckets=tokens
        )
        self.request_generation_tokens = one(
            Histogram, "vllm:request_generation_tokens", "Number of generation tokens processed.", buckets=tokens
        )
        self.request_max_num_generation_tokens = one(
            Histogram,
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            buckets=tokens,
        )
        self.request_params_n = one(
            Histogram,
            "vllm:request_params_n",
            "Histogram of the n request parameter.",
            buckets=VLLM_REQUEST_PARAMS_N_BUCKETS,
        )
        self.request_params_max_tokens = one(
            Histogram,
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            buckets=tokens,
        )
        self.ttft = one(
            Histogram,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            buckets=VLLM_TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self.itl = one(
            Histogram,
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            buckets=VLLM_INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.tpot = one(
            Histogram,
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            buckets=VLLM_INTER_TOKEN_LATENCY_BUCKETS,
        )
        phases = {
            "e2e": ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
            "queue": ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
            "inference": (
                "vllm:request_inference_time_seconds",
                "Histogram of time spent in RUNNING phase for request.",
            ),
            "prefill": ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."),
            "decode": ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."),
        }
        self.phases = {
            key: one(Histogram, name, doc, buckets=VLLM_REQUEST_LATENCY_BUCKETS) for key, (name, doc) in phases.items()
        }
        self.speculative = speculative
        if speculative:
            self.num_drafts = one(Counter, "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
            self.num_draft_tokens = one(Counter, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
            self.num_accepted_tokens = one(
                Counter, "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
            )
            per_pos = Counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                labels + ["position"],
                registry=r,
            )
            self.accepted_per_pos = [per_pos.labels(*values, str(i)) for i in range(num_speculative_tokens)]

    def set_queue(self, running: int, waiting: int, kv_cache_usage: float | None) -> None:
        """Scheduler state after a step (vLLM ``SchedulerStats``)."""
        self.running.set(running)
        self.waiting.set(waiting)
        if kv_cache_usage is not None:
            self.kv_cache_usage.set(kv_cache_usage)

    def record_step(self, proposed: int, accepted: int) -> None:
        """One verify step of one request: a draft when ``proposed`` > 0 (``vllm/v1/spec_decode/metrics.py``,
        ``SpecDecodingStats.observe_draft``)."""
        if not self.speculative or proposed <= 0:
            return
        self.num_drafts.inc()
        self.num_draft_tokens.inc(proposed)
        self.num_accepted_tokens.inc(accepted)
        for counter in self.accepted_per_pos[:accepted]:
            counter.inc()

    def record_first_token(self, prompt_tokens: int, ttft_s: float) -> None:
        """A request's first token: its prompt was prefilled (``IterationStats.update_from_output``, prefilling)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.ttft.observe(ttft_s)

    def record_tokens(self, n: int, gap_s: float | None) -> None:
        """``n`` tokens emitted at once for one request; ``gap_s``: seconds since its previous chunk (None for the
        first chunk), one inter-token-latency observation per chunk as vLLM makes per engine step."""
        if n > 0:
            self.generation_tokens.inc(n)
        if gap_s is not None:
            self.itl.observe(gap_s)

    def record_finished(
        self,
        finished_reason: str,
        prompt_tokens: int,
        generation_tokens: int,
        max_tokens: int | None,
        e2e_s: float,
        queued_s: float,
        scheduled_s: float | None,
        first_token_s: float | None,
        last_token_s: float | None,
        end_s: float,
    ) -> None:
        """A finished request (``IterationStats.update_from_finished_request``; timestamps in the same clock).

        A phase the request never reached ends where it ended (an abort while queued: all queue time); counts and
        intervals as vLLM's: queue = scheduled - queued, prefill = first token - scheduled, decode = last token -
        first token, inference = last token - scheduled, time per output token = decode / (tokens - 1) (0 for one
        token).

        Raises:
            KeyError: an unknown finished_reason (``VLLM_FINISH_REASONS``).
        """
        scheduled = scheduled_s if scheduled_s is not None else end_s
        first = first_token_s if first_token_s is not None else end_s
        last = last_token_s if last_token_s is not None else first
        decode = max(0.0, last - first)
        self.request_success[finished_reason].inc()
        self.phases["e2e"].observe(e2e_s)
        self.phases["queue"].observe(max(0.0, scheduled - queued_s))
        self.phases["prefill"].observe(max(0.0, first - scheduled))
        self.phases["decode"].observe(decode)
        self.phases["inference"].observe(max(0.0, last - scheduled))
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        self.tpot.observe(decode / (generation_tokens - 1) if generation_tokens > 1 else 0.0)
        self.request_max_num_generation_tokens.observe(generation_tokens)
        self.request_params_n.observe(1)
        if max_tokens:
            self.request_params_max_tokens.observe(max_tokens)
