"""``python -m pdserve.router --model-dir DIR ...``: the router process."""

import argparse

from pdserve.cluster.args import add_config_args, config_from_args
from pdserve.cluster.service import run_foreground
from pdserve.router.config import RouterConfig
from pdserve.router.server import Router

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m pdserve.router", description=__doc__)
    add_config_args(parser, RouterConfig)
    cfg = config_from_args(RouterConfig, parser.parse_args())
    run_foreground(lambda: Router(cfg))
