"""The soak's verdict and its tables: the memory rule and the summaries of RSS samples and
daemon counters that go into a report (:func:`rss_summary`, :func:`daemon_counters`),
:func:`judge` (why a run fails: an empty list passes it) and :func:`render` (the report
as a plain-text table)."""

from __future__ import annotations

from collections import Counter
from typing import Any

RSS_FACTOR, RSS_SLACK_KIB = 2.0, 64 << 10  # end <= 2 x warm + 64 MiB, per incarnation
RSS_RULE = (
    "per daemon incarnation that outlived the warm-up: its last RSS sample <= 2 x its first"
    " sample after the warm-up + 64 MiB"
)


def rss_summary(rss: list[tuple[float, int, int]], warm_age: float) -> dict[str, Any]:
    """Per incarnation and overall, from ``(seconds, incarnation, KiB)`` samples: start,
    first sample ``warm_age`` seconds after the incarnation's first (warm), peak, end, and
    whether the end keeps the rule."""
    incarnations = []
    for n in sorted({inc for _, inc, _ in rss}):
        samples = [(s, kib) for s, inc, kib in rss if inc == n]
        first = samples[0][0]
        warm = next((kib for s, kib in samples if s - first >= warm_age), None)
        end = samples[-1][1]
        entry = {
            "incarnation": n,
            "seconds": round(samples[-1][0] - first, 1),
            "start": samples[0][1],
            "warm": warm,
            "peak": max(kib for _, kib in samples),
            "end": end,
        }
        if warm is not None:
            entry["growth_after_warm"] = end - warm
            entry["limit"] = int(RSS_FACTOR * warm + RSS_SLACK_KIB)
            entry["ok"] = end <= entry["limit"]
        incarnations.append(entry)
    if not rss:
        return {"incarnations": [], "rule": RSS_RULE}
    first_warm = next((i["warm"] for i in incarnations if i["warm"] is not None), None)
    return {
        "start": rss[0][2],
        "warm": first_warm,
        "peak": max(kib for *_, kib in rss),
        "end": rss[-1][2],
        "incarnations": incarnations,
        "rule": RSS_RULE,
    }


def daemon_counters(last_stats: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Summed over incarnations from the last stats sampled in each (every 2 s: what
    a hot-killed daemon counted after its last sample is missing)."""
    out: Counter[str] = Counter()
    for stats in last_stats.values():
        for tier in stats["tiers"]:
            for key in ("io_errors", "dropped", "evictions", "demotions", "promotions"):
                out[f"{tier['name']}.{key}"] += tier[key]
        out["events_dropped"] += stats["chain"]["events_dropped"]
        for code, count in stats["server"]["errors"].items():
            out[f"errors.{code}"] += count
    return dict(sorted(out.items()))


def judge(report: dict[str, Any]) -> list[str]:
    """Why the run fails (empty: it passes)."""
    reasons: list[str] = []
    if report["wrong_blocks"]:
        reasons.append(f"{report['wrong_blocks']} blocks served with wrong bytes")
    if report["durable_lost"]:
        reasons.append(f"{report['durable_lost']} durable blocks lost across a restart")
    if report["aborted_store_visible"]:
        reasons.append(f"{report['aborted_store_visible']} blocks of killed stores visible")
    internal = report["fuzz"].get("internal", 0) + report["client_errors"].get("internal", 0)
    if internal:
        reasons.append(f"{internal} 'internal' error replies (daemon bugs)")
    if report["fuzz"].get("malformed", 0):
        reasons.append(f"{report['fuzz']['malformed']} malformed replies to the fuzzer")
    leaks = report["leaks"]
    if not leaks.get("idle_reached") or any(leaks.get(k) for k in ("pinned", "writing", "leases")):
        reasons.append(f"pins or leases left once every client was gone: {leaks}")
    for inc in report["rss_kib"]["incarnations"]:
        if inc.get("ok") is False:
            reasons.append(
                f"daemon incarnation {inc['incarnation']}: RSS {inc['end']} KiB at the end is"
                f" over {inc['limit']} KiB (2 x {inc['warm']} KiB after warm-up + 64 MiB)"
            )
    if not any("ok" in inc for inc in report["rss_kib"]["incarnations"]):
        reasons.append("no daemon incarnation ran past the warm-up: memory not judged")
    if report["unexpected_exits"]:
        reasons.append(f"the daemon exited on its own {report['unexpected_exits']} times")
    if report["exit_statuses"] != [0, 0]:
        reasons.append(f"SIGTERM exit statuses {report['exit_statuses']}, expected [0, 0]")
    hostile = report.get("hostile", {})
    if hostile.get("unexpected"):
        reasons.append(f"misbehaving clients met no guard: {hostile['unexpected'][:3]}")
    missing = [kind for kind, count in report["faults"].items() if not count]
    if missing:
        reasons.append(f"fault kinds never injected: {', '.join(missing)}")
    if report["restarts"] < 1:
        reasons.append("no SIGKILL restart happened")
    ops, blocks = report["operations"], report["blocks"]
    if not ops.get("load") or not ops.get("store") or not blocks.get("verified"):
        reasons.append(f"no real load ran: {ops}")
    if report["durability"].get("blocks", 0) == 0:
        reasons.append("no durable block was ever checked across a restart")
    reasons += report["problems"]
    return reasons


def render(report: dict[str, Any]) -> str:
    """The report as a plain-text table."""
    rows: list[tuple[str, str]] = []

    def add(name: str, value: Any) -> None:
        rows.append((name, str(value)))

    s = report["settings"]
    add("run", f"{report['load_seconds']} s, {s['clients']} clients, seed {s['seed']}")
    add(
        "daemon",
        f"block {s['block_bytes']} B, cpu {s['cpu_blocks']}, disk {s['disk_blocks']} blocks,"
        f" key space {s['key_space']}",
    )
    for kind, count in sorted(report["operations"].items()):
        add(f"ops.{kind}", count)
    for kind, count in sorted(report["blocks"].items()):
        add(f"blocks.{kind}", count)
    rate = report["ops_per_s"]
    add("ops/s overall", rate["overall"])
    add("ops/s per minute", " ".join(str(r) for r in rate["per_minute"]))
    for kind, count in report["faults"].items():
        add(f"fault.{kind}", count)
    for kind, count in report["fault_calls"].items():
        add(f"fault_calls.{kind}", count)
    for kind, count in sorted(report.get("hostile", {}).get("counts", {}).items()):
        add(f"hostile.{kind}", count)
    for what in report.get("hostile", {}).get("unexpected", []):
        add("hostile.unexpected", what)
    add("restarts (SIGKILL)", report["restarts"])
    add("bad frames sent", report["bad_frames_sent"])
    fuzz = report["fuzz"]
    add("fuzz replies / internal", f"{fuzz.get('replies', 0)} / {fuzz.get('internal', 0)}")
    for kind, count in sorted(report["client_errors"].items()):
        add(f"client_error.{kind}", count)
    for kind, count in report["daemon_counters"].items():
        add(f"daemon.{kind}", count)
    add("wrong blocks", report["wrong_blocks"])
    add("aborted stores visible", report["aborted_store_visible"])
    dur = report["durability"]
    add(
        "durable blocks checked / lost",
        f"{dur.get('blocks', 0)} in {dur.get('checks', 0)} checks / {dur.get('lost', 0)}",
    )
    add("pins/leases at the end", report["leaks"])
    rss = report["rss_kib"]
    add(
        "RSS KiB start/warm/peak/end",
        f"{rss.get('start')} / {rss.get('warm')} / {rss.get('peak')} / {rss.get('end')}",
    )
    for inc in rss["incarnations"]:
        add(
            f"RSS KiB incarnation {inc['incarnation']}",
            f"{inc['seconds']} s: start {inc['start']}, warm {inc['warm']}, peak {inc['peak']},"
            f" end {inc['end']}" + (f" (limit {inc['limit']})" if "limit" in inc else ""),
        )
    add("SIGTERM exit statuses", report["exit_statuses"])
    reasons = report.get("reasons", judge(report))
    add("result", "PASS" if not reasons else "FAIL")
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines += [f"  - {reason}" for reason in reasons]
    return "\n".join(lines)
