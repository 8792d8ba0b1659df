"""The Grafana dashboard shipped at ``config/grafana/tierd.json`` (``tierd/share/
grafana-tierd.json`` in a wheel): every metric name a panel's query (or a template
variable) names is exported by a real daemon's ``/metrics``.

The daemon runs as a real ``tierd serve`` process (the ``spawn`` fixture of
tests/daemon_kit.py) with a remote level whose server is absent (its families are
exposed all the same), and enough traffic that every labelled family has samples.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.daemon_kit import Spawn, block, http_get, keys
from tests.port_kit import free_port
from tierd.share import shipped
from tierd.testing import daemon_config

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "config" / "grafana" / "tierd.json"

# PromQL words that are neither metrics nor functions (functions are followed by "(").
_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_KEYWORDS |= {"offset", "bool", "and", "or", "unless", "inf", "nan"}
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: what is left once strings, label
    matchers, ranges, grouping lists, functions, keywords and numbers are taken out."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for match in re.finditer(r"(?<![\w$.])([A-Za-z_:][\w:]*)\s*(\()?", expr):
        name, call = match.groups()
        if not call and name.lower() not in _KEYWORDS:
            names.add(name)
    return names


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows included; rows themselves left out."""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            yield from panels({"panels": panel.get("panels", [])})
        else:
            yield panel


def queried(dashboard: dict[str, Any]) -> dict[str, set[str]]:
    """Metric name -> the titles of the panels (or variables) that query it."""
    where: dict[str, set[str]] = {}
    for panel in panels(dashboard):
        exprs = [target["expr"] for target in panel["targets"]]
        assert exprs and all(exprs), f"panel {panel['title']!r} has no query"
        for expr in exprs:
            for name in metric_names(expr):
                where.setdefault(name, set()).add(panel["title"])
    for variable in dashboard["templating"]["list"]:
        query = variable.get("definition") or ""
        for name in re.findall(r"label_values\(\s*([A-Za-z_:][\w:]*)\s*,", query):
            where.setdefault(name, set()).add(f"${variable['name']}")
    return where


def unknown(dashboard: dict[str, Any], exported: set[str]) -> dict[str, list[str]]:
    return {name: sorted(t) for name, t in queried(dashboard).items() if name not in exported}


def exported_names(text: str) -> set[str]:
    """Every name a query may use: each sample's, and each family's by its type (a
    counter's ``_total``, a histogram's ``_bucket``/``_sum``/``_count``), samples or none."""
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {sample.name for sample in family.samples}
        suffixes = _SUFFIXES.get(family.type, ("",))
        names |= {family.name + suffix for suffix in suffixes}
    return names


async def test_every_panel_queries_a_metric_the_daemon_exports(
    tmp_path: Path, spawn: Spawn
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    port = free_port()
    remote = {"url": f"redis://127.0.0.1:{free_port()}/0"}  # absent: calls fail as misses
    daemon = await spawn(daemon_config(tmp_path, metrics={"http_port": port}, remote=remote))
    names = keys("grafana", 12)
    async with await daemon.connect() as client:
        for part in (names[:6], names[6:]):  # the second evicts: a CPU -> DISK route
            assert await client.store(part, [block(k) for k in part]) == 6
        assert await client.load(names[:2]) == [block(k) for k in names[:2]]
    status, text = await asyncio.to_thread(http_get, f"http://127.0.0.1:{port}/metrics")
    assert status == 200, text
    assert await daemon.stop() == 0
    exported = exported_names(text)
    assert "tierd_route_bytes_total" in exported and "tierd_remote_hits_total" in exported

    assert unknown(dashboard, exported) == {}, "panels query metrics tierd does not export"
    # What the dashboard is for: occupancy, hit ratios, routes, remote, leases, namespaces.
    used = set(queried(dashboard))
    for name in (
        "tierd_tier_used_blocks",
        "tierd_tier_capacity_blocks",
        "tierd_tier_hits_total",
        "tierd_tier_misses_total",
        "tierd_hit_blocks_total",
        "tierd_route_bytes_total",
        "tierd_remote_hits_total",
        "tierd_remote_breaker_open",
        "tierd_tenant_leases_held_blocks",
        "tierd_namespace_bytes",
    ):
        assert name in used, name

    # The check fails on a panel that names a metric tierd does not export.
    broken = copy.deepcopy(dashboard)
    bogus = copy.deepcopy(next(panels(broken)))
    bogus["title"] = "bogus"
    bogus["targets"][0]["expr"] = 'rate(tierd_tier_hitz_total{tier="cpu"}[5m])'
    broken["panels"].append(bogus)
    assert unknown(broken, exported) == {"tierd_tier_hitz_total": ["bogus"]}


def test_metric_names_are_read_from_queries_as_promql_reads_them() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le, op) (rate(tierd_request_duration_seconds_bucket"
        '{instance=~"$instance", op!~"a{b}"}[$__rate_interval]))) / on(instance) group_left '
        "(version) tierd_build_info or vector(1e-9) > bool 0.5 unless tierd_x offset 5m"
    )
    # group_left (version): a label list; vector, rate...: functions; 1e-9, 5m: numbers.
    expected = {"tierd_request_duration_seconds_bucket", "tierd_build_info", "tierd_x"}
    assert metric_names(expr) == expected


def test_the_dashboard_is_well_formed_and_ships_with_the_package() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert json.loads(shipped("grafana-tierd.json").read_text()) == dashboard
    every = list(panels(dashboard))
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in every:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        # The data source is a variable: the dashboard imports into any Grafana.
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert '{instance=~"$instance"' in target["expr"], (panel["title"], target["expr"])
