"""Linear weights packed once for the CPU's matrix multiply, without changing the model's code.

``F.linear`` on the CPU hands MKL a plain weight matrix, which MKL re-copies into its blocked layout on
every call that has more than one row; with the 8-16 rows of a continuous-batching decode step that
copy costs about as much as the arithmetic. `pack_linear_weights` reorders every float32 `nn.Linear`
weight on the CPU once into oneDNN's layout (``torch.ops.mkldnn._reorder_linear_weight``, what
torch.compile's CPU freezing pass does) and points the module's ``forward`` at oneDNN's linear
(``torch.ops.mkldnn._linear_pointwise``). Single-row inputs (batch-1 decoding) keep ``F.linear``,
whose matrix-vector path is faster there than oneDNN's call.

Invariants of a packed module:
- its output equals ``F.linear(x, weight, bias)`` within float rounding (another summation order);
- its parameters are untouched (the state dict, tied embeddings and autograd see the plain weights);
  the packed copy costs the weight's size again in memory;
- a weight changed in place after packing is repacked before its next use, never read stale;
- `unpack_linear_weights` restores the module's own forward and drops the packed copy;
- the packed copy lies on 2 MB pages where the kernel allows (`hf_paged.huge_pages`): the decode steps stream it.
Modules on another device, of another dtype, or whose forward is already replaced (accelerate's
hooks) are left alone.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .huge_pages import move_to_huge_pages

_STATE = "_hf_paged_packed_weight"
onednn_linear = torch.ops.mkldnn._linear_pointwise  # (input, packed weight, bias, "none", [], "")
PACKED_DTYPE = torch.float32
DEFAULT_BATCH_HINT = 16  # rows oneDNN lays the weight out for (any row count works; this is the decode size)


@dataclass
class _PackedWeight:
    """oneDNN's copy of one module's weight, with what identifies the plain weight it was made from."""

    packed: torch.Tensor
    data_ptr: int
    version: int
    batch_hint: int

    @classmethod
    def of(cls, weight: torch.Tensor, batch_hint: int) -> "_PackedWeight":
        plain = weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(plain.contiguous(), batch_hint)
        move_to_huge_pages([packed])
        return cls(packed, plain.data_ptr(), plain._version, batch_hint)

    def matches(self, weight: torch.Tensor) -> bool:
        return weight.data_ptr() == self.data_ptr and weight._version == self.version


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    state: _PackedWeight = getattr(self, _STATE)
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if (rows <= 1 or x.dtype != PACKED_DTYPE or x.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
        return F.linear(x, self.weight, self.bias)  # matrix-vector, other inputs, or autograd: the plain weight
    if not state.matches(self.weight):
        state = _PackedWeight.of(self.weight, state.batch_hint)
        setattr(self, _STATE, state)
    return onednn_linear(x, state.packed, self.bias, "none", [], "")


def _packable(module: torch.nn.Module) -> bool:
    return (isinstance(module, torch.nn.Linear) and "forward" not in module.__dict__
            and module.weight.device.type == "cpu" and module.weight.dtype == PACKED_DTYPE
            and (module.bias is None or module.bias.dtype == PACKED_DTYPE))


def is_packed(module: torch.nn.Module) -> bool:
    return hasattr(module, _STATE)


def pack_linear_weights(model: torch.nn.Module, batch_hint: int = DEFAULT_BATCH_HINT) -> list[str]:
    """Pack every float32 `nn.Linear` of ``model`` on the CPU (see the module docstring); returns the names of
    the modules packed by this call (already packed ones are kept as they are). Raises when oneDNN is missing
    or when nothing in the model can be packed, saying what the model holds."""
    if not torch.backends.mkldnn.is_available():
        raise RuntimeError("pack_linear_weights needs a torch build with oneDNN (mkldnn); this one has none: "
                           "run the model unpacked.")
    if isinstance(batch_hint, bool) or not isinstance(batch_hint, int) or batch_hint < 1:
        raise ValueError(f"batch_hint must be a positive int (rows per call to lay weights out for), "
                         f"got {batch_hint!r}.")
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    if not any(_packable(m) or is_packed(m) for _, m in linears):
        held = sorted({f"{m.weight.dtype} on {m.weight.device}" for _, m in linears}) or ["no nn.Linear"]
        raise ValueError(f"pack_linear_weights packs float32 nn.Linear weights on the CPU; this model has "
                         f"{', '.join(held)}: nothing to pack (leave it unpacked).")
    packed = []
    with torch.no_grad():
        for name, module in linears:
            if _packable(module) and not is_packed(module):
                setattr(module, _STATE, _PackedWeight.of(module.weight, batch_hint))
                module.forward = types.MethodType(_packed_forward, module)
                packed.append(name)
    return packed


def unpack_linear_weights(model: torch.nn.Module, names: list[str] | None = None) -> list[str]:
    """Give the packed modules of ``model`` (or only those named) their own forward back and drop the packed
    copies; returns the names unpacked."""
    unpacked = []
    for name, module in model.named_modules():
        if is_packed(module) and (names is None or name in names):
            delattr(module, _STATE)
            del module.forward
            unpacked.append(name)
    return unpacked


@contextlib.contextmanager
def packed_linear_weights(model: torch.nn.Module, batch_hint: int = DEFAULT_BATCH_HINT) -> Iterator[list[str]]:
    """Pack for the duration of the block; on exit unpack what the block packed (not what was packed before)."""
    names = pack_linear_weights(model, batch_hint)
    try:
        yield names
    finally:
        unpack_linear_weights(model, names)
