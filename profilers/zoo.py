"""A small built-in zoo of training jobs, written with plain ``torch.nn`` (no torchvision).

Each factory returns a :class:`Workload`: the pieces :func:`profilers.profile_job`
takes (a model, an optimizer factory, a loss function, a batch factory) plus the
job's name and reference batch size. Every piece is picklable (classes and
module-level functions), so spawned synchronisation replicas can receive it.

* ``resnet``: a ResNet-style CNN (He et al., CVPR'16: basic residual blocks,
  three stages of 16/32/64 channels as in their CIFAR-10 networks) on
  3×32×32 images, 10 classes; SGD with momentum.
* ``transformer``: a decoder-only transformer language model (pre-norm
  blocks, causal self-attention) on 64-token sequences over 256 tokens; AdamW.
* ``mlp``: a multi-layer perceptron on 784 features, 10 classes; SGD with momentum.

Batches are synthetic but carry signal: labels come from a fixed random
"teacher" (a linear map of the pooled image or the features), tokens from a
fixed random sparse Markov chain, so the gradients have a real signal-to-noise
ratio for the gradient-noise measurement. Nothing is downloaded.

Contract of the pieces (what ``profile_job`` expects of any job)::

    model: torch.nn.Module
    optimizer_factory(params) -> torch.optim.Optimizer
    make_batch(batch_size, device) -> batch          # samples on that device
    loss_fn(model, batch) -> scalar tensor            # the MEAN loss; calls model(...)

Example::

    >>> work = get("mlp", width=32)
    >>> batch = work.make_batch(4, "cpu")
    >>> float(work.loss_fn(work.model, batch).detach()) > 0
    True
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Workload",
    "ZOO",
    "get",
    "resnet",
    "transformer",
    "mlp",
    "ResNetCNN",
    "TransformerLM",
    "MLP",
    "classification_loss",
    "language_model_loss",
    "TeacherImages",
    "TeacherFeatures",
    "MarkovTokens",
]


@dataclass
class Workload:
    """A training job's pieces, as :func:`profilers.profile_job` takes them.

    Attributes:
        job: the job's name.
        model: the network (on the CPU; the profiler copies it to each device).
        optimizer_factory: ``optimizer_factory(params) -> Optimizer``.
        loss_fn: ``loss_fn(model, batch) -> scalar mean loss``.
        make_batch: ``make_batch(batch_size, device) -> batch``.
        init_batch_size: the reference batch M0, samples.
        max_batch_size: the largest total batch the job tolerates (``None``: M0).
    """

    job: str
    model: nn.Module
    optimizer_factory: Callable[[Any], torch.optim.Optimizer]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    make_batch: Callable[[int, Any], Any]
    init_batch_size: int
    max_batch_size: int | None = None

    def profile_args(self) -> dict[str, Any]:
        """Keyword arguments for :func:`profilers.profile_job` (``profile_job(**work.profile_args())``)."""
        return {
            "model": self.model,
            "optimizer_factory": self.optimizer_factory,
            "loss_fn": self.loss_fn,
            "make_batch": self.make_batch,
            "job": self.job,
            "init_batch_size": self.init_batch_size,
            "max_batch_size": self.max_batch_size,
        }


# ---------------------------------------------------------------------------- losses


def classification_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of ``model(x)`` against labels ``y``; ``batch = (x, y)``."""
    x, y = batch
    return F.cross_entropy(model(x), y)


def language_model_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; ``tokens`` is ``(batch, seq_len + 1)``."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


# ---------------------------------------------------------------------------- batches


def _generator(seed: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


class TeacherFeatures:
    """``(x, y)`` with x ~ N(0, I) of ``features`` dimensions and y = argmax(x·W) for a fixed random W."""

    def __init__(self, features: int, classes: int, seed: int = 0) -> None:
        self.features, self.classes, self.seed = features, classes, seed
        self.teacher = torch.randn(features, classes, generator=_generator(seed))

    def __call__(self, batch_size: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(batch_size, self.features)
        y = (x @ self.teacher).argmax(dim=1)
        return x.to(device), y.to(device)


class TeacherImages:
    """``(x, y)``: images x ~ N(0, 1) of ``channels×size×size``; y from a fixed random map of 4×4-pooled pixels."""

    def __init__(self, channels: int = 3, size: int = 32, classes: int = 10, seed: int = 0) -> None:
        self.channels, self.size, self.classes, self.seed = channels, size, classes, seed
        self.teacher = torch.randn(channels * 16, classes, generator=_generator(seed))

    def __call__(self, batch_size: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(batch_size, self.channels, self.size, self.size)
        pooled = F.adaptive_avg_pool2d(x, 4).reshape(batch_size, -1)
        y = (pooled @ self.teacher).argmax(dim=1)
        return x.to(device), y.to(device)


class MarkovTokens:
    """Token sequences of ``seq_len + 1`` tokens from a fixed random sparse Markov chain over ``vocab`` tokens."""

    def __init__(self, vocab: int = 256, seq_len: int = 64, seed: int = 0, successors: int = 4) -> None:
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed
        gen = _generator(seed)
        # Each token has a few likely successors (a peaked, learnable distribution).
        logits = torch.full((vocab, vocab), -4.0)
        picks = torch.randint(0, vocab, (vocab, successors), generator=gen)
        logits.scatter_(1, picks, torch.rand(vocab, successors, generator=gen) * 3.0 + 2.0)
        self.transitions = torch.softmax(logits, dim=1)

    def __call__(self, batch_size: int, device: Any) -> torch.Tensor:
        tokens = torch.empty(batch_size, self.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab, (batch_size,))
        for t in range(1, self.seq_len + 1):
            tokens[:, t] = torch.multinomial(self.transitions[tokens[:, t - 1]], 1).squeeze(1)
        return tokens.to(device)


# ---------------------------------------------------------------------------- models


class _BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetCNN(nn.Module):
    """ResNet-style CNN: a 3×3 stem, stages of basic residual blocks (stride 2 between stages), pooling, a linear head."""

    def __init__(self, channels: tuple[int, ...] = (16, 32, 64), blocks: int = 1, in_channels: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, channels[0], 3, padding=1, bias=False), nn.BatchNorm2d(channels[0]), nn.ReLU())
        layers = []
        c_in = channels[0]
        for stage, c_out in enumerate(channels):
            for block in range(blocks):
                layers.append(_BasicBlock(c_in, c_out, 2 if (stage > 0 and block == 0) else 1))
                c_in = c_out
        self.stages = nn.Sequential(*layers)
        self.head = nn.Linear(c_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


class TransformerLM(nn.Module):
    """Decoder-only transformer LM: token + position embeddings, pre-norm causal blocks, a linear head."""

    def __init__(self, vocab: int = 256, d_model: int = 128, heads: int = 4, layers: int = 2, seq_len: int = 64) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(seq_len, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        positions = torch.arange(length, device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions)
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        x = self.blocks(x, mask=mask, is_causal=True)
        return self.head(self.norm(x))


class MLP(nn.Module):
    """Fully connected ReLU network."""

    def __init__(self, in_features: int = 784, width: int = 512, depth: int = 2, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        size = in_features
        for _ in range(depth):
            layers += [nn.Linear(size, width), nn.ReLU()]
            size = width
        layers.append(nn.Linear(size, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


# ---------------------------------------------------------------------------- factories


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Initialise weights from ``seed`` without disturbing the caller's global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def resnet(
    channels: tuple[int, ...] = (16, 32, 64),
    blocks: int = 1,
    image_size: int = 32,
    init_batch_size: int = 64,
    max_batch_size: int | None = 1024,
    seed: int = 0,
) -> Workload:
    """A ResNet-style CNN on CIFAR-shaped images (3×32×32, 10 classes); SGD lr 0.1, momentum 0.9."""
    with _seeded(seed):
        model = ResNetCNN(tuple(channels), blocks)
    return Workload(
        job="zoo-resnet",
        model=model,
        optimizer_factory=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        loss_fn=classification_loss,
        make_batch=TeacherImages(3, image_size, 10, seed),
        init_batch_size=init_batch_size,
        max_batch_size=max_batch_size,
    )


def transformer(
    vocab: int = 256,
    d_model: int = 128,
    heads: int = 4,
    layers: int = 2,
    seq_len: int = 64,
    init_batch_size: int = 32,
    max_batch_size: int | None = 512,
    seed: int = 0,
) -> Workload:
    """A small decoder-only transformer LM on Markov-chain tokens; AdamW lr 3e-4."""
    with _seeded(seed):
        model = TransformerLM(vocab, d_model, heads, layers, seq_len)
    return Workload(
        job="zoo-transformer",
        model=model,
        optimizer_factory=functools.partial(torch.optim.AdamW, lr=3e-4),
        loss_fn=language_model_loss,
        make_batch=MarkovTokens(vocab, seq_len, seed),
        init_batch_size=init_batch_size,
        max_batch_size=max_batch_size,
    )


def mlp(
    in_features: int = 784,
    width: int = 512,
    depth: int = 2,
    classes: int = 10,
    init_batch_size: int = 64,
    max_batch_size: int | None = 4096,
    seed: int = 0,
) -> Workload:
    """An MLP on MNIST-shaped features (784 → 512 → 512 → 10); SGD lr 0.05, momentum 0.9."""
    with _seeded(seed):
        model = MLP(in_features, width, depth, classes)
    return Workload(
        job="zoo-mlp",
        model=model,
        optimizer_factory=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
        loss_fn=classification_loss,
        make_batch=TeacherFeatures(in_features, classes, seed),
        init_batch_size=init_batch_size,
        max_batch_size=max_batch_size,
    )


ZOO: dict[str, Callable[..., Workload]] = {"resnet": resnet, "transformer": transformer, "mlp": mlp}


def get(name: str, **options: Any) -> Workload:
    """The zoo workload ``name`` (``"resnet"``, ``"transformer"``, ``"mlp"``), factory options passed through."""
    from goodput.errors import ValidationError

    if name not in ZOO:
        raise ValidationError("zoo", name, f"unknown zoo model (known: {', '.join(sorted(ZOO))})")
    return ZOO[name](**options)
