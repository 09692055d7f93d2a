"""Stripe's official Python SDK against a Stripe-shaped endpoint behind idempotency-http.

Run by ../clients.rs in the baked python-clients image:

    python3 - API_BASE < stripe_customer.py

Creates one customer with network retries on. The SDK sends an
`Idempotency-Key` of its own with the POST and, when the connection drops
before an answer, sends the same request with the same key again. Prints one
JSON object (the customer the SDK returned, the replay header) on stdout; the
Rust test asserts on it.
"""

import json
import sys

import requests
import stripe


def main():
    stripe.api_key = "sk_test_idempotency_rs"
    stripe.api_base = sys.argv[1]
    stripe.max_network_retries = 3
    stripe.enable_telemetry = False
    # No proxy between the container and the test server.
    stripe.default_http_client = stripe.RequestsClient(session=_session())
    try:
        customer = stripe.Customer.create(email="ada@example.com", name="Ada Lovelace")
    except stripe.StripeError as error:
        print(json.dumps({"error": type(error).__name__, "message": str(error)}))
        return
    headers = customer.last_response.headers
    print(
        json.dumps(
            {
                "id": customer.id,
                "object": customer.object,
                "email": customer.email,
                "name": customer.name,
                "class": type(customer).__name__,
                "replayed": headers.get("Idempotent-Replayed"),
                "versions": {"stripe": stripe.VERSION, "requests": requests.__version__},
            }
        )
    )


def _session():
    session = requests.Session()
    session.trust_env = False
    return session


if __name__ == "__main__":
    main()
