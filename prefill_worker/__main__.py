"""``python -m pdserve.prefill_worker --model-dir DIR --worker-id ID ...``: one prefill worker process."""

import argparse

from pdserve.cluster.args import add_config_args, config_from_args
from pdserve.cluster.logs import add_logging_args
from pdserve.cluster.worker_config import add_no_warmup_flag
from pdserve.prefill_worker.config import PrefillWorkerConfig

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m pdserve.prefill_worker", description=__doc__)
    add_config_args(parser, PrefillWorkerConfig)
    add_no_warmup_flag(parser)
    add_logging_args(parser)
    args = parser.parse_args()
    cfg = config_from_args(PrefillWorkerConfig, args, parser)
    from pdserve.cluster.service import run_foreground  # the engine and torch load for a valid command line only
    from pdserve.prefill_worker.server import PrefillWorker

    run_foreground(lambda: PrefillWorker(cfg), args.log_format, args.log_level)
