"""The scheduler's Prometheus endpoint: ``GET /metrics`` over HTTP (``--metrics-port``).

It serves the figures of the Status RPC in Prometheus's text format, read from the runtime
at each scrape on the scheduler's event loop, as Status reads them (nothing is kept between
scrapes), and histograms of the groups delivered since start that Status does not have
(``rollserve.scheduler.histogram``): ``rollserve_group_latency_seconds``, Submit to stream
entry, ``rollserve_sample_output_tokens``, each sample's length, and
``rollserve_token_staleness_versions``, output tokens by how far behind their run's version
at delivery they were made; and ``rollserve_plan_seconds``, how long each plan took (it
grows with the queue's depth).

Names start with ``rollserve_``; the counters (``_total``) and histograms count since the
scheduler process started, as Status's counters do. Per engine, the series carry the label
``engine`` (its id); ``rollserve_engine_info`` is 1 with the engine's address, model and
dtype as labels. Per run with groups queued or running, the ``rollserve_run_*`` series carry
the label ``run`` (its id); a run with none has no series. The predictor's error and tail
AUC are left out while Status leaves them unset (too few samples scored).

Served by ``rollserve.common.http.HttpServer``: each scrape reads the Status and
copies the histograms on the event loop, and formats them on a worker thread.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from rollserve.scheduler.histogram import Histogram
from rollserve.v1 import rollserve_pb2 as pb

__all__ = ["status_metrics", "status_registry"]

PREFIX = "rollserve_"


@dataclass(frozen=True)
class _Figure:
    field: str  # of StatusResponse or EngineStatus
    counter: bool
    help: str
    name: str = ""  # the metric's name after the prefix, when not the field's

    @property
    def metric_name(self) -> str:
        return PREFIX + (self.name or self.field)


_SCHEDULER = (
    _Figure("queue_depth", False, "Groups waiting for an engine."),
    _Figure("inflight_groups", False, "Groups placed on engines and not finished."),
    _Figure("inflight_samples", False, "Samples placed on engines and not finished."),
    _Figure("groups_delivered", True, "Groups written to their run's stream."),
    _Figure("samples_delivered", True, "Samples of the groups delivered."),
    _Figure("samples_streamed", True, "Samples written to the samples streams as they finished."),
    _Figure("tokens_generated", True, "Output tokens of the groups delivered."),
    _Figure("groups_failed", True, "Groups reported failed, with a reason, in the stream."),
    _Figure("groups_cancelled", True, "Groups cancelled by their callers."),
    _Figure("engine_failures", True, "Times an engine was marked unhealthy."),
    _Figure("samples_preempted", True, "Times a running sample was stopped, its tokens kept."),
    _Figure("predictor_keys", False, "Prompt keys with length history."),
    _Figure("predictor_epoch", False, "The length predictor's newest epoch."),
    _Figure("predictor_scored_samples", False, "Samples the predictor's error is taken over."),
    _Figure("fleet_weights_version", False, "Version of the fleet's published weights."),
    _Figure(
        "publishes_awaiting_counts",
        False,
        "Publishes without weights still waiting for engines' token counts.",
    ),
    _Figure("earlier_outputs_sent", True, "Earlier outputs carried by Generate calls."),
    _Figure("earlier_outputs_pushed", True, "Outputs of finished samples pushed to engines."),
    _Figure("stream_entries_trimmed", True, "Stream entries removed once every group acked."),
)
# unset while undefined
_MAE = _Figure("predictor_mae_tokens", False, "Mean absolute error of predicted lengths, tokens.")
_AUC = _Figure(
    "predictor_tail_auc", False, "ROC AUC of predicted lengths for the longest 10% of samples."
)
_ENGINE = tuple(  # named rollserve_engine_<field>, labelled engine
    _Figure(f.field, f.counter, f.help, "engine_" + f.field)
    for f in (
        _Figure("healthy", False, "1 while the engine serves, 0 while out of service."),
        _Figure("inflight_groups", False, "Groups running on the engine."),
        _Figure("inflight_samples", False, "Samples running on the engine."),
        _Figure("outstanding_tokens", False, "Most tokens its running samples may still make."),
        _Figure(
            "predicted_outstanding_tokens",
            False,
            "Tokens its running samples are predicted to make.",
        ),
        _Figure("capacity_samples", False, "Most samples the scheduler runs on it at once."),
        _Figure("weights_version", False, "Version of the weights it serves (0: its launch ones)."),
        _Figure("loading_weights", False, "1 while it loads the fleet's weights."),
        _Figure("restarts", True, "Times the scheduler found it started anew."),
    )
)


_RUN = tuple(  # named rollserve_run_<field>, labelled run
    _Figure(f.field, f.counter, f.help, "run_" + f.field)
    for f in (
        _Figure("queued_groups", False, "The run's groups with samples waiting for an engine."),
        _Figure("queued_samples", False, "The run's samples waiting for an engine."),
        _Figure("running_groups", False, "The run's groups with samples on engines."),
        _Figure("running_samples", False, "The run's samples on engines."),
    )
)


def status_metrics(
    status: pb.StatusResponse, histograms: Sequence[Histogram] = ()
) -> Iterator[Metric]:
    """The Status figures and ``histograms`` as Prometheus metric families (see the
    module's docstring)."""
    for figure in _SCHEDULER:
        yield _family(figure, [((), float(getattr(status, figure.field)))])
    if status.HasField("predictor_mae_tokens"):
        yield _family(_MAE, [((), status.predictor_mae_tokens)])
    if status.HasField("predictor_tail_auc"):
        yield _family(_AUC, [((), status.predictor_tail_auc)])
    engines = list(status.engines)
    for figure in _ENGINE:
        yield _family(
            figure,
            [((e.engine_id,), float(getattr(e, figure.field))) for e in engines],
            ("engine",),
        )
    for figure in _RUN:
        yield _family(
            figure,
            [((r.run_id,), float(getattr(r, figure.field))) for r in status.runs],
            ("run",),
        )
    info = GaugeMetricFamily(
        PREFIX + "engine_info",
        "1 for each engine, with what it serves as labels.",
        labels=("engine", "address", "model", "dtype"),
    )
    for e in engines:
        info.add_metric((e.engine_id, e.address, e.model, e.dtype), 1.0)
    yield info
    for histogram in histograms:
        yield HistogramMetricFamily(
            PREFIX + histogram.name,
            histogram.help,
            buckets=histogram.cumulative(),
            sum_value=histogram.sum,
        )


def _family(
    figure: _Figure, samples: list[tuple[tuple[str, ...], float]], labels: tuple[str, ...] = ()
) -> Metric:
    family: CounterMetricFamily | GaugeMetricFamily
    if figure.counter:
        family = CounterMetricFamily(figure.metric_name, figure.help, labels=labels)
    else:
        family = GaugeMetricFamily(figure.metric_name, figure.help, labels=labels)
    for values, value in samples:
        family.add_metric(values, value)
    return family


class _StatusCollector(Collector):
    def __init__(self, status: pb.StatusResponse, histograms: Sequence[Histogram]) -> None:
        self._status = status
        self._histograms = histograms

    def collect(self) -> Iterator[Metric]:
        return status_metrics(self._status, self._histograms)


def status_registry(
    status: pb.StatusResponse, histograms: Sequence[Histogram] = ()
) -> CollectorRegistry:
    """A registry of these figures, which the caller no longer changes (a Status built for
    it, copies of the histograms): it may be formatted on any thread."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatusCollector(status, histograms))
    return registry
