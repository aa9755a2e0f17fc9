"""Device types: CUDA devices grouped by normalised model name, and the host CPU.

A *device type* is what the goodput model calls ``gpu_type`` (DESIGN.md,
"Vocabulary"): ``"h100"``, ``"a100"``, ``"t4"``, ``"rtx2080ti"`` … and ``"cpu"``
for the host. The profiler measures each type once, on its first device (and
across several of its devices for synchronisation), not once per device.

:func:`normalize_device_name` turns the marketing name CUDA reports into that
short name; unknown names get a stable slug of the name (the same name always
gives the same slug).

Example::

    >>> normalize_device_name("NVIDIA H100 80GB HBM3")
    'h100'
    >>> normalize_device_name("NVIDIA GeForce RTX 2080 Ti")
    'rtx2080ti'
    >>> normalize_device_name("Quadro RTX 6000")
    'rtx6000'
    >>> normalize_device_name("Tesla V100-SXM2-16GB")
    'v100'
    >>> normalize_device_name("Acme Tensor Engine 9")
    'acme-tensor-engine-9'

A MIG slice is a type of its own, its parent's name and its profile (a 1g.10gb
slice runs about a seventh of an A100's work; NVIDIA's GPU feature discovery
labels the product the same way under ``mig.strategy=single``)::

    >>> normalize_device_name("NVIDIA A100-SXM4-80GB MIG 1g.10gb")
    'a100-mig-1g.10gb'
"""

from __future__ import annotations

import os
import platform
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from goodput.errors import ValidationError
from goodput.validation import normalize_gpu_type

__all__ = ["DeviceType", "normalize_device_name", "cuda_device_types", "cpu_device_type", "resolve_devices"]

CPU = "cpu"

# Words that carry no type information: vendor and product-line names.
_NOISE_WORDS = re.compile(r"\b(nvidia|tesla|geforce|quadro|corporation|graphics|gpu)\b")
# Consumer / workstation families: RTX 2080 Ti, GTX 1080, RTX A6000, RTX 6000 Ada.
_RTX = re.compile(r"\b(rtx|gtx)\s*([a-z]?\d{3,4})(?:\s*(ti|super))?(?:\s*(ada))?\b")
# Data-centre parts: letter(s) then digits (h100, a100, t4, v100, l40s, a10g, k80, p100, gh200, b200).
_DATACENTER = re.compile(r"^(gh|gb|[abhklmptv])\d{1,3}[a-z]?$")
_SLUG = re.compile(r"[^a-z0-9]+")
# A MIG slice's profile: "MIG 1g.10gb", "MIG 3g.40gb", compute instances "MIG 1c.3g.20gb", "+me" media extensions.
_MIG = re.compile(r"\bmig[\s-]+((?:\d+c\.)?\d+g\.\d+gb(?:\+me)?)\b")


def normalize_device_name(name: str) -> str:
    """The device type of a CUDA device name (lower-case slug, see module doc).

    Args:
        name: what ``torch.cuda.get_device_name`` reports.

    Returns:
        ``"h100"``, ``"a100"``, ``"t4"``, ``"v100"``, ``"l4"``, ``"h200"``,
        ``"rtx2080ti"``, ``"rtx6000"``, ``"rtxa6000"`` …; a slug of the name
        for anything else.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValidationError("device_name", name, "expected a non-empty device name")
    text = name.strip().lower()
    if text == CPU:
        return CPU
    mig = _MIG.search(text)
    if mig:
        parent = text[:mig.start()].strip(" -_") or "gpu"
        return f"{normalize_device_name(parent)}-mig-{mig.group(1).replace('+', '-')}"
    text = _NOISE_WORDS.sub(" ", text)
    rtx = _RTX.search(text)
    if rtx:
        family, model, suffix, ada = rtx.groups()
        return f"{family}{model}{suffix or ''}{ada or ''}"
    for token in re.split(r"[^a-z0-9]+", text):
        if _DATACENTER.match(token):
            return token
    slug = _SLUG.sub("-", text).strip("-")
    return slug or _SLUG.sub("-", name.strip().lower()).strip("-") or "gpu"


@dataclass(frozen=True)
class DeviceType:
    """One device type present on this machine.

    Attributes:
        gpu_type: the normalised type name (``"h100"``, ``"cpu"``).
        devices: torch device strings of this type (``("cuda:0", "cuda:1")``, ``("cpu",)``).
        names: the names the devices report (``"NVIDIA H100 80GB HBM3"``).
        memory_bytes: total memory of one device, bytes (``None`` for the CPU).
    """

    gpu_type: str
    devices: tuple[str, ...]
    names: tuple[str, ...]
    memory_bytes: int | None = None

    @property
    def is_cuda(self) -> bool:
        return self.devices[0].startswith("cuda")

    @property
    def device(self) -> str:
        """The device the single-replica sweep runs on (the type's first)."""
        return self.devices[0]

    @property
    def count(self) -> int:
        """Devices of this type (replicas possible on this machine)."""
        return len(self.devices) if self.is_cuda else usable_cpus()


def usable_cpus() -> int:
    """CPU cores this process may run on: its affinity (Slurm's --cpus-per-task, a container's cpuset,
    taskset), not every core of the host; ``os.cpu_count()`` where the platform has no affinity."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cuda_device_types() -> list[DeviceType]:
    """CUDA devices present, grouped by normalised name, in device-index order."""
    import torch

    if not torch.cuda.is_available():
        return []
    groups: dict[str, list[tuple[str, str, int]]] = {}
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        name = props.name
        groups.setdefault(normalize_device_name(name), []).append((f"cuda:{index}", name, int(props.total_memory)))
    return [
        DeviceType(gpu_type, tuple(d for d, _, _ in members), tuple(n for _, n, _ in members), members[0][2])
        for gpu_type, members in groups.items()
    ]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def cpu_device_type() -> DeviceType:
    """The host CPU as a device type named ``"cpu"`` (its name from ``/proc/cpuinfo`` where there is one)."""
    return DeviceType(CPU, ("cpu",), (_cpu_name(),), None)


def resolve_devices(devices: Any = None) -> list[DeviceType]:
    """The device types to profile.

    Args:
        devices: ``None`` (every CUDA type present, else the CPU), or a list
            (or comma-separated string) of ``"cpu"``, ``"cuda"`` (every CUDA
            type), ``"cuda:N"`` (that device's type), a type name present
            (``"h100"``), or a :class:`DeviceType` of devices present under a
            name the caller gives (what a cluster calls this node's type:
            :func:`profilers.profile_cluster` labels a node's CPU or GPUs so).

    Raises:
        ValidationError: an entry names no device present.
    """
    cuda = cuda_device_types()
    if devices is None:
        return cuda or [cpu_device_type()]
    items: Iterable[Any] = devices.split(",") if isinstance(devices, str) else devices
    if isinstance(items, (bytes, dict)) or not isinstance(items, Iterable):
        raise ValidationError("devices", devices, "expected a list of 'cpu', 'cuda', 'cuda:N' or a GPU type name")
    chosen: dict[str, DeviceType] = {}
    for item in items:
        if isinstance(item, DeviceType):
            named = _check_named_type(item, cuda)
            chosen.setdefault(named.gpu_type, named)
            continue
        text = str(getattr(item, "type", item) if not isinstance(item, str) else item).strip().lower()
        if hasattr(item, "type") and getattr(item, "index", None) is not None:
            text = f"{item.type}:{item.index}"
        if not text:
            continue
        if text == CPU:
            chosen.setdefault(CPU, cpu_device_type())
            continue
        if text == "cuda":
            if not cuda:
                raise ValidationError("devices", devices, "no CUDA device is present")
            for dtype in cuda:
                chosen.setdefault(dtype.gpu_type, dtype)
            continue
        match = [d for d in cuda if text in d.devices or text == d.gpu_type]
        if not match:
            known = ["cpu"] + (["cuda"] if cuda else []) + [d for t in cuda for d in (t.gpu_type, *t.devices)]
            raise ValidationError("devices", item, f"no such device here (present: {', '.join(known)})")
        dtype = match[0]
        if text in dtype.devices and dtype.gpu_type not in chosen:
            # One named device: profile its type on that device first.
            rest = tuple(d for d in dtype.devices if d != text)
            dtype = DeviceType(dtype.gpu_type, (text, *rest), dtype.names, dtype.memory_bytes)
        chosen.setdefault(dtype.gpu_type, dtype)
    if not chosen:
        raise ValidationError("devices", devices, "names no device")
    return list(chosen.values())


def _check_named_type(dtype: DeviceType, cuda: list[DeviceType]) -> DeviceType:
    """A caller's :class:`DeviceType`: its name a GPU type name, its devices the CPU or CUDA devices present."""
    name = normalize_gpu_type(dtype.gpu_type, "devices")
    present = {d for t in cuda for d in t.devices}
    devices = tuple(dtype.devices)
    if not devices or not (devices == (CPU,) or all(d in present for d in devices)):
        raise ValidationError("devices", dtype, f"a device type's devices are ('cpu',) or CUDA devices present "
                              f"({', '.join(sorted(present)) or 'none here'})")
    return DeviceType(name, devices, tuple(dtype.names), dtype.memory_bytes)
