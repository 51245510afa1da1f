"""Prometheus metrics of `generate_many` / `stream_many` runs (optional: ``pip install "hf_paged[metrics]"``).

``hf_paged.metrics.start_http_server(port)`` publishes, for every run of the process from then on, counters
(steps, prompt tokens computed, generated tokens, prefix-hit pages, finished outputs by reason), a histogram of
the time to first token, and gauges of the last step of any run (queue length, running outputs, pages used,
cached and in the pool, tokens/s). The exporter is a `hf_paged.stats` observer: the run tells it of each step,
first token and finished output as they happen.
"""

from __future__ import annotations

try:
    import prometheus_client
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
except ImportError as missing:
    raise ImportError("hf_paged.metrics needs prometheus-client: pip install 'hf_paged[metrics]'") from missing

from . import stats as run_stats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class PrometheusExporter:
    """The metrics of every run, in ``registry`` (a new `CollectorRegistry` by default), while registered (from
    construction until `close`)."""

    def __init__(self, registry: CollectorRegistry | None = None, namespace: str = "hf_paged"):
        self.registry = CollectorRegistry() if registry is None else registry
        self.server = self.thread = None
        metric = dict(namespace=namespace, registry=self.registry)
        self.steps = Counter("steps", "Forward steps of continuous batching", **metric)
        self.prompt_tokens = Counter("prompt_tokens", "Prompt tokens computed (prefix hits are not)", **metric)
        self.generated_tokens = Counter("generated_tokens", "Tokens generated", **metric)
        self.prefix_hits = Counter("prefix_hit_pages", "Prompt pages shared from the cache, not computed", **metric)
        self.finished_outputs = Counter("finished_outputs", "Outputs finished, by reason", ["reason"], **metric)
        self.ttft = Histogram("time_to_first_token_seconds", "Seconds from a run's start to an output's first token",
                              buckets=TTFT_BUCKETS, **metric)
        self.queue = Gauge("queue_length", "Prompts waiting to start (last step of any run)", **metric)
        self.running = Gauge("running_outputs", "Outputs decoding or reading their prompt", **metric)
        self.pages_used = Gauge("pages_used", "Pages referenced by running outputs", **metric)
        self.pages_cached = Gauge("pages_cached", "Pages kept for prefix reuse", **metric)
        self.pages_total = Gauge("pages_total", "Pages in the pool", **metric)
        self.tokens_per_s = Gauge("tokens_per_second", "Generated tokens per second of the last run so far", **metric)
        run_stats.add_observer(self)

    # ------------------------------------------------------------ observer
    def step(self, stats: run_stats.GenerationStats, *, prompt_tokens: int, generated: int, prefix_hits: int) -> None:
        self.steps.inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(generated)
        self.prefix_hits.inc(prefix_hits)
        self.queue.set(stats.queue_length)
        self.running.set(stats.running)
        self.pages_used.set(stats.pages_used)
        self.pages_cached.set(stats.pages_cached)
        self.pages_total.set(stats.pages_total)
        self.tokens_per_s.set(stats.tokens_per_s)

    def first_token(self, stats: run_stats.GenerationStats, output: run_stats.OutputStats) -> None:
        self.ttft.observe(output.first_token_s)

    def finished(self, stats: run_stats.GenerationStats, output: run_stats.OutputStats) -> None:
        self.finished_outputs.labels(reason=output.finish_reason).inc()

    # ------------------------------------------------------------ serving
    @property
    def port(self) -> int | None:
        """The port the server listens on (None without a server)."""
        return None if self.server is None else self.server.server_port

    def close(self) -> None:
        """Stop hearing of runs, and stop the server if `start_http_server` started one."""
        run_stats.remove_observer(self)
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = self.thread = None


def start_http_server(port: int = 9400, addr: str = "0.0.0.0", registry: CollectorRegistry | None = None
                      ) -> PrometheusExporter:
    """Serve the metrics of every run from now on at ``http://addr:port/metrics`` (a daemon thread; ``port=0``
    takes a free port, see ``exporter.port``). Returns the exporter; ``close()`` it to stop."""
    exporter = PrometheusExporter(registry)
    try:
        exporter.server, exporter.thread = prometheus_client.start_http_server(port, addr, registry=exporter.registry)
    except BaseException:
        exporter.close()
        raise
    return exporter
