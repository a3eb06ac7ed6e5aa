"""``python -m router --model-dir DIR ...``: the router process."""

import argparse

from deploy.args import add_config_args, config_from_args
from deploy.service import run_foreground
from router.config import RouterConfig
from router.server import Router

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m router", description=__doc__)
    add_config_args(parser, RouterConfig)
    cfg = config_from_args(RouterConfig, parser.parse_args())
    run_foreground(lambda: Router(cfg))
