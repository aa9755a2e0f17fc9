"""A DDP replica that trains with a GoodputReporter attached (spawned by tests/test_reporter.py; lean imports)."""

from __future__ import annotations

import torch

from profilers.reporter import GoodputReporter


def train_ddp(rank: int, world: int, port: int, url: str, folder: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    reporter = GoodputReporter("mlp-ddp", url, init_batch_size=32, buffer_dir=folder, flush_interval=0.2, warmup_steps=2)
    reporter.attach(model)
    generator = torch.Generator().manual_seed(rank)
    w = torch.linspace(-1, 1, 16).unsqueeze(1)
    for _ in range(30):
        x = torch.randn(16, 16, generator=generator)
        y = x @ w + 0.5 * torch.randn(16, 1, generator=generator)
        with reporter.step(local_bsz=16):
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    reporter.close()
    dist.destroy_process_group()
