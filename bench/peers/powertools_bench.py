#!/usr/bin/env python3
"""Peer benchmark: AWS Lambda Powertools for Python idempotency on Redis.

Uses the idempotency utility the way a user would: a trivial handler wrapped in
``@idempotent`` (Lambda handler form, default) or ``@idempotent_function``
(generic worker form), with ``RedisCachePersistenceLayer`` and an
``IdempotencyConfig`` whose ``event_key_jmespath`` selects the key.

Sequential calls in one process (how a Lambda sandbox or a worker process runs
it), then the same with several processes side by side (``--processes``, default
1 and 2: a Python worker scales by processes, one per core). Two scenarios over
the same N keys:

* ``fresh``     -- N distinct keys, first time: the handler runs.
* ``duplicate`` -- the same N keys again: the stored reply is returned.

Per scenario: ops/s (N / wall time of the loop), p50/p99 latency per call, and
Redis round trips per op from ``INFO commandstats`` deltas (sum of ``calls``
over all commands except ``INFO`` itself, divided by N).

Run it through ``bench/peers/run.sh``, which sets up the pinned virtualenv.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

PEER_NAME = "aws-lambda-powertools-python"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379"
WORKSPACE_ROOT = Path(__file__).resolve().parent.parent.parent


def default_out() -> Path:
    target = os.environ.get("CARGO_TARGET_DIR")
    base = Path(target).resolve() if target else WORKSPACE_ROOT / "target"
    return base / "bench" / "peers.json"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--redis-url",
        default=os.environ.get("IDEMPOTENCY_BENCH_REDIS_URL") or DEFAULT_REDIS_URL,
        help="Redis URL (default: $IDEMPOTENCY_BENCH_REDIS_URL or %(default)s)",
    )
    p.add_argument("--keys", type=int, default=20000, help="distinct keys per scenario (default: %(default)s)")
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="warm-up keys, run fresh+duplicate before measuring (default: min(2000, keys/10), at least 100)",
    )
    p.add_argument(
        "--expiry-seconds",
        type=int,
        default=120,
        help="Powertools record expiry (IdempotencyConfig.expires_after_seconds), default %(default)s",
    )
    p.add_argument(
        "--decorator",
        choices=("idempotent", "idempotent_function"),
        default="idempotent",
        help="Lambda handler decorator (default) or the generic function decorator",
    )
    p.add_argument(
        "--processes",
        default="1,2",
        help="comma-separated process counts to run, each calling sequentially (default: %(default)s)",
    )
    p.add_argument("--out", type=Path, default=None, help="output JSON (default: <target>/bench/peers.json)")
    args = p.parse_args(argv)
    try:
        args.processes = [int(x) for x in args.processes.split(",") if x.strip()]
    except ValueError:
        p.error("--processes takes a list of integers, e.g. 1,2")
    if not args.processes or min(args.processes) < 1:
        p.error("--processes needs counts >= 1")
    if args.keys < 1:
        p.error("--keys must be >= 1")
    if args.warmup is None:
        args.warmup = max(100, min(2000, args.keys // 10))
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.expiry_seconds < 1:
        p.error("--expiry-seconds must be >= 1")
    if args.out is None:
        args.out = default_out()
    return args


class FakeLambdaContext:
    """Minimal stand-in for the Lambda context: the only thing idempotency reads
    from it is the remaining time, used to set the in-progress expiry."""

    function_name = "idempotency-bench-peer"
    memory_limit_in_mb = 1024
    invoked_function_arn = "arn:aws:lambda:us-east-1:000000000000:function:idempotency-bench-peer"
    aws_request_id = "00000000-0000-0000-0000-000000000000"

    def get_remaining_time_in_millis(self) -> int:
        return 300_000


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile on an already sorted list."""
    if not sorted_values:
        return float("nan")
    rank = max(1, int(-(-q * len(sorted_values) // 1)))  # ceil(q*n), at least 1
    return sorted_values[min(rank, len(sorted_values)) - 1]


def commandstats(client: Any) -> dict[str, int]:
    info = client.info("commandstats")
    out: dict[str, int] = {}
    for name, stats in info.items():
        cmd = name[len("cmdstat_"):] if name.startswith("cmdstat_") else name
        out[cmd.lower()] = int(stats["calls"])
    return out


def stats_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    delta = {}
    for cmd, calls in after.items():
        if cmd == "info":  # our own measurement calls
            continue
        d = calls - before.get(cmd, 0)
        if d:
            delta[cmd] = d
    return delta


def build(args: argparse.Namespace, run_id: str):
    """Build the decorated handler exactly as user code would, return (call, counter)."""
    with warnings.catch_warnings():
        # RedisCachePersistenceLayer is marked deprecated in favour of its alias
        # CachePersistenceLayer (same class); silence that one import-time warning.
        warnings.simplefilter("ignore", DeprecationWarning)
        from aws_lambda_powertools.utilities.idempotency import (
            IdempotencyConfig,
            idempotent,
            idempotent_function,
        )
        from aws_lambda_powertools.utilities.idempotency.persistence.redis import (
            RedisCachePersistenceLayer,
        )

        persistence = RedisCachePersistenceLayer(url=args.redis_url)

    config = IdempotencyConfig(
        event_key_jmespath="order_id",
        expires_after_seconds=args.expiry_seconds,
        raise_on_no_idempotency_key=True,
    )
    # Random namespace per run: every Redis key is "<key_prefix>#<md5>".
    key_prefix = f"idempotency-bench-peer:{run_id}"
    executed = {"n": 0}
    context = FakeLambdaContext()

    if args.decorator == "idempotent":

        @idempotent(persistence_store=persistence, config=config, key_prefix=key_prefix)
        def handler(event: dict, context: Any) -> dict:
            executed["n"] += 1
            return {"statusCode": 200, "order_id": event["order_id"]}

        def call(event: dict) -> Any:
            return handler(event, context)

    else:
        # Generic worker form; Powertools asks users to register the Lambda
        # context so in-progress records get an expiry (otherwise it warns on
        # every call and in-progress records only expire with the record TTL).
        config.register_lambda_context(context)

        @idempotent_function(
            data_keyword_argument="event",
            persistence_store=persistence,
            config=config,
            key_prefix=key_prefix,
        )
        def process(event: dict) -> dict:
            executed["n"] += 1
            return {"statusCode": 200, "order_id": event["order_id"]}

        def call(event: dict) -> Any:
            return process(event=event)

    return call, executed, persistence


def run_phase(
    call: Callable[[dict], Any], events: list[dict]
) -> tuple[float, list[float], list[Any]]:
    latencies_us: list[float] = []
    replies: list[Any] = []
    clock = time.perf_counter_ns
    append_lat = latencies_us.append
    append_reply = replies.append
    start = clock()
    for ev in events:
        t0 = clock()
        r = call(ev)
        t1 = clock()
        append_lat((t1 - t0) / 1000.0)
        append_reply(r)
    elapsed_s = (clock() - start) / 1e9
    return elapsed_s, latencies_us, replies


def worker(args: argparse.Namespace, run_id: str, index: int, slice_: list[dict], barrier: Any, out: Any) -> None:
    """One process of a multi-process phase pair: its own persistence layer and
    connection, a warm-up on keys of its own, then fresh and duplicate calls on
    its slice of the keys, each phase started and ended on the barrier."""
    call, executed, _persistence = build(args, run_id)
    warm = [{"order_id": f"{run_id}:warmup-w{index}:{i}", "amount": 42, "currency": "EUR"} for i in range(args.warmup)]
    run_phase(call, warm)
    run_phase(call, warm)
    for scenario in ("fresh", "duplicate"):
        barrier.wait()
        before = executed["n"]
        elapsed_s, lat, replies = run_phase(call, slice_)
        bad = sum(1 for ev, r in zip(slice_, replies) if not (isinstance(r, dict) and r.get("order_id") == ev["order_id"]))
        out.put((scenario, elapsed_s, lat, executed["n"] - before, bad))
        barrier.wait()


def run_processes(args: argparse.Namespace, run_id: str, processes: int, stats_client: Any) -> list[dict] | None:
    """Both scenarios with `processes` worker processes over the same keys
    split between them; ops/s over the phase's wall time (barrier to barrier)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(processes + 1)
    out = ctx.Queue()
    measured = [
        {"order_id": f"{run_id}:measure-p{processes}:{i}", "amount": 42, "currency": "EUR"} for i in range(args.keys)
    ]
    workers = [
        ctx.Process(target=worker, args=(args, run_id, w, measured[w::processes], barrier, out))
        for w in range(processes)
    ]
    for w in workers:
        w.start()
    rows = []
    try:
        for scenario in ("fresh", "duplicate"):
            before = commandstats(stats_client)
            barrier.wait()
            start = time.perf_counter()
            barrier.wait()
            elapsed_s = time.perf_counter() - start
            after = commandstats(stats_client)
            parts = [out.get(timeout=600) for _ in range(processes)]
            ran = sum(p[3] for p in parts if p[0] == scenario)
            bad = sum(p[4] for p in parts if p[0] == scenario)
            expected_runs = args.keys if scenario == "fresh" else 0
            if ran != expected_runs or bad:
                print(
                    f"{scenario} x{processes}: handler ran {ran} times (expected {expected_runs}), {bad} wrong replies",
                    file=sys.stderr,
                )
                return None
            lat = sorted(x for p in parts for x in p[2])
            delta = stats_delta(before, after)
            rows.append(
                {
                    "scenario": scenario,
                    "concurrency": processes,
                    "processes": processes,
                    "ops_per_sec": args.keys / elapsed_s,
                    "p50_us": percentile(lat, 0.50),
                    "p99_us": percentile(lat, 0.99),
                    "round_trips_per_op": sum(delta.values()) / args.keys,
                    "commands_per_op": {cmd: calls / args.keys for cmd, calls in sorted(delta.items())},
                }
            )
    finally:
        for w in workers:
            w.join(timeout=60)
    return rows


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if os.environ.get("POWERTOOLS_IDEMPOTENCY_DISABLED", "").strip().lower() in ("1", "true", "yes", "on", "y", "t"):
        print("POWERTOOLS_IDEMPOTENCY_DISABLED is set; unset it to benchmark idempotency.", file=sys.stderr)
        return 2

    import redis  # noqa: E402  (from the venv)
    from importlib.metadata import version as pkg_version

    pt_version = pkg_version("aws-lambda-powertools")
    redis_py_version = pkg_version("redis")

    stats_client = redis.Redis.from_url(args.redis_url)
    try:
        stats_client.ping()
        server_info = stats_client.info("server")
        clients_info = stats_client.info("clients")
    except redis.exceptions.RedisError as exc:
        print(f"cannot reach Redis at {args.redis_url}: {exc}", file=sys.stderr)
        return 2
    if int(clients_info.get("connected_clients", 1)) > 1:
        print(
            f"warning: {clients_info['connected_clients']} clients connected to Redis; other traffic "
            "inflates the round-trips-per-op numbers (commandstats is server-wide)",
            file=sys.stderr,
        )

    run_id = uuid.uuid4().hex[:12]
    call, executed, _persistence = build(args, run_id)

    def events(tag: str, n: int) -> list[dict]:
        return [{"order_id": f"{run_id}:{tag}:{i}", "amount": 42, "currency": "EUR"} for i in range(n)]

    # Warm-up: connection setup (redis-py sends CLIENT SETINFO on connect),
    # imports, JMESPath compilation, CPU caches; both code paths.
    if args.warmup:
        warm = events("warmup", args.warmup)
        run_phase(call, warm)
        run_phase(call, warm)

    measured = events("measure", args.keys)
    results = []
    commands: dict[str, dict[str, float]] = {}
    for scenario in ("fresh", "duplicate"):
        executed_before = executed["n"]
        before = commandstats(stats_client)
        elapsed_s, lat, replies = run_phase(call, measured)
        after = commandstats(stats_client)
        ran = executed["n"] - executed_before

        # Sanity: fresh must run the handler for every key, duplicate for none,
        # and duplicates must return the stored reply.
        expected_runs = args.keys if scenario == "fresh" else 0
        if ran != expected_runs:
            print(f"{scenario}: handler ran {ran} times, expected {expected_runs}", file=sys.stderr)
            return 1
        bad = sum(1 for ev, r in zip(measured, replies) if not (isinstance(r, dict) and r.get("order_id") == ev["order_id"]))
        if bad:
            print(f"{scenario}: {bad} replies did not match their key", file=sys.stderr)
            return 1

        delta = stats_delta(before, after)
        lat.sort()
        rt = sum(delta.values()) / args.keys
        commands[scenario] = {cmd: calls / args.keys for cmd, calls in sorted(delta.items())}
        results.append(
            {
                "scenario": scenario,
                "concurrency": 1,
                "processes": 1,
                "ops_per_sec": args.keys / elapsed_s,
                "p50_us": percentile(lat, 0.50),
                "p99_us": percentile(lat, 0.99),
                "round_trips_per_op": rt,
                # Extra (not needed by compare.py): Redis commands per op by name.
                "commands_per_op": commands[scenario],
            }
        )

    for processes in args.processes:
        if processes == 1:
            continue
        rows = run_processes(args, run_id, processes, stats_client)
        if rows is None:
            return 1
        results.extend(rows)

    parts = urlsplit(args.redis_url)
    host = parts.hostname or "?"
    redis_url_host = f"{host}:{parts.port or 6379}"
    doc = {
        "peer": PEER_NAME,
        "version": pt_version,
        "python": platform.python_version(),
        "redis_url_host": redis_url_host,
        "keys": args.keys,
        "results": results,
        # Extra context (ignored by compare.py).
        "details": {
            "redis_py": redis_py_version,
            "redis_server": server_info.get("redis_version"),
            "decorator": args.decorator,
            "persistence_layer": "RedisCachePersistenceLayer",
            "event_key_jmespath": "order_id",
            "expires_after_seconds": args.expiry_seconds,
            "warmup_keys": args.warmup,
            "use_local_cache": False,
            "run_id": run_id,
            "implementation": platform.python_implementation(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(args.out.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(args.out)

    print(f"{PEER_NAME} {pt_version} (Python {doc['python']}, redis-py {redis_py_version}) against {redis_url_host}, "
          f"{args.keys} keys, decorator @{args.decorator}")
    for r in results:
        cmds = ", ".join(f"{c.upper()} {v:.2f}" for c, v in r["commands_per_op"].items())
        print(
            f"  {r['scenario']:<9} x{r['processes']} {r['ops_per_sec']:>10.0f} ops/s  p50 {r['p50_us']:>8.1f} us  "
            f"p99 {r['p99_us']:>8.1f} us  round trips/op {r['round_trips_per_op']:.2f} ({cmds})"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
