"""A training loop that reports its own step times to ``goodput serve`` as it trains.

Run it on one process or under torchrun (each replica runs this script; rank 0 reports, the
DDP hook measures the gradient noise and each step's exposed sync)::

    goodput serve --port 8470 &                                   # the service (sqlite:///goodput.db)
    python examples/train_with_reporter.py --server http://127.0.0.1:8470 --steps 200
    torchrun --nproc-per-node 2 examples/train_with_reporter.py --server http://127.0.0.1:8470
    goodput table --server http://127.0.0.1:8470 --job example-mlp --cluster cpu:2x2

The model is the zoo's MLP (profilers.zoo), trained for real with SGD on its synthetic task.
If the service is down, the reporter keeps the observations in ~/.cache/goodput/reporter and
sends them when it is back (also from a later run).
"""

from __future__ import annotations

import argparse
import os

import torch

from profilers import zoo
from profilers.reporter import GoodputReporter


def _count(minimum: int):
    """An argparse type: a whole number >= ``minimum`` (argparse reports anything else in one line)."""
    def parse(text: str) -> int:
        value = int(text)  # a ValueError: argparse's "invalid value"
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text}")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default="http://127.0.0.1:8470")
    parser.add_argument("--job", default="example-mlp")
    parser.add_argument("--steps", type=_count(0), default=200)
    parser.add_argument("--local-bsz", type=_count(1), default=64)
    parser.add_argument("--buffer-dir", help="the reporter's buffer (default ~/.cache/goodput/reporter)")
    parser.add_argument("--token", default=os.environ.get("GOODPUT_TOKEN"))
    args = parser.parse_args(argv)

    distributed = "WORLD_SIZE" in os.environ  # torchrun
    if distributed:
        torch.distributed.init_process_group("gloo")
    work = zoo.get("mlp")
    model = work.model
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = work.optimizer_factory(model.parameters())

    reporter = GoodputReporter(args.job, args.server, token=args.token, init_batch_size=work.init_batch_size,
                               max_batch_size=work.max_batch_size, buffer_dir=args.buffer_dir)
    if distributed:
        reporter.attach(model)  # gradient noise and sync time from DDP's all-reduce
    for _ in range(args.steps):
        batch = work.make_batch(args.local_bsz, "cpu")
        with reporter.step(local_bsz=args.local_bsz):
            optimizer.zero_grad()
            work.loss_fn(model, batch).backward()
            optimizer.step()
    left = reporter.close()
    if reporter.active:
        print(f"{args.job}: {reporter.sent} observations sent, {left} kept in {reporter.buffer_path} for later")
    if distributed:
        # together: a rank that tears gloo down while rank 0 still sends its last report can abort
        # ("terminate called without an active exception", SIGABRT)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
