"""vLLM's metric names on /metrics, beside mmserve's own, so that what reads a vLLM server's metrics
reads ours: Grafana dashboards, KEDA / HPA autoscalers on the queue length, the production-stack
router on running requests and KV usage.

Each `vllm:` family is an mmserve family under vLLM's name, with vLLM's `model_name` label (the
first served model name), computed at scrape time from the same figures — nothing is counted twice:

| vLLM's name | from |
|---|---|
| `vllm:num_requests_running`, `vllm:num_requests_waiting` | the engine's running and waiting requests |
| `vllm:kv_cache_usage_perc` (and its older name `vllm:gpu_cache_usage_perc`) | 1 - free / total KV blocks (0 to 1) |
| `vllm:num_preemptions_total` | preemptions |
| `vllm:prompt_tokens_total`, `vllm:generation_tokens_total` | the requests' prompt and generated tokens |
| `vllm:time_to_first_token_seconds`, `vllm:e2e_request_latency_seconds` | the same histograms (our buckets) |
| `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total` | the prefix cache's, in prompt tokens (as vLLM) |
| `vllm:mm_cache_queries_total`, `vllm:mm_cache_hits_total` | the processor cache's, in items (vLLM's unit) |
| `vllm:request_success_total{finished_reason}` | completions ended, by reason: stop, length, abort, error |
| `vllm:request_prompt_tokens`, `vllm:request_generation_tokens` | per request (histograms) |
| `vllm:request_max_num_generation_tokens` | per request: the longest completion's tokens |
| `vllm:request_params_n`, `vllm:request_params_max_tokens` | per request: what it asked for |
| `vllm:inter_token_latency_seconds`, `vllm:time_per_output_token_seconds` (older) | between two token outputs |
| `vllm:request_decode_time_seconds` | per request: first token to last |
| `vllm:request_time_per_output_token_seconds` | the same over the tokens after each completion's first |
| `vllm:request_queue_time_seconds` | per request: reaching the engine core to its first admission |
| `vllm:request_prefill_time_seconds` | per request: first admission to first token |
| `vllm:request_inference_time_seconds` | per request: first admission to last token |

Per-request times are the engine core's clock, as vLLM's (`RequestOutput.metrics`); the
inter-token gaps are the API server's. `vllm:iteration_tokens_total` is not shown.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

RENAMED = {  # mmserve family -> vLLM's
    "mmserve_num_requests_running": "vllm:num_requests_running",
    "mmserve_num_requests_waiting": "vllm:num_requests_waiting",
    "mmserve_num_preemptions": "vllm:num_preemptions",
    "mmserve_prompt_tokens": "vllm:prompt_tokens",
    "mmserve_generation_tokens": "vllm:generation_tokens",
    "mmserve_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "mmserve_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "mmserve_request_finished": "vllm:request_success",
    "mmserve_request_prompt_tokens": "vllm:request_prompt_tokens",
    "mmserve_request_generation_tokens": "vllm:request_generation_tokens",
    "mmserve_request_max_num_generation_tokens": "vllm:request_max_num_generation_tokens",
    "mmserve_request_params_n": "vllm:request_params_n",
    "mmserve_request_params_max_tokens": "vllm:request_params_max_tokens",
    "mmserve_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "mmserve_request_time_per_output_token_seconds": "vllm:request_time_per_output_token_seconds",
    "mmserve_request_decode_time_seconds": "vllm:request_decode_time_seconds",
    "mmserve_request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "mmserve_request_prefill_time_seconds": "vllm:request_prefill_time_seconds",
    "mmserve_request_inference_time_seconds": "vllm:request_inference_time_seconds",
}
ALSO = {  # vLLM's older name for a family, shown too (dashboards made for earlier versions read it)
    "vllm:inter_token_latency_seconds": "vllm:time_per_output_token_seconds",
}
BY_LAYER = {  # mmserve family, its layer -> vLLM's
    ("mmserve_cache_queries", "prefix"): "vllm:prefix_cache_queries",
    ("mmserve_cache_hits", "prefix"): "vllm:prefix_cache_hits",
    ("mmserve_cache_queries", "processor"): "vllm:mm_cache_queries",
    ("mmserve_cache_hits", "processor"): "vllm:mm_cache_hits",
}
USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


class Source(Protocol):
    def collect(self) -> Iterable[Metric]: ...


class VllmNames(Collector):
    """The `vllm:` families of what `sources` collect (a registry, a collector), labelled `model_name`."""

    def __init__(self, sources: list[Source], model_name: str) -> None:
        self.sources = sources
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        blocks: dict[str, float] = {}
        for source in self.sources:
            for family in source.collect():
                if family.name in ("mmserve_kv_cache_free_blocks", "mmserve_kv_cache_total_blocks"):
                    blocks.update((family.name, s.value) for s in family.samples)
                if family.name in RENAMED:
                    yield self._renamed(family, name := RENAMED[family.name])
                    if name in ALSO:
                        yield self._renamed(family, ALSO[name])
                for (base, layer), name in BY_LAYER.items():
                    if family.name == base:
                        yield self._renamed(family, name, layer)
        yield from self._usage(blocks)

    def _renamed(self, family: Metric, name: str, layer: str | None = None) -> Metric:
        """`family` as `name`, labelled `model_name`; with `layer`, that layer's samples alone (unlabelled)."""
        out = Metric(name, family.documentation, family.type, family.unit)
        for s in family.samples:
            if layer is None or s.labels.get("layer") == layer:
                labels = {k: v for k, v in s.labels.items() if k != "layer"} | {"model_name": self.model_name}
                out.samples.append(s._replace(name=name + s.name[len(family.name):], labels=labels))
        return out

    def _usage(self, blocks: dict[str, float]) -> Iterator[Metric]:
        free, total = blocks.get("mmserve_kv_cache_free_blocks"), blocks.get("mmserve_kv_cache_total_blocks")
        for name in USAGE:
            gauge = GaugeMetricFamily(name, "KV cache usage: the share of KV blocks in use (1 means full).",
                                      labels=["model_name"])
            if free is not None and total:
                gauge.add_metric([self.model_name], 1.0 - free / total)
            yield gauge
