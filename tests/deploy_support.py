"""Shared stand-ins for the deployment tests: moto's server on loopback (a real AWS API on the wire),
the environment that points boto3 and s3fs at it, and capacity errors injected into RunInstances.

The AWS secret is a distinctive string so a test can assert it never appears in a tool result, the
registry file or a log.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

SECRET = "gemmax-test-secret-Zq81vT"  # AWS_SECRET_ACCESS_KEY for moto; must never be echoed
REGION = "us-east-1"


@contextlib.contextmanager
def moto_server() -> Iterator[dict[str, str]]:
    """moto in server mode on 127.0.0.1 (a free port); yields the environment boto3 and s3fs read."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield {"AWS_ACCESS_KEY_ID": "AKIATESTGEMMAX", "AWS_SECRET_ACCESS_KEY": SECRET,
               "AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_DEFAULT_REGION": REGION,
               "AWS_EC2_METADATA_DISABLED": "true"}
    finally:
        server.stop()


def inject_capacity_errors(client, failures: dict[str, str]) -> list[str]:
    """Make RunInstances on `client` fail in the given zones with the given EC2 error codes, as EC2
    answers when a zone has no capacity; the call never reaches the server for those zones. Returns
    the list of zones asked for, in order (every call, failed or not)."""
    from botocore.awsrequest import AWSResponse

    asked: list[str] = []

    def before_call(params, **_):
        zone = params["body"].get("Placement.AvailabilityZone")
        asked.append(zone)
        if zone in failures:
            code = failures[zone]
            parsed = {"Error": {"Code": code, "Message": f"We currently do not have sufficient capacity in the Availability Zone you requested ({zone})."},
                      "ResponseMetadata": {"HTTPStatusCode": 500}}
            return AWSResponse(params["url"], 500, {}, None), parsed
        return None

    client.meta.events.register("before-call.ec2.RunInstances", before_call)
    return asked


def inherited_pythonpath() -> dict[str, str]:
    """PYTHONPATH for a child server process, when this run has one (a checkout not installed)."""
    return {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}
