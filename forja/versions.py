"""The installed PyTorch's version as numbers, for the few behaviours that depend on it."""

import torch


def torch_version() -> tuple[int, int]:
    """(major, minor) of torch: '2.13.0+cpu' -> (2, 13). Compare tuples, never strings:
    as strings '2.9' sorts after '2.12'."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)
