"""`PagedKV`: what a paged layer's `update` returns in place of concatenated keys / values.

It is a tensor of the shape transformers expects, ``[B, kv_heads, kv_len, head_dim]``, that
holds no data of its own, only a `PagedView` of its layer for the current step: the pools, the
step's read plan, the layer's backend and where attention reports usage. The "hf_paged"
attention reads the pages in place through ``.paged``; it sees nothing else of the cache. Any
other consumer (another attention implementation, a model that computes attention itself)
triggers ``__torch_dispatch__``, which materialises the window by reading the pages: the output
stays correct, at the cost of one copy per step, and a warning says so once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map
from transformers.utils import logging

from .errors import CacheUsageError

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


@dataclass(frozen=True)
class PagedView:
    """What attention may read of one paged layer in one step.

    ``pages``: the layer's `LayerPages` (read through their kernel operands, `gather` or the float slab view);
    ``plan``: the step's plan on the pages' device (page tables, positions, lengths); ``backend``: "torch",
    "triton" or "cpu", resolved once per layer; ``report_usage``: where attention adds its usage per live page
    ``[B, H, Nk]`` (averaged over the observed queries), or ``[B, Nk]`` reduced over the heads as
    ``usage_heads`` says ("mean" or "max"), or None when the eviction policy does not want it;
    ``observed_queries``: how many of the step's last queries are observed; ``usage_signal``: what is added per
    page, its attention mass ("attention") or how far it moves each head's output (``"output"``, see
    `hf_paged.eviction`).
    """

    pages: object  # LayerPages
    plan: object  # StepPlan
    backend: str
    report_usage: Callable[[torch.Tensor], None] | None = None
    observed_queries: int = 1
    usage_heads: str = "mean"
    usage_signal: str = "attention"

    @property
    def past(self) -> int:
        """Tokens cached before this step."""
        return self.plan.past

    @property
    def num_tokens(self) -> int:
        """Tokens cached after this step."""
        return self.plan.num_tokens

    @property
    def page_size(self) -> int:
        return self.plan.page_size

    @property
    def live_only(self) -> bool:
        """Rows are read through their live pages (they have holes, or usage is tracked)."""
        return self.plan.read_table is not None

    def has_holes(self) -> bool:
        """Some row lost pages to eviction."""
        return self.live_only and bool((self.plan.table < 0).any())

    def kernel_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(page_table, page_pos, q_pos) for the paged kernels, checked against these pages."""
        return self.plan.kernel_index(self.pages.device, self.pages.num_pages)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' tokens as ``[B, T, H, D]`` (see `read_window`)."""
        return read_window(self.pages, self.plan)

    def read_live(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Live pages only: keys and values ``[B, Nk * S, H, D]`` gathered from the pages, and each
        token's position ``[B, Nk * S]`` (``num_tokens`` for padding and unwritten slots, which no
        query may attend)."""
        plan = self.plan
        table, page_pos = plan.live_pages()
        B, S = table.shape[0], plan.page_size
        keys, values = self.pages.gather(table.clamp(min=0))
        keys, values = keys.reshape(B, -1, *keys.shape[3:]), values.reshape(B, -1, *values.shape[3:])
        positions = (page_pos.unsqueeze(-1) + torch.arange(S, device=page_pos.device)).reshape(B, -1)
        positions = positions.masked_fill((table == -1).repeat_interleave(S, dim=1), plan.num_tokens)
        return keys, values, positions.clamp(max=plan.num_tokens)


def read_window(pages, plan) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of ``plan``'s rows, tokens ``[first_pos, num_tokens)``, as ``[B, T, H, D]``: a view when the
    rows lie on a slab of float pages, else a gather."""
    B, T = plan.batch_size, plan.kv_len
    slab_view = getattr(pages, "slab_view", None)  # a capability of float pages only
    if plan.slab is not None and slab_view is not None:
        return slab_view(*plan.slab, B, T)
    keys, values = pages.gather(plan.table)
    return keys.reshape(B, -1, *keys.shape[3:])[:, :T], values.reshape(B, -1, *values.shape[3:])[:, :T]


class PagedKV(torch.Tensor):
    """Keys (``which == "k"``) or values of one paged layer for the current step."""

    paged: PagedView
    which: str

    @staticmethod
    def __new__(cls, paged: PagedView, which: str, shape: tuple[int, ...]):
        tensor = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=paged.pages.dtype, device=paged.pages.device)
        tensor.paged, tensor.which = paged, which
        return tensor

    __torch_function__ = torch._C._disabled_torch_function_impl

    def materialize(self) -> torch.Tensor:
        """The ``[B, H, kv_len, D]`` window as a regular tensor (a view when pages allow)."""
        if self.paged.plan.packed:
            raise CacheUsageError(
                "generate_many packs sequences of different lengths into one row: only the 'hf_paged' attention "
                "can read them. Load the model with attn_implementation='hf_paged' (after `import hf_paged`).")
        if self.paged.has_holes():
            raise CacheUsageError(
                "This PagedCache evicted pages (a bounded pool with a lossy eviction policy): only the "
                "'hf_paged' attention can read rows with holes. Load the model with attn_implementation='hf_paged', "
                "or use eviction='error'.")
        keys, values = self.paged.read()
        warn_gathered_pages()
        return (keys if self.which == "k" else values).transpose(1, 2)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.materialize() if isinstance(t, PagedKV) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))

    def __repr__(self) -> str:
        return f"PagedKV({self.which}, shape={tuple(self.shape)}, backend={self.paged.backend!r})"
