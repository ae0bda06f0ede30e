"""What a deployment costs, and the guard rails that refuse one beyond the operator's caps.

On-demand prices are a table of the common GPU instance types (USD per hour, us-east-1, Linux, as
AWS listed them when this table was written; other regions differ by up to ~30%). A spot instance
is priced from the EC2 spot price history of its zone at launch (`DescribeSpotPriceHistory`).

The guard rails count from the registry: instances not yet ended against a cap on concurrent
instances, and instance-hours (the hours of ended deployments over the last 30 days, plus the hours
each live one was allowed at launch, plus the new one's) against a cap on instance-hours. A launch
beyond either is refused with the arithmetic. Caps: $GEMMAX_DEPLOY_MAX_INSTANCES (default 2) and
$GEMMAX_DEPLOY_MAX_INSTANCE_HOURS (default 24), or given per call.
"""

from __future__ import annotations

import dataclasses
import os
import time

from gemmax.deploy.errors import DeployError
from gemmax.deploy.registry import RemoteDeployment

# USD / hour, on demand, us-east-1, Linux. GPU: g4dn T4, g5 A10G, g6 L4, g6e L40S, p4d A100, p5 H100.
ON_DEMAND_USD: dict[str, float] = {
    "g4dn.xlarge": 0.526, "g4dn.2xlarge": 0.752, "g4dn.4xlarge": 1.204, "g4dn.8xlarge": 2.176,
    "g4dn.12xlarge": 3.912, "g4dn.16xlarge": 4.352,
    "g5.xlarge": 1.006, "g5.2xlarge": 1.212, "g5.4xlarge": 1.624, "g5.12xlarge": 5.672,
    "g6.xlarge": 0.8048, "g6.2xlarge": 0.9776, "g6.4xlarge": 1.3232, "g6.12xlarge": 4.6016,
    "g6e.xlarge": 1.861, "g6e.2xlarge": 2.24208, "g6e.12xlarge": 10.49264,
    "p4d.24xlarge": 21.96, "p5.48xlarge": 55.04,
}
GPU_OF = {"g4dn": "NVIDIA T4 16 GB", "g5": "NVIDIA A10G 24 GB", "g6": "NVIDIA L4 24 GB", "g6e": "NVIDIA L40S 48 GB",
          "p4d": "8x NVIDIA A100 40 GB", "p5": "8x NVIDIA H100 80 GB"}
WINDOW_S = 30 * 24 * 3600  # ended deployments count against the hours cap for 30 days


def on_demand_price(instance_type: str) -> float | None:
    return ON_DEMAND_USD.get(instance_type)


def spot_price(ec2, instance_type: str, zone: str) -> float | None:
    """The latest spot price of `instance_type` in `zone` (Linux/UNIX), or None when EC2 lists none."""
    history = ec2.describe_spot_price_history(InstanceTypes=[instance_type], AvailabilityZone=zone,
                                              ProductDescriptions=["Linux/UNIX"], MaxResults=20)
    prices = sorted(history.get("SpotPriceHistory", []), key=lambda p: p["Timestamp"], reverse=True)
    return float(prices[0]["SpotPrice"]) if prices else None


@dataclasses.dataclass(frozen=True)
class Caps:
    max_instances: int
    max_instance_hours: float

    @classmethod
    def from_env(cls, max_instances: int | None = None, max_instance_hours: float | None = None) -> Caps:
        return cls(max_instances if max_instances is not None else int(os.environ.get("GEMMAX_DEPLOY_MAX_INSTANCES", 2)),
                   max_instance_hours if max_instance_hours is not None
                   else float(os.environ.get("GEMMAX_DEPLOY_MAX_INSTANCE_HOURS", 24)))


def check_caps(records: list[RemoteDeployment], planned_hours: float, caps: Caps, now: float | None = None) -> None:
    """Refuse (DeployError with the arithmetic) an AWS launch of `planned_hours` beyond the caps."""
    now = now or time.time()
    aws = [r for r in records if r.target == "aws"]
    live = [r for r in aws if r.active]
    if len(live) + 1 > caps.max_instances:
        raise DeployError(
            f"launch refused: {len(live)} instance(s) live ({', '.join(r.name for r in live)}) + 1 requested = "
            f"{len(live) + 1} > cap of {caps.max_instances} concurrent instances "
            "(terminate one, or raise GEMMAX_DEPLOY_MAX_INSTANCES)")
    ended = sum(r.hours(now) for r in aws if not r.active and r.created > now - WINDOW_S)
    committed = sum(max(r.planned_hours, r.hours(now)) for r in live)
    total = ended + committed + planned_hours
    if total > caps.max_instance_hours:
        raise DeployError(
            f"launch refused: {ended:.2f} h used by ended deployments (30 days) + {committed:.2f} h allowed to "
            f"{len(live)} live + {planned_hours:.2f} h requested = {total:.2f} instance-hours > cap of "
            f"{caps.max_instance_hours:.2f} (raise GEMMAX_DEPLOY_MAX_INSTANCE_HOURS, or ask for fewer hours)")


def cost_of(record: RemoteDeployment, now: float | None = None) -> dict[str, object]:
    """Instance-hours so far and their cost at the recorded price."""
    hours = record.hours(now)
    price = record.aws.price_per_hour if record.aws else None
    return {"name": record.name, "target": record.target, "state": record.state,
            "instance_type": record.aws.instance_type if record.aws else None,
            "gpu": GPU_OF.get(record.aws.instance_type.split(".")[0]) if record.aws else None,
            "market": record.aws.market if record.aws else None,
            "instance_hours": round(hours, 4), "price_per_hour": price,
            "price_source": record.aws.price_source if record.aws else None,
            "cost_usd": round(hours * price, 4) if price is not None else None}
