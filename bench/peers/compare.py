#!/usr/bin/env python3
"""Side-by-side table: AWS Lambda Powertools (Python) vs idempotency-rs on Redis.

Reads the peer results (``peers.json``, written by ``powertools_bench.py``) and
ours (``results.json``, written by ``idempotency-bench``), prints a Markdown
table and writes it to ``peers.md``. Standard library only.

Ours: rows with backend "redis" and variant "library", at concurrency 1 and 64.
If our results are missing, the peer numbers are still printed, with a hint on
how to produce ours.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

WORKSPACE_ROOT = Path(__file__).resolve().parent.parent.parent
SCENARIOS = ("fresh", "duplicate")
OUR_CONCURRENCIES = (1, 64)


def target_dir() -> Path:
    target = os.environ.get("CARGO_TARGET_DIR")
    return Path(target).resolve() if target else WORKSPACE_ROOT / "target"


def parse_args(argv: list[str]) -> argparse.Namespace:
    bench = target_dir() / "bench"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=Path, default=bench / "peers.json", help="peer results (default: %(default)s)")
    p.add_argument("--ours", type=Path, default=bench / "results.json", help="our results (default: %(default)s)")
    p.add_argument("--out", type=Path, default=bench / "peers.md", help="Markdown output (default: %(default)s)")
    p.add_argument(
        "--redis-url",
        default=os.environ.get("IDEMPOTENCY_BENCH_REDIS_URL") or "redis://127.0.0.1:6379",
        help="only used in the hint printed when our results are missing",
    )
    p.add_argument("--no-hint", action="store_true", help="do not print the hint when our results are missing")
    return p.parse_args(argv)


def num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return None if math.isnan(v) or math.isinf(v) else v


def fmt_ops(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.0f}"


def fmt_us(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.1f}"


def fmt_rt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def fmt_ratio(ours: float | None, peer: float | None) -> str:
    if ours is None or peer is None or peer <= 0:
        return "n/a"
    return f"{ours / peer:.1f}x"


def load_json(path: Path, what: str) -> Any:
    try:
        with path.open() as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:
        print(f"error: cannot read {what} {path}: {exc}", file=sys.stderr)
        sys.exit(1)


def peer_row(peers: dict, scenario: str, processes: int = 1) -> dict | None:
    for r in peers.get("results", []):
        if r.get("scenario") == scenario and r.get("processes", r.get("concurrency", 1)) == processes:
            return r
    return None


def peer_processes(peers: dict) -> list[int]:
    """The process counts the peer ran with more than one process."""
    counts = {r.get("processes", r.get("concurrency", 1)) for r in peers.get("results", [])}
    return sorted(c for c in counts if isinstance(c, int) and c > 1)


def our_row(ours: dict | None, scenario: str, concurrency: int) -> dict | None:
    if not ours:
        return None
    matches = [
        r
        for r in ours.get("results", [])
        if r.get("backend") == "redis"
        and r.get("variant") == "library"
        and r.get("scenario") == scenario
        and r.get("concurrency") == concurrency
    ]
    if len(matches) > 1:
        print(
            f"warning: {len(matches)} rows for redis/library/{scenario}/c={concurrency} in our results; using the first",
            file=sys.stderr,
        )
    return matches[0] if matches else None


def get(row: dict | None, field: str) -> float | None:
    return None if row is None else num(row.get(field))


def render(peers: dict, ours: dict | None, peers_path: Path, ours_path: Path) -> str:
    lines: list[str] = []
    ver = peers.get("version", "?")
    lines.append("## Peer comparison: idempotency-rs vs AWS Lambda Powertools for Python (Redis)")
    lines.append("")
    lines.append(
        f"Peer: `{peers.get('peer', '?')}` {ver}, Python {peers.get('python', '?')}, "
        f"Redis {peers.get('redis_url_host', '?')}, {peers.get('keys', '?')} keys, sequential calls per process."
    )
    if ours is not None:
        our_keys = (ours.get("config") or {}).get("keys")
        lines.append(f"Ours: `{ours_path}` (backend `redis`, variant `library`).")
        if our_keys is not None and our_keys != peers.get("keys"):
            lines.append(f"Note: key counts differ (ours {our_keys}, peer {peers.get('keys')}).")
    else:
        lines.append(f"Ours: not found at `{ours_path}`; only the peer numbers are shown.")
    lines.append("")

    header = (
        "| scenario | Powertools ops/s | ours c=1 ops/s | ours/peer c=1 | ours c=64 ops/s | ours/peer c=64 "
        "| round trips/op Powertools | round trips/op ours c=1 | round trips/op ours c=64 |"
    )
    lines.append(header)
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for sc in SCENARIOS:
        p = peer_row(peers, sc)
        o1 = our_row(ours, sc, 1)
        o64 = our_row(ours, sc, 64)
        pops = get(p, "ops_per_sec")
        lines.append(
            "| "
            + " | ".join(
                [
                    sc,
                    fmt_ops(pops),
                    fmt_ops(get(o1, "ops_per_sec")),
                    fmt_ratio(get(o1, "ops_per_sec"), pops),
                    fmt_ops(get(o64, "ops_per_sec")),
                    fmt_ratio(get(o64, "ops_per_sec"), pops),
                    fmt_rt(get(p, "round_trips_per_op")),
                    fmt_rt(get(o1, "round_trips_per_op")),
                    fmt_rt(get(o64, "round_trips_per_op")),
                ]
            )
            + " |"
        )
    multi = peer_processes(peers)
    if multi:
        lines.append("")
        lines.append(
            "At each side's natural concurrency: ours with 64 tasks in one process, Powertools with "
            + ", ".join(str(n) for n in multi)
            + " Python processes calling sequentially (one per core is how a Python worker scales):"
        )
        lines.append("")
        lines.append("| scenario | Powertools processes | Powertools ops/s | ours c=64 ops/s | ours/peer |")
        lines.append("|---|---:|---:|---:|---:|")
        for sc in SCENARIOS:
            o64 = our_row(ours, sc, 64)
            for n in [1] + multi:
                pops = get(peer_row(peers, sc, n), "ops_per_sec")
                lines.append(
                    f"| {sc} | {n} | {fmt_ops(pops)} | {fmt_ops(get(o64, 'ops_per_sec'))} "
                    f"| {fmt_ratio(get(o64, 'ops_per_sec'), pops)} |"
                )
    lines.append("")
    lines.append("Latency per call (µs), sequential (Powertools) vs ours at concurrency 1:")
    lines.append("")
    lines.append("| scenario | Powertools p50 | Powertools p99 | ours c=1 p50 | ours c=1 p99 |")
    lines.append("|---|---:|---:|---:|---:|")
    for sc in SCENARIOS:
        p = peer_row(peers, sc)
        o1 = our_row(ours, sc, 1)
        lines.append(
            f"| {sc} | {fmt_us(get(p, 'p50_us'))} | {fmt_us(get(p, 'p99_us'))} "
            f"| {fmt_us(get(o1, 'p50_us'))} | {fmt_us(get(o1, 'p99_us'))} |"
        )
    lines.append("")
    lines.append(
        "Powertools is one Python process calling sequentially (how a Lambda sandbox or worker runs it); "
        "compare it with ours at c=1. c=64 shows what one process of ours does with concurrent callers, "
        "which a single Powertools process cannot do. Powertools round trips/op are Redis `INFO commandstats` deltas "
        "(commands issued per call; Powertools never pipelines, so each command is one round trip)."
    )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    peers = load_json(args.peers, "peer results")
    if peers is None:
        print(f"error: peer results not found at {args.peers} (run bench/peers/run.sh)", file=sys.stderr)
        return 1
    ours = load_json(args.ours, "our results")
    md = render(peers, ours, args.peers, args.ours)
    print(md)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(md)
    print(f"wrote {args.out}", file=sys.stderr)
    if ours is None:
        if not args.no_hint:
            print(
                f"hint: our results are missing ({args.ours}); produce them with:\n"
                f"  cargo run --release -p idempotency-bench -- --backends redis --redis-url {args.redis_url}",
                file=sys.stderr,
            )
    elif not any(our_row(ours, sc, c) for sc in SCENARIOS for c in OUR_CONCURRENCIES):
        print(
            f"warning: {args.ours} has no backend=redis variant=library rows at concurrency 1 or 64",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
