"""What kind of tensor a tensor is, asked in the hooks every step and at attach, without
importing what it asks about: `dtensor_of` (torch.distributed.tensor's DTensor)."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["dtensor_of"]


def dtensor_of(t: object) -> Any:
    """`t` when it is a DTensor, else None (torch.distributed.tensor never imported: none)."""
    dt = sys.modules.get("torch.distributed.tensor")
    return t if dt is not None and isinstance(t, dt.DTensor) else None
