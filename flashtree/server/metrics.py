"""Prometheus metrics for one server app.

Each app gets its own CollectorRegistry, so tests (and embedders) can build several apps
in one process without "duplicated timeseries" errors from the global registry. Updates
come from the engine thread and the HTTP handlers; prometheus_client is thread-safe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

ACCEPT_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 64)
DRAFTED_BUCKETS = (0, 0.5, 1, 1.5, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64)  # drafted tokens accepted
NODE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
CHOICES = ("ar", "chain", "tree")
ROUND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# "stop"/"length"/"abort" are engine finish reasons; the rest are the server's refusals.
STATUSES = ("stop", "length", "abort", "error", "invalid", "rejected")


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("flashtree_requests", "Finished or refused requests by outcome "
                                "(stop, length, abort = client left, error, invalid = 4xx, rejected = 429)",
                                ["status"], registry=r)
        for status in STATUSES:
            self.requests.labels(status)  # export zeros, so dashboards and tests see every series
        self.prompt_tokens = Counter("flashtree_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("flashtree_generation_tokens", "Tokens generated", registry=r)
        self.accept_length = Histogram("flashtree_accept_length", "Tokens committed per request and round "
                                       "(bonus included; 1 = no draft token accepted)", buckets=ACCEPT_BUCKETS,
                                       registry=r)
        # The speculation policy, per request and round: what it chose, how much it expected the
        # target to accept of the draft, and what the target accepted (speculating rounds only).
        self.policy_rounds = Counter("flashtree_policy_rounds", "Request-rounds by the policy's choice: ar (no "
                                     "draft), chain, tree", ["choice"], registry=r)
        for choice in CHOICES:
            self.policy_rounds.labels(choice)
        self.draft_nodes = Histogram("flashtree_policy_draft_nodes", "Drafted nodes verified per request and "
                                     "round (0 = a plain AR step)", buckets=NODE_BUCKETS, registry=r)
        self.predicted_accepted = Histogram("flashtree_policy_predicted_accepted", "Drafted tokens the policy "
                                            "expected the target to accept, per speculating request-round",
                                            buckets=DRAFTED_BUCKETS, registry=r)
        self.accepted = Histogram("flashtree_policy_accepted", "Drafted tokens the target accepted, per "
                                  "speculating request-round (compare flashtree_policy_predicted_accepted)",
                                  buckets=DRAFTED_BUCKETS, registry=r)
        self.round_seconds = Histogram("flashtree_round_seconds", "Wall time of one batched round "
                                       "(draft + tree + verify + commit)", buckets=ROUND_BUCKETS, registry=r)
        self.batch_size = Gauge("flashtree_batch_size", "Requests in the last round (0 when idle)", registry=r)
        self.waiting = Gauge("flashtree_requests_waiting", "Requests queued for a free slot", registry=r)
        self.running = Gauge("flashtree_requests_running", "Requests holding a slot", registry=r)
        self.ttft = Histogram("flashtree_time_to_first_token_seconds", "Arrival to first token (queueing + "
                              "prefill) of finished requests", buckets=REQUEST_BUCKETS, registry=r)
        self.latency = Histogram("flashtree_request_seconds", "Arrival to finish of requests that were not "
                                 "aborted", buckets=REQUEST_BUCKETS, registry=r)
        self._last_round = None

    def observe_round(self, engine, outputs) -> None:
        """After engine.step(): the round's latency, batch and acceptance, and new tokens."""
        info = engine.stats().last_round
        if info is not None and info is not self._last_round:
            self._last_round = info
            self.round_seconds.observe(info.seconds)
            self.batch_size.set(info.batch_size)
            for n in info.accept_lengths:
                self.accept_length.observe(n)
            for mode, nodes, predicted, n in zip(info.modes, info.draft_sizes, info.predicted_accepts,
                                                 info.accept_lengths):
                self.policy_rounds.labels(mode).inc()
                self.draft_nodes.observe(nodes)
                if mode != "ar":
                    self.predicted_accepted.observe(predicted)
                    self.accepted.observe(n - 1)
        self.generation_tokens.inc(sum(len(o.new_token_ids) for o in outputs))

    def observe_queue(self, engine) -> None:
        stats = engine.stats()
        self.waiting.set(stats.waiting)
        self.running.set(stats.running)
        if not stats.waiting and not stats.running:
            self.batch_size.set(0)

    def finished(self, req, status: str | None) -> None:
        self.requests.labels(status or "abort").inc()
        stats = req.stats
        if status in ("stop", "length") and stats.first_token is not None:
            self.ttft.observe(stats.first_token - stats.arrival)
            self.latency.observe(stats.wall_seconds)
