"""Console benchmark: how long a page of 10,000 search results takes, over real HTTP, from
the request to the last byte of the page (target: under 1 s on the 2-core machine).

    .venv/bin/python bench/bench_console.py [--conversations 12000] [--runs 7]

A real embedded Valkey on loopback holds a trail of `--conversations` conversations, each
appended as the gateway does (a request_started record, then the request record, through
the trail's own Lua append), shaped like the gateway's records: a user message of ~300
characters, an answer of ~700, one in four with an intervention, one in ten reviewed. The
console (the officers' ASGI app under uvicorn, as `FINSIEVE_CONSOLE_PORT` serves it) runs in
this process on loopback; an officer logs in and asks for pages of 10,000 (and 1,000, 100)
newest first: every tenant (the time index, which holds the started records too), one
tenant, and one rule. Each page is also timed in parts, in-process: reading the records,
their review statuses and seals, and rendering the HTML. Prints a table and writes
bench/results/console/<date>-page-10000.json. Besides wall time, each request's CPU time
(this process and Valkey's, from /proc), and the machine's load average: on a machine shared
with other work the wall time includes their turns on the cores; the CPU time is the page's
own work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from provenance import provenance, with_provenance

from finsieve.config import Settings
from finsieve.valkey import EmbeddedValkey, connect
from gateway.audit import AuditLog, Filters, index_key
from gateway.console import app as console_app
from gateway.console import reviews, trail
from gateway.console.server import start
from gateway.console.sessions import Sessions
from gateway.keys import KeyStore

REPO = Path(__file__).resolve().parents[1]
KEY = b"bench-key-of-thirty-two-bytes-or-more"
TARGET_S = 1.0
WORDS = ["diversification", "spreads", "risk", "across", "assets", "so", "that", "one", "loss", "does",
         "not", "sink", "the", "whole", "portfolio", "index", "funds", "bonds", "equities", "cash",
         "allocation", "rebalancing", "horizon", "volatility"]


def text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < chars:
        out.append(rng.choice(WORDS))
    return " ".join(out)


async def fill(log: AuditLog, conversations: int, officer: str) -> None:
    rng = random.Random(7)
    for i in range(conversations):
        tenant, user = f"bank-{i % 4}", f"user-{i % 500}"
        message = [{"role": "user", "content": text(rng, 300)}]
        started = {"tenant": tenant, "key_id": "0123456789abcdef", "app": "mobile", "user": user,
                   "request_id": f"r{i}", "messages": message, "params": {"max_tokens": 200},
                   "match_hashes": []}
        audit_id = await log.append("request_started", started, ids={"user": user, "request_id": f"r{i}"})
        answer = text(rng, 700)
        interventions = []
        if i % 4 == 0:
            interventions = [{"rule_id": "promissory-guaranteed-returns-en", "action": "block",
                              "start": 120, "end": 120, "rolled_back": True, "tokens_recomputed": 4,
                              "scope": "output", "suppressed": "guaranteed returns"}]
        final = {**started, "metadata": {"user": user}, "model": "SmolLM2-135M-Instruct",
                 "policy_version": "20675f2ba5f54f69", "delivered": answer, "interventions": interventions,
                 "cache_hit": i % 7 == 0, "latency_ms": {"first_delta": 41.5, "total": 2210.0},
                 "audit_id": audit_id, "finish_reason": "STOP",
                 "usage": {"prompt_tokens": 80, "completion_tokens": 160}}
        await log.append("request", final, ids={"user": user, "request_id": f"r{i}"})
        if i % 10 == 0:
            await log.append("review", {"kind": "review", "subject": str(audit_id), "tenant": tenant,
                                        "decision": "reviewed", "comment": "ok", "by": officer})


def cpu_s(pid: int) -> float:
    """CPU seconds a process has used (user and system), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def login(http: httpx.AsyncClient, key: str) -> dict[str, str]:
    form = await http.get("/login")
    token = re.search(r'name="login_csrf" value="([^"]+)"', form.text)[1]
    reply = await http.post("/login", data={"login_csrf": token, "key": key},
                            headers={"cookie": f"__Host-finsieve-login={token}"})
    session = next(h for h in reply.headers.get_list("set-cookie")
                   if h.startswith("__Host-finsieve-session="))
    return {"cookie": session.split(";", 1)[0]}


async def parts(pages: console_app.Pages, log: AuditLog, f: Filters, size: int) -> dict[str, float]:
    """One page's parts, in-process: read, decorate (statuses, seals), render (as a page is
    built: the cycle collector paused)."""
    with console_app.cycle_collection_paused():
        return await _parts(pages, log, f, size)


async def _parts(pages: console_app.Pages, log: AuditLog, f: Filters, size: int) -> dict[str, float]:
    t0 = time.perf_counter()
    page = await trail.read_page(log, [f.index()], f, size, None, time.monotonic() + 60,
                                 console_app.PAGE_BYTES, trail.is_request)
    t1 = time.perf_counter()
    await reviews.statuses(log, [trail.audit_id_of(r) for r in page.records])
    t2 = time.perf_counter()
    rows = await pages._rows(page.records, page.sealed)
    t3 = time.perf_counter()
    pages.env.get_template("search.html").render(
        officer=type("O", (), {"all_tenants": True, "name": "", "key_id": "k", "tenant": "t"})(), csrf="x",
        path="/search", form=console_app.Form({}), rows=rows, result=page, query={}, action_options=[],
        finish_options=[], size_options=[])
    t4 = time.perf_counter()
    return {"read_s": t1 - t0, "statuses_s": t2 - t1, "rows_s": t3 - t2, "render_s": t4 - t3,
            "rows": len(rows)}


async def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-console-") as tmp:
        valkey = EmbeddedValkey(Path(tmp) / "valkey", "everysec")
        url = await asyncio.to_thread(valkey.start)
        try:
            client = await connect(url, password=valkey.password)
            log = AuditLog(client, KEY)
            keys = KeyStore(client, b"s" * 32, 5.0, 1000)
            key, info = await keys.create("bank-0", "officer", "bench officer", all_tenants=True)
            started = time.perf_counter()
            await fill(log, args.conversations, info.key_id)
            filled_s = time.perf_counter() - started
            settings = Settings.load({"console_port": 0, "state_dir": tmp}, env={})
            console = console_app.Console(settings, log, keys, Sessions(client, keys, 900),
                                          Path(tmp) / "anchors", None)
            running = await start(console)
            assert valkey.process is not None
            valkey_pid = valkey.process.pid
            pages = console_app.Pages(console, console_app.environment())
            base = f"http://127.0.0.1:{running.port}"
            results = []
            load_before = os.getloadavg()
            async with httpx.AsyncClient(base_url=base, timeout=120) as http:
                cookie = await login(http, key)
                cases = [("every tenant", {}, Filters()), ("one tenant", {"tenant": "bank-1"},
                                                           Filters(tenant="bank-1")),
                         ("one rule", {"rule": "promissory-guaranteed-returns-en"},
                          Filters(rule_id="promissory-guaranteed-returns-en"))]
                for name, query, f in cases:
                    for size in (10000, 1000, 100):
                        wall, cpu, shown, size_bytes = [], [], 0, 0
                        for _ in range(args.runs):
                            t0, c0 = time.perf_counter(), time.process_time() + cpu_s(valkey_pid)
                            reply = await http.get("/search", params={**query, "page_size": size},
                                                   headers=cookie)
                            body = reply.content
                            wall.append(time.perf_counter() - t0)
                            cpu.append(time.process_time() + cpu_s(valkey_pid) - c0)
                            assert reply.status_code == 200, reply.text[:300]
                            shown, size_bytes = body.count(b'<tr><td>'), len(body)
                        split = await parts(pages, log, f, size)
                        results.append({"case": name, "page_size": size, "rows": shown,
                                        "html_bytes": size_bytes,
                                        "median_s": statistics.median(wall), "max_s": max(wall),
                                        "min_s": min(wall), "cpu_median_s": statistics.median(cpu),
                                        "runs": args.runs,
                                        **{k: round(v, 4) for k, v in split.items() if k != "rows"}})
            load_after = os.getloadavg()
            await running.stop()
            records = await client.zcard(index_key("kind", "review")) + 2 * args.conversations
            await client.aclose()
        finally:
            valkey.stop()
    return {"target_s": TARGET_S, "conversations": args.conversations, "records": records,
            "fill_s": round(filled_s, 1), "pages": results,
            "load_average_1_5_15": {"before": load_before, "after": load_after},
            "page_10000_under_target": all(r["median_s"] < TARGET_S and r["cpu_median_s"] < TARGET_S
                                           for r in results if r["page_size"] == 10000)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=12000)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    origin = provenance("bench_console", "2-core machine shared with other work; the console and "
                        "its client in one process, Valkey beside them, all on loopback")
    result = asyncio.run(run(args))
    print(f"{result['records']} records ({args.conversations} conversations); page wall time "
          f"request to last byte, {args.runs} runs; load average (1, 5, 15 min) before: "
          f"{result['load_average_1_5_15']['before']}")
    print(f"{'case':14} {'page':>6} {'rows':>6} {'KB':>6} {'median s':>9} {'min s':>6} {'max s':>6} "
          f"{'cpu s':>6} {'read':>6} {'status':>7} {'rows':>6} {'render':>7}")
    for r in result["pages"]:
        print(f"{r['case']:14} {r['page_size']:>6} {r['rows']:>6} {r['html_bytes'] // 1024:>6} "
              f"{r['median_s']:>9.3f} {r['min_s']:>6.3f} {r['max_s']:>6.3f} {r['cpu_median_s']:>6.3f} "
              f"{r['read_s']:>6.3f} {r['statuses_s']:>7.3f} {r['rows_s']:>6.3f} {r['render_s']:>7.3f}")
    verdict = "under" if result["page_10000_under_target"] else "NOT under"
    print(f"every page of 10,000: {verdict} {TARGET_S:g} s (median wall time, and median CPU time of "
          "this process and Valkey)")
    out = args.out or REPO / "bench" / "results" / "console" / f"{origin['date']}-page-10000.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(with_provenance(result, origin), indent=1) + "\n")
    print(f"wrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")
    return 0 if result["page_10000_under_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
