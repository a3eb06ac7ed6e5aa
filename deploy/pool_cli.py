"""``pdserve scale`` and ``pdserve status``: operating the pools of a running cluster.

``scale`` attaches to the Ray cluster as a second driver (``ray.init(address="auto")``) and
calls the cluster's named controller (:mod:`deploy.controller`); ``status`` reads the Redis
registry only (:mod:`deploy.status`).
"""

from __future__ import annotations

import argparse
import sys

from pdserve.cluster.registry import redact_url
from pdserve.cluster.worker_process import default_redis_url


def add_commands(sub) -> None:
    """Add the ``scale`` and ``status`` subcommands to ``pdserve``'s subparsers."""
    scale = sub.add_parser("scale", help="resize the pools of a running cluster (new workers serve once "
                                         "registered; removed ones drain)")
    scale.add_argument("--cluster", required=True, help="the id `pdserve up` printed")
    scale.add_argument("--ray-address", default="auto", help="the Ray cluster `pdserve up` runs on")
    scale.add_argument("--prefill", type=int, default=None, help="prefill workers")
    scale.add_argument("--decode", type=int, default=None, help="decode workers")
    scale.add_argument("--colocated", type=int, default=None, help="colocated workers (a --colocated cluster)")
    scale.add_argument("--remove", action="append", default=[], metavar="WORKER_ID",
                       help="drain this worker first when its pool shrinks (repeatable)")
    scale.add_argument("--drain-timeout", type=float, default=None,
                       help="seconds removed workers' in-flight requests get (default: the cluster's)")
    scale.set_defaults(func=cmd_scale)

    status = sub.add_parser("status", help="pools, each worker's load, free KV blocks and lease age")
    status.add_argument("--cluster", required=True, help="the id `pdserve up` printed")
    status.add_argument("--redis-url", default=default_redis_url(), help="registry (env PDSERVE_REDIS_URL)")
    status.set_defaults(func=cmd_status)


def cmd_scale(args: argparse.Namespace) -> int:
    """Resize pools through the named controller; exit 0, 1 (refused or failed, reason on stderr)
    or 2 (no size given)."""
    import ray

    from pdserve.deploy.config import NAMESPACE, controller_name

    sizes = {role: n for role, n in (("prefill", args.prefill), ("decode", args.decode), ("both", args.colocated))
             if n is not None}
    if not sizes:
        print("error: give --prefill, --decode (or --colocated) pool sizes", file=sys.stderr)
        return 2
    if not ray.is_initialized():
        ray.init(address=args.ray_address, log_to_driver=False, configure_logging=False)
    try:
        controller = ray.get_actor(controller_name(args.cluster), namespace=NAMESPACE)
    except ValueError:
        print(f"error: no pdserve cluster {args.cluster!r} on the Ray cluster at {args.ray_address}", file=sys.stderr)
        return 1
    try:
        result = ray.get(controller.scale.remote(sizes, args.remove, args.drain_timeout))
    except ray.exceptions.RayTaskError as exc:
        print(f"error: {exc.cause}", file=sys.stderr)
        return 1
    for key in ("added", "removed"):
        if result[key]:
            print(f"{key}: {', '.join(result[key])}")
    print("pools: " + "; ".join(f"{role} {len(ids)} ({', '.join(ids)})" for role, ids in result["pools"].items()))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Print the pools table; exit 1 when Redis is unreachable."""
    import redis

    from pdserve.deploy.status import status_text

    try:
        print(status_text(args.redis_url, args.cluster))
    except redis.RedisError as exc:
        print(f"error: registry at {redact_url(args.redis_url)} unreachable: {exc}", file=sys.stderr)
        return 1
    return 0


