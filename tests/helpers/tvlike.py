"""A stand-in for ``torchvision.tv_tensors`` (torchvision has no CPU build on these machines): Tensor subclasses with
per-instance metadata attributes and a ``__torch_function__`` that unwraps results to plain tensors, as
torchvision's do, plus a user-defined subclass."""

from __future__ import annotations

import enum
from typing import Any

import torch


class TVTensor(torch.Tensor):
    """Operations on these return plain ``Tensor``s (torchvision's rule), except the few torchvision keeps."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class Image(TVTensor):
    pass


class Mask(TVTensor):
    pass


class BoundingBoxFormat(enum.Enum):
    XYXY = "XYXY"
    XYWH = "XYWH"
    CXCYWH = "CXCYWH"


class BoundingBoxes(TVTensor):
    format: BoundingBoxFormat
    canvas_size: tuple[int, int]


def image(data: Any) -> Image:
    return torch.as_tensor(data).as_subclass(Image)


def mask(data: Any) -> Mask:
    return torch.as_tensor(data).as_subclass(Mask)


def boxes(data: Any, format: BoundingBoxFormat, canvas_size: tuple[int, int]) -> BoundingBoxes:
    out = torch.as_tensor(data).as_subclass(BoundingBoxes)
    out.format = format
    out.canvas_size = canvas_size
    return out


class Detection(torch.utils.data.Dataset):
    """A detection sample as torchvision v2 pipelines return it: image, mask, boxes (a varying count), label."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(i)
        count = 1 + i % 5
        return {
            "image": image(torch.randint(0, 255, (3, 16, 16), generator=g, dtype=torch.uint8)),
            "mask": mask(torch.randint(0, 2, (16, 16), generator=g, dtype=torch.uint8)),
            "boxes": boxes(torch.rand(count, 4, generator=g) * 16, BoundingBoxFormat.XYXY if i % 2 else
                           BoundingBoxFormat.XYWH, (16, 16 + i)),
            "label": i % 7,
        }


def same_tv(a: Any, b: Any) -> bool:
    """Equal samples, tensor subclasses and their attributes included."""
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(same_tv(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        plain = torch.Tensor
        return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and vars(a) == vars(b)
                and torch.equal(a.as_subclass(plain), b.as_subclass(plain)))
    return type(a) is type(b) and a == b
