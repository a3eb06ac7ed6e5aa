"""``python -m pdserve.router --model-dir DIR ...``: the router process. With ``--http-port`` it
prints ``http <host:port>`` (the OpenAI-compatible HTTP API) before its ``ready <host:port>`` line."""

import argparse

from pdserve.cluster.args import add_config_args, config_from_args
from pdserve.cluster.logs import add_logging_args
from pdserve.cluster.service import run_foreground
from pdserve.router.config import RouterConfig
from pdserve.router.server import Router


class _Announced:
    """The router, printing the HTTP API's address once it serves (``ready`` follows from run_foreground)."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.router = Router(cfg)

    async def start(self) -> str:
        address = await self.router.start()
        if self.router.http_address:
            print(f"http {self.router.http_address}", flush=True)
        return address

    async def stop(self) -> None:
        await self.router.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m pdserve.router", description=__doc__)
    add_config_args(parser, RouterConfig)
    add_logging_args(parser)
    args = parser.parse_args()
    cfg = config_from_args(RouterConfig, args, parser)
    run_foreground(lambda: _Announced(cfg), args.log_format, args.log_level)
