"""``pdserve scale``, ``pdserve status`` and ``pdserve down``: operating a running cluster.

``scale`` attaches to the Ray cluster as a second driver (``ray.init(address="auto")``) and
calls the cluster's named controller (:mod:`deploy.controller`); ``status`` reads Redis only
(:mod:`deploy.status`: one cluster's registry, or without ``--cluster`` the launch records of every
running cluster); ``down`` stops a cluster (detached or not) and removes its Redis keys
(:func:`deploy.ray_cluster.teardown`).
"""

from __future__ import annotations

import argparse
import sys

from pdserve.cluster.args import default_redis_url
from pdserve.cluster.registry import redact_url


def add_commands(sub) -> None:
    """Add the ``scale`` and ``status`` subcommands to ``pdserve``'s subparsers."""
    scale = sub.add_parser("scale", help="resize the pools of a running cluster (new workers serve once "
                                         "registered; removed ones drain)")
    scale.add_argument("--cluster", required=True, help="the id `pdserve up` printed")
    scale.add_argument("--ray-address", default=None,
                       help="the Ray cluster `pdserve up` runs on (default: the one it recorded in Redis, else auto)")
    scale.add_argument("--redis-url", default=default_redis_url(), help="registry (env PDSERVE_REDIS_URL)")
    scale.add_argument("--prefill", type=int, default=None, help="prefill workers")
    scale.add_argument("--decode", type=int, default=None, help="decode workers")
    scale.add_argument("--colocated", type=int, default=None, help="colocated workers (a --colocated cluster)")
    scale.add_argument("--remove", action="append", default=[], metavar="WORKER_ID",
                       help="drain this worker first when its pool shrinks (repeatable)")
    scale.add_argument("--drain-timeout", type=float, default=None,
                       help="seconds removed workers' in-flight requests get (default: the cluster's)")
    scale.set_defaults(func=cmd_scale)

    status = sub.add_parser("status", help="pools, each worker's load, free KV blocks and lease age")
    status.add_argument("--cluster", default=None,
                        help="the id `pdserve up` printed (default: list the running clusters)")
    status.add_argument("--redis-url", default=default_redis_url(), help="registry (env PDSERVE_REDIS_URL)")
    status.set_defaults(func=cmd_status)

    down = sub.add_parser("down", help="drain and remove a cluster (e.g. one `pdserve up --detach` left running), "
                                       "its Redis keys, and the local Ray head its `up` started")
    down.add_argument("--cluster", required=True, help="the id `pdserve up` printed")
    down.add_argument("--ray-address", default=None,
                      help="the Ray cluster it runs on (default: the one its `up` recorded in Redis)")
    down.add_argument("--redis-url", default=default_redis_url(), help="registry (env PDSERVE_REDIS_URL)")
    down.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for its actors to stop")
    down.set_defaults(func=cmd_down)


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
        from pdserve.deploy.ray_cluster import read_launches
        from pdserve.deploy.ray_local import connect

        if args.ray_address is None:
            try:
                args.ray_address = read_launches(args.redis_url, args.cluster).get(args.cluster, {}).get("ray_address")
            except Exception:  # Redis unreachable: fall back to the local Ray
                pass
        connect(args.ray_address or "auto", log_to_driver=False, configure_logging=False)
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
    """Print the pools table (or, without ``--cluster``, the running clusters); exit 1 when Redis is unreachable."""
    import redis

    from pdserve.deploy.status import clusters_text, status_text

    try:
        print(status_text(args.redis_url, args.cluster) if args.cluster else clusters_text(args.redis_url))
    except redis.RedisError as exc:
        print(f"error: registry at {redact_url(args.redis_url)} unreachable: {exc}", file=sys.stderr)
        return 1
    return 0




def cmd_down(args: argparse.Namespace) -> int:
    """Stop the cluster and remove its Redis keys; exit 0, 1 (no such cluster, or it did not stop)."""
    import redis

    from pdserve.deploy.ray_cluster import teardown

    try:
        found = teardown(args.cluster, args.redis_url, args.ray_address, timeout_s=args.timeout)
    except redis.RedisError as exc:
        print(f"error: registry at {redact_url(args.redis_url)} unreachable: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not found:
        print(f"error: no running cluster {args.cluster!r} found (its Redis keys, if any, were removed)",
              file=sys.stderr)
        return 1
    print(f"cluster {args.cluster} is down")
    return 0
