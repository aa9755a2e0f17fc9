"""Memory of a training step: CUDA's peak allocator statistics, an estimate on the CPU.

CUDA: the peak is ``torch.cuda.max_memory_allocated`` after
``torch.cuda.reset_peak_memory_stats`` — every byte the caching allocator
handed out during the steps, as the device saw it. Running out of memory
raises ``torch.cuda.OutOfMemoryError``; :func:`is_out_of_memory` recognises
it and :func:`release_cuda_memory` gives the cache back, so the batch-size
sweep can stop there cleanly (the end of the sweep, not an error).

CPU: there is no allocator peak to read, so :class:`CpuStepMemory` estimates
the step's peak from the tensors it holds, measured on a real step:

    parameters + gradients + optimizer state + input batch
    + activations autograd saves for the backward pass

Saved activations are counted with ``torch.autograd.graph.saved_tensors_hooks``
during the forward pass, each storage once (storages of the parameters and of
the batch are not counted twice). This is a lower bound of the process's true
peak: temporaries freed inside an operator and the allocator's own overhead
are not counted. It grows linearly with the batch size, as the activations
do, which is what a memory cap on the batch needs.

Example::

    meter = CpuStepMemory()
    with meter.forward(model, batch):
        loss = loss_fn(model, batch)
    loss.backward(); optimizer.step()
    meter.total(model, optimizer, batch)      # bytes
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["CpuStepMemory", "tensor_bytes", "is_out_of_memory", "release_cuda_memory", "reset_cuda_peak", "cuda_peak"]


def _storage_key(tensor: Any) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _tensors(obj: Any) -> Iterator[Any]:
    """Every strided tensor in a nested structure of tuples, lists, mappings (dicts, ``BatchEncoding``)
    and dataclasses; a sparse COO tensor (an ``nn.Embedding(sparse=True)`` gradient) as its indices and values."""
    import torch

    if isinstance(obj, torch.Tensor):
        if obj.layout == torch.sparse_coo:
            yield obj._indices()
            yield obj._values()
        elif obj.layout == torch.strided:
            yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, field.name, None))


def tensor_bytes(obj: Any, seen: set[tuple[int, int]] | None = None) -> int:
    """Bytes of the distinct storages of the tensors in ``obj`` (nested tuples/lists/mappings/dataclasses).

    Storages already in ``seen`` are skipped; those counted are added to it.
    """
    seen = set() if seen is None else seen
    total = 0
    for tensor in _tensors(obj):
        if tensor.device.type == "meta":
            continue
        key = _storage_key(tensor)
        if key not in seen and key[1] > 0:
            seen.add(key)
            total += key[1]
    return total


class CpuStepMemory:
    """Estimate of one CPU training step's peak memory, bytes (see the module doc)."""

    def __init__(self) -> None:
        self._saved: dict[tuple[int, int], int] = {}

    @contextlib.contextmanager
    def forward(self, model: Any, batch: Any) -> Iterator[CpuStepMemory]:
        """Count the storages autograd saves for backward while the block runs.

        Storages of ``model``'s parameters and of ``batch`` are left out here
        (:meth:`total` counts them once); the set is taken now, while every
        saved tensor is alive, so no address is confused with a later one.
        """
        import torch

        exclude: set[tuple[int, int]] = set()
        tensor_bytes([*model.parameters(), batch], exclude)

        def pack(tensor: Any) -> Any:
            for part in _tensors(tensor):
                if part.device.type != "meta":
                    key = _storage_key(part)
                    if key not in exclude:
                        self._saved[key] = key[1]
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield self

    @property
    def saved_bytes(self) -> int:
        """Bytes of the activations saved for backward (each storage once)."""
        return int(sum(self._saved.values()))

    def total(self, model: Any, optimizer: Any, batch: Any) -> int:
        """Parameters + gradients + optimizer state + batch + saved activations, bytes."""
        seen: set[tuple[int, int]] = set()
        params = list(model.parameters())
        total = tensor_bytes(params, seen)
        total += tensor_bytes([p.grad for p in params if p.grad is not None], seen)
        total += tensor_bytes(list(getattr(optimizer, "state", {}).values()), seen)
        total += tensor_bytes(batch, seen)
        return int(total + self.saved_bytes)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is the device running out of memory (the end of a sweep, not a failure)."""
    import torch

    if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    # Some kernels (cuDNN, cuBLAS workspaces) report OOM as a plain RuntimeError, and so does
    # torch's CPU allocator when an allocation is refused.
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _OOM_MESSAGES)


# what torch and its libraries say when memory runs out: the caching allocator, CUDA itself (an allocation inside a
# kernel or the runtime), cuBLAS' and cuDNN's workspaces, Apple's MPS backend, the CPU allocator (the last four had
# ended a sweep with a ModelFailureError instead of at the largest batch that fit; found in review)
_OOM_MESSAGES = ("CUDA out of memory", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED",
                 "MPS backend out of memory", "DefaultCPUAllocator: can't allocate memory")


def release_cuda_memory(device: Any) -> None:
    """Collect garbage and return the CUDA caching allocator's free blocks to the device."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        with torch.cuda.device(device):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def reset_cuda_peak(device: Any) -> None:
    import torch

    torch.cuda.reset_peak_memory_stats(device)


def cuda_peak(device: Any) -> int:
    """Peak bytes allocated on ``device`` since the last :func:`reset_cuda_peak`."""
    import torch

    return int(torch.cuda.max_memory_allocated(device))
