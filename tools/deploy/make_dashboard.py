#!/usr/bin/env python3
"""Writes deploy/grafana/pdserve-dashboard.json (Grafana dashboard schema 38).

Panels use only the metric names of docs/metrics.md. Rerun after changing a panel:
    python3 tools/deploy/make_dashboard.py > deploy/grafana/pdserve-dashboard.json
"""
import json

DS = {"type": "prometheus", "uid": "${datasource}"}


def quantiles(metric, by=""):
    group = f"sum by (le{', ' + by if by else ''})"
    return [(f"histogram_quantile({q}, {group} (rate({metric}_bucket[$__rate_interval])))",
             f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)]


ROWS = [
    ("Router", [
        ("Requests/s by status", "reqps",
         [("sum by (status) (rate(pdserve_router_requests_total[$__rate_interval]))",
           "{{status}}")]),
        ("Time to first token", "s", quantiles("pdserve_router_time_to_first_token_seconds")),
        ("Time per output token", "s", quantiles("pdserve_router_time_per_output_token_seconds")),
        ("Inter-token latency", "s", quantiles("pdserve_router_inter_token_latency_seconds")),
        ("End-to-end latency", "s", quantiles("pdserve_router_e2e_request_latency_seconds")),
        ("Queue time", "s", quantiles("pdserve_router_queue_time_seconds")),
        ("Tokens/s", "short",
         [("sum(rate(pdserve_router_prompt_tokens_total[$__rate_interval]))", "prompt"),
          ("sum(rate(pdserve_router_generation_tokens_total[$__rate_interval]))", "generated")]),
        ("In flight and retries", "short",
         [("sum(pdserve_router_requests_in_flight)", "in flight"),
          ("sum by (reason) (rate(pdserve_router_retries_total[$__rate_interval]))",
           "retries/s {{reason}}")]),
        ("Workers up", "short",
         [("pdserve_router_worker_up", "{{role}} {{worker}}")]),
        ("Degenerate generations/s", "short",
         [("sum by (kind) (rate(pdserve_router_degenerate_generations_total[$__rate_interval]))",
           "{{kind}}")]),
    ]),
    ("Prefill", [
        ("Prefill tokens/s", "short",
         [("sum by (instance) (rate(pdserve_prefill_tokens_total[$__rate_interval]))",
           "{{instance}}")]),
        ("Queue depth", "short", [("pdserve_prefill_queue_depth", "{{instance}}")]),
        ("Chunk size (tokens)", "short", quantiles("pdserve_prefill_chunk_tokens")),
        ("Prefill latency", "s", quantiles("pdserve_prefill_latency_seconds")),
        ("Transfer GB/s", "short",
         [("sum by (instance) (rate(pdserve_prefill_transfer_bytes_total[$__rate_interval])) / 1e9",
           "{{instance}} aggregate"),
          ("histogram_quantile(0.5, sum by (le) (rate("
           "pdserve_prefill_transfer_bandwidth_bytes_per_second_bucket[$__rate_interval]))) / 1e9",
           "per-request p50")]),
        ("Transfer latency", "s", quantiles("pdserve_prefill_transfer_seconds")),
        ("Transfers in flight and failures/s", "short",
         [("sum by (instance) (pdserve_prefill_transfers_in_flight)", "in flight {{instance}}"),
          ("sum by (reason) (rate(pdserve_prefill_transfer_failures_total[$__rate_interval]))",
           "failed {{reason}}")]),
    ]),
    ("Decode", [
        ("Running / waiting", "short",
         [("sum by (instance) (pdserve_decode_requests_running)", "running {{instance}}"),
          ("sum by (instance) (pdserve_decode_requests_waiting)", "waiting {{instance}}")]),
        ("Batch size", "short", quantiles("pdserve_decode_batch_size")),
        ("Step time", "s", quantiles("pdserve_decode_step_seconds")),
        ("Decode tokens/s", "short",
         [("sum by (instance) (rate(pdserve_decode_tokens_total[$__rate_interval]))",
           "{{instance}}")]),
        ("Pool pages by kind", "short",
         [("sum by (kind) (pdserve_decode_pool_pages_used)", "used {{kind}}"),
          ("sum by (kind) (pdserve_decode_pool_pages_free)", "free {{kind}}")]),
        ("Isolation failures and fenced pages", "short",
         [("sum by (kind) (increase(pdserve_decode_isolation_failures_total[$__rate_interval]))",
           "isolation {{kind}}"),
          ("sum(pdserve_decode_fenced_pages)", "fenced pages"),
          ("sum by (kind) (rate(pdserve_decode_degenerate_generations_total[$__rate_interval]))",
           "degenerate {{kind}}")]),
    ]),
]


def main():
    panels, next_id, y = [], 1, 0
    for title, row_panels in ROWS:
        panels.append({"type": "row", "title": title, "id": next_id, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        next_id, y = next_id + 1, y + 1
        for i, (ptitle, unit, targets) in enumerate(row_panels):
            panels.append({
                "type": "timeseries", "title": ptitle, "id": next_id, "datasource": DS,
                "gridPos": {"h": 8, "w": 8, "x": (i % 3) * 8, "y": y + (i // 3) * 8},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [{"datasource": DS, "expr": e, "legendFormat": legend,
                             "refId": chr(ord("A") + k)}
                            for k, (e, legend) in enumerate(targets)],
            })
            next_id += 1
        y += ((len(row_panels) + 2) // 3) * 8
    dashboard = {
        "title": "pdserve", "uid": "pdserve-overview", "schemaVersion": 38, "version": 1,
        "editable": True, "tags": ["pdserve"], "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "templating": {"list": [{"name": "datasource", "type": "datasource",
                                 "query": "prometheus", "label": "Data source"}]},
        "annotations": {"list": []},
        "panels": panels,
    }
    print(json.dumps(dashboard, indent=2))


if __name__ == "__main__":
    main()
