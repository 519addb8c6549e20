"""Every metric deploy/ names (the Grafana dashboard, the alerts, prometheus-adapter's rule, the
engines' HorizontalPodAutoscaler) is one finsieve exports: a renamed metric would otherwise
leave an empty panel, an alert that never fires and an autoscaler that never scales."""

from __future__ import annotations

import importlib
import json
import re

import prometheus_client
import yaml

from support.paths import REPO

OBSERVABILITY = REPO / "deploy" / "observability"
METRIC = re.compile(r"\bfinsieve_[a-z0-9_]+\b")
# A metric defined in the code: Counter("finsieve_...", Gauge(, Histogram( (maybe on the next line).
DEFINITION = re.compile(r"\b(?:Counter|Gauge|Histogram|Summary)\(\s*\"(finsieve_[a-z0-9_]+)\"")
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
            "summary": ("", "_sum", "_count")}


def exported_series() -> set[str]:
    """The series names finsieve's code exports, read from prometheus_client's registry after
    importing every module that defines one (found in the source: nothing listed by hand)."""
    modules = set()
    for package in ("finsieve", "engine", "gateway"):
        for path in (REPO / package).rglob("*.py"):
            if DEFINITION.search(path.read_text()):
                modules.add(".".join(path.relative_to(REPO).with_suffix("").parts))
    assert len(modules) >= 5, modules  # the scan found the metric modules
    for module in sorted(modules):
        importlib.import_module(module)
    series = set()
    for family in prometheus_client.REGISTRY.collect():
        if family.name.startswith("finsieve_"):
            series |= {family.name + s for s in SUFFIXES[family.type]}
    return series


def named_in_deploy() -> dict[str, set[str]]:
    """Each deploy file's metric names."""
    dashboard = json.loads((OBSERVABILITY / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    alerts = yaml.safe_load((OBSERVABILITY / "alerts.yaml").read_text())
    adapter = yaml.safe_load((OBSERVABILITY / "prometheus-adapter.yaml").read_text())
    hpa = yaml.safe_load((REPO / "deploy" / "k8s" / "base" / "autoscaling.yaml").read_text())
    names = {
        "grafana-dashboard.json": exprs,
        "alerts.yaml": [r["expr"] for g in alerts["groups"] for r in g["rules"]],
        "prometheus-adapter.yaml": [r["seriesQuery"] + " " + r["name"]["as"] for r in adapter["rules"]],
        "autoscaling.yaml": [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]],
    }
    return {file: {m for e in exprs for m in METRIC.findall(e)} for file, exprs in names.items()}


def test_every_metric_deploy_names_is_exported_by_the_code():
    exported = exported_series()
    assert "finsieve_engine_waiting" in exported and "finsieve_decode_step_seconds_bucket" in exported
    named = named_in_deploy()
    assert all(named.values()), named  # each file names some metric
    missing = {file: sorted(names - exported) for file, names in named.items() if names - exported}
    assert not missing, f"metrics finsieve does not export: {missing}"


def test_the_autoscaler_and_the_adapter_agree_on_the_queue_metric():
    named = named_in_deploy()
    assert named["autoscaling.yaml"] == named["prometheus-adapter.yaml"] == {"finsieve_engine_waiting"}


def test_the_dashboard_covers_every_metric_the_code_exports():
    """A new metric without a panel is easy to miss: the dashboard shows each family."""
    families = {re.sub(r"_(total|bucket|sum|count)$", "", s) for s in exported_series()}
    shown = {re.sub(r"_(total|bucket|sum|count)$", "", m)
             for m in named_in_deploy()["grafana-dashboard.json"]}
    # Operational detail the dashboard leaves to ad-hoc queries.
    left_out = {"finsieve_cache_rejected", "finsieve_cache_store_waits", "finsieve_cache_store_waiting"}
    assert families - shown == left_out
