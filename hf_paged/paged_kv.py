"""`PagedKV`: what a paged layer's `update` returns in place of concatenated keys / values.

It is a tensor of the shape transformers expects, ``[B, kv_heads, kv_len, head_dim]``, that
holds no data of its own. The "hf_paged" attention reads the layer's pages in place through
``.layer``. Any other consumer (another attention implementation, a model that computes
attention itself) triggers ``__torch_dispatch__``, which materialises the window by reading the
pages: the output stays correct, at the cost of one copy per step, and a warning says so once.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map
from transformers.utils import logging

logger = logging.get_logger(__name__)


def warn_gathered_pages() -> None:
    """Say once per process that a PagedCache is read by another attention implementation.

    Called where that is first known: `PagedCache.bind_config` (the config names another attention)
    or the first read of a `PagedKV` by it; ``warning_once`` keeps it to one message for both.
    """
    logger.warning_once(
        "A PagedCache is being read by an attention implementation other than 'hf_paged': its pages are "
        "gathered every step, which is correct but slower. Load the model with attn_implementation='hf_paged' "
        "(after `import hf_paged`) to read them in place.")


class PagedKV(torch.Tensor):
    """Keys (``which == "k"``) or values of one paged layer for the current step."""

    layer: object
    which: str

    @staticmethod
    def __new__(cls, layer, which: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        tensor = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        tensor.layer, tensor.which = layer, which
        return tensor

    __torch_function__ = torch._C._disabled_torch_function_impl

    def materialize(self) -> torch.Tensor:
        """The ``[B, H, kv_len, D]`` window as a regular tensor (a view when pages allow)."""
        if self.layer.group.step.read_table is not None and bool((self.layer.group.step.table < 0).any()):
            from .errors import CacheUsageError

            raise CacheUsageError(
                "This PagedCache evicted pages (a bounded pool with a lossy eviction policy): only the "
                "'hf_paged' attention can read rows with holes. Load the model with attn_implementation='hf_paged', "
                "or use eviction='error'.")
        keys, values = self.layer.read()
        return (keys if self.which == "k" else values).transpose(1, 2)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        warn_gathered_pages()
        unwrap = lambda t: t.materialize() if isinstance(t, PagedKV) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))

    def __repr__(self) -> str:
        return f"PagedKV({self.which}, shape={tuple(self.shape)}, layer={self.layer!r})"
