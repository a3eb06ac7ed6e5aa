"""``python -m prefill_worker --model-dir DIR --worker-id ID ...``: one prefill worker process."""

import argparse

from deploy.args import add_config_args, config_from_args
from deploy.service import run_foreground
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.server import PrefillWorker

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m prefill_worker", description=__doc__)
    add_config_args(parser, PrefillWorkerConfig)
    cfg = config_from_args(PrefillWorkerConfig, parser.parse_args())
    run_foreground(lambda: PrefillWorker(cfg))
