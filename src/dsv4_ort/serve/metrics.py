"""``GET /metrics``: the engine's counters and latency histograms in Prometheus' text format (version 0.0.4)."""

from __future__ import annotations

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _label(v) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v) -> str:
    return repr(float(v)) if isinstance(v, float) else str(v)


def render(engine_metrics: dict, http: dict) -> str:
    """``engine_metrics``: :meth:`Engine.metrics`; ``http``: {(path, status): count} answered by the server."""
    m = engine_metrics
    lines = []

    def metric(name, kind, help_, samples):
        lines.append(f"# HELP dsv4_ort_{name} {help_}")
        lines.append(f"# TYPE dsv4_ort_{name} {kind}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            lines.append(f"dsv4_ort_{name}{'{' + lab + '}' if lab else ''} {_num(value)}")

    def histogram(name, help_, h):
        lines.append(f"# HELP dsv4_ort_{name} {help_}")
        lines.append(f"# TYPE dsv4_ort_{name} histogram")
        for bound, count in zip(list(h["bounds"]) + ["+Inf"], h["counts"]):
            lines.append(f'dsv4_ort_{name}_bucket{{le="{bound}"}} {count}')
        lines.append(f"dsv4_ort_{name}_sum {_num(float(h['sum']))}")
        lines.append(f"dsv4_ort_{name}_count {h['count']}")

    metric("requests_total", "counter", "Requests the engine finished, by finish reason.",
           [({"finish_reason": k}, v) for k, v in sorted(m["requests"].items())] or [({"finish_reason": "stop"}, 0)])
    metric("http_requests_total", "counter", "HTTP requests answered, by path and status.",
           [({"path": p, "status": s}, v) for (p, s), v in sorted(http.items())])
    metric("prompt_tokens_total", "counter", "Prompt tokens prefilled.", [({}, m["prompt_tokens"])])
    metric("generation_tokens_total", "counter", "Tokens generated.", [({}, m["completion_tokens"])])
    metric("queue_depth", "gauge", "Requests waiting for a state row.", [({}, m["queue_depth"])])
    metric("running_requests", "gauge", "Requests holding a state row (prefilling or decoding).",
           [({}, m["running"])])
    metric("batch_slots", "gauge", "State rows in the pool (--max-batch).", [({}, m["max_batch"])])
    metric("batch_occupancy", "gauge", "Fraction of the state rows in use.",
           [({}, m["running"] / m["max_batch"])])
    metric("engine_steps_total", "counter", "Engine steps run.", [({}, m["steps"])])
    if m.get("speculative"):
        metric("spec_draft_tokens_total", "counter", "Tokens drafted by the MTP block.", [({}, m["drafted"])])
        metric("spec_accepted_tokens_total", "counter", "Drafted tokens the main model accepted.",
               [({}, m["accepted"])])
    histogram("time_to_first_token_seconds", "Time from submission to the first token.", m["ttft"])
    histogram("inter_token_latency_seconds", "Time between consecutive tokens of a request.", m["itl"])
    return "\n".join(lines) + "\n"
