"""Python's `requests` with urllib3's `Retry` against idempotency-http.

Run by ../clients.rs in the baked python-clients image:

    python3 - SCENARIO BASE_URL KEY < requests_retry.py

and prints one JSON object (what each client saw) on stdout; the Rust test
asserts on it. Scenarios:

- in-flight: two clients send the same POST with the same key at once. One
  runs the handler; the other is answered 409 + Retry-After and retries.
- not-retained: a POST whose response body the layer could not keep, then its
  retry with the same key, which must be answered at once, without retries.
"""

import json
import sys
import threading
import time

import requests
import urllib3
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry


class BoundedRetry(Retry):
    """urllib3's Retry, its backoff capped at half a second (waits a
    `Retry-After` asks for are not capped): a run that retries all ten times
    ends in seconds, not the minute that doubling 0.05 s ten times adds up to."""

    DEFAULT_BACKOFF_MAX = 0.5


def retrying_session():
    """The retry policy a careful client configures for idempotent POSTs."""
    retry = BoundedRetry(
        total=10,
        backoff_factor=0.05,
        status_forcelist=[409, 503],
        respect_retry_after_header=True,
        allowed_methods=None,  # every method, POST included
        raise_on_status=False,
    )
    session = requests.Session()
    session.trust_env = False  # no proxy between the container and the test server
    session.mount("http://", HTTPAdapter(max_retries=retry))
    return session


def outcome(response, started):
    """What a client saw: the final answer, and the answers it retried on."""
    retries = response.raw.retries
    history = [entry.status for entry in retries.history] if retries is not None else []
    try:
        body = response.json()
    except ValueError:
        body = None
    return {
        "status": response.status_code,
        "headers": {name.lower(): value for name, value in response.headers.items()},
        "body": body,
        "body_len": len(response.content),
        "retried_on": history,
        "attempts": len(history) + 1,
        "elapsed_s": round(time.monotonic() - started, 3),
    }


def post(session, url, key, body, content_type="application/json"):
    started = time.monotonic()
    try:
        response = session.post(
            url,
            data=body,
            headers={"Idempotency-Key": key, "Content-Type": content_type},
            timeout=30,
        )
    except requests.RequestException as error:
        return {"error": type(error).__name__, "message": str(error)}
    return outcome(response, started)


def in_flight(base, key):
    barrier = threading.Barrier(2)
    results = [None, None]

    def client(index):
        session = retrying_session()
        barrier.wait()
        results[index] = post(session, base + "/orders", key, b'{"sku":"book","quantity":1}')

    threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"clients": results}


def not_retained(base, key):
    session = retrying_session()
    first = post(session, base + "/exports", key, b'{"report":"all"}')
    retry = post(session, base + "/exports", key, b'{"report":"all"}')
    return {"first": first, "retry": retry}


def main():
    scenario, base, key = sys.argv[1:4]
    run = {"in-flight": in_flight, "not-retained": not_retained}[scenario]
    result = run(base, key)
    result["versions"] = {"requests": requests.__version__, "urllib3": urllib3.__version__}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
