"""The prefix index: content hashes of full pages, their registration and lookup, and events for listeners.

A full page's hash chains everything that shaped its K/V: ``h_i = sha256(h_{i-1} || tokens_i || positions_i
|| mask_i)`` (`page_hashes`): every token before it (the chain), its tokens' positions (RoPE, learned position
embeddings: left padding shifts them) and the mask (what earlier tokens see). The chain is rooted at ``h_{-1}``,
a fingerprint of what computed the K/V (`model_fingerprint`: model class, config, parameter shapes, dtypes and
device types, sampled weights, page size, layer windows, page format), so pages never match across models or
formats. Hashes are stable across processes and ranks (no salted built-in ``hash``; no device index: ``cuda:0``
and ``cuda:1`` agree).

`PrefixIndex` registers and looks up hashes for one block manager (whose hash table maps hash <-> page) and
tells its listeners (`PrefixListener`) when a page gets its hash, when a page loses it (evicted for reuse, or
its content is about to change) and when a lookup misses; a listener may then supply the missing pages
(`PrefixIndex.load_run`: K/V written into fresh pages through the page store), which the lookup takes at once.
Both caches use it: `PagedCache` for the pages its token log hashes, `RaggedCache` for prompts and generated
tokens. This module imports nothing of the package at load time (``page_hashes`` is usable on its own).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch


def page_hashes(tokens: list[int], mask: list[int], positions: list[int], page_size: int, start: int,
                parent: bytes) -> list[bytes]:
    """Chained hashes of the full pages of ``tokens`` from page ``start`` on (``parent``: the hash before)."""
    hashes = []
    for i in range(start, len(tokens) // page_size):
        sl = slice(i * page_size, (i + 1) * page_size)
        digest = hashlib.sha256(parent)
        digest.update(torch.tensor(tokens[sl], dtype=torch.int64).numpy().tobytes())
        digest.update(torch.tensor(positions[sl], dtype=torch.int64).numpy().tobytes())
        digest.update(bytes(mask[sl]))
        parent = digest.digest()
        hashes.append(parent)
    return hashes


def model_fingerprint(model: torch.nn.Module, page_size: int, windows: list, kv_format: str = "float") -> bytes:
    """What computed a cache's K/V and how its pages hold it, as the root of its pages' hash chains: the model's
    class, config, parameter shapes, dtypes and device types (not indices: ranks on ``cuda:0`` and ``cuda:1``
    agree), four sampled values of every parameter (one transfer), the page size, the layers' windows and the page
    format (`hf_paged.kv_formats`: int8 pages never stand in for float ones). Two caches that differ in any of these
    never share pages."""
    digest = hashlib.sha256(type(model).__qualname__.encode())
    digest.update(model.config.to_json_string(use_diff=False).encode())
    digest.update(repr((page_size, windows, kv_format)).encode())
    samples = []
    for name, param in model.named_parameters():
        digest.update(f"{name} {tuple(param.shape)} {param.dtype} {param.device.type}".encode())
        flat = param.detach().reshape(-1)
        if flat.numel() and flat.device.type != "meta":
            n = flat.numel()
            samples.append(flat[torch.tensor([0, n // 3, (2 * n) // 3, n - 1], device=flat.device)].float().cpu())
    if samples:
        digest.update(torch.cat(samples).numpy().tobytes())
    return digest.digest()


class PrefixListener:
    """What a store or a tier may hear from a `PrefixIndex` (override what you need; each is a no-op here).
    Events come synchronously, before the pool changes the page, so a listener may still read its bytes
    through ``index.store``."""

    def page_hashed(self, index: "PrefixIndex", page: int, content_hash: bytes) -> None:
        """A full page got its content hash: it is reusable, and stays cached (LRU) when released."""

    def page_evicted(self, index: "PrefixIndex", page: int, content_hash: bytes) -> None:
        """``page`` no longer holds ``content_hash``: it is taken for reuse, or its content is about to change."""

    def run_hashed(self, index: "PrefixIndex", pages: list[int], hashes: list[bytes], start: int,
                   generated: bool) -> None:
        """Logical pages ``start ..`` of one sequence got their hashes (after their `page_hashed` events), batched
        per sequence: ``pages[i]`` holds ``hashes[i]`` for every logical page ``i`` from 0 (-1 where the sequence
        holds no page: left a sliding window, or evicted). ``generated``: decode steps filled them (a prompt's
        prefill did not)."""

    def lookup_missed(self, index: "PrefixIndex", hashes: list[bytes], start: int, end: int) -> None:
        """No page holds ``hashes[start]``; the lookup wants pages ``start .. end - 1`` (``hashes``: the sequence's
        chain from page 0 over every full page it knows, which may go past ``end``: a listener that keeps runs of
        pages finds one that ends there). A listener that has pages ``start ..`` may `PrefixIndex.load_run` them
        now; the lookup then goes on with what was loaded."""

    def stats(self) -> dict:
        """Counters this listener adds to its cache's ``stats()`` (summed over indexes)."""
        return {}


class PrefixIndex:
    """Prefix hashes of one block manager's pages: registration, lookup of runs, and the events of both.

    The hash table is the manager's (``hash_to_page`` / ``page_hash``, with its invariants); the index is the
    one place that writes it for prefix caching and the one that tells listeners. ``store``: the page store of
    the manager's pages, for listeners that read or load bytes (None where no layer wrote yet).
    """

    def __init__(self, manager, store=None):
        self.manager, self.store = manager, store
        self.listeners: list[PrefixListener] = []
        manager.hash_dropped = self._dropped

    def add_listener(self, listener: PrefixListener) -> None:
        self.listeners.append(listener)

    def _dropped(self, page: int, content_hash: bytes) -> None:
        for listener in self.listeners:
            listener.page_evicted(self, page, content_hash)

    # ---------------------------------------------------------------- register
    def register(self, page: int, content_hash: bytes) -> None:
        """``page`` (full, referenced) holds the content ``content_hash`` names."""
        self.manager.set_hash(page, content_hash)
        if self.listeners and self.manager.page_hash.get(page) == content_hash:
            for listener in self.listeners:
                listener.page_hashed(self, page, content_hash)

    def register_pages(self, table: list[int], hashes: list[bytes], first_page: int, start: int, end: int,
                       generated: bool = False) -> None:
        """The full logical pages ``[start, end)`` of a page table whose entry 0 is logical page ``first_page``
        (evicted entries, -1, are skipped) get their hashes ``hashes[i]``; listeners then hear the run (``generated``:
        decode steps filled it, not a prompt's prefill)."""
        begin = max(start, first_page)
        for i in range(begin, end):
            page = table[i - first_page]
            if page >= 0:
                self.register(page, hashes[i])
        if self.listeners and end > begin:
            pages = [-1] * first_page + list(table[:end - first_page])
            for listener in self.listeners:
                listener.run_hashed(self, pages, hashes[:end], begin, generated)

    # ------------------------------------------------------------------ lookup
    def lookup(self, content_hash: bytes) -> int | None:
        return self.manager.lookup(content_hash)

    def cached_run(self, hashes: list[bytes], limit: int | None = None, first: int = 0) -> list[int]:
        """Pages holding ``hashes[first], hashes[first + 1], ...`` (``hashes``: a sequence's chain from page 0) up to
        the first that none holds, before page ``limit``. At a miss the listeners hear of the run, once, and the
        run goes on with what they loaded."""
        end = len(hashes) if limit is None else min(limit, len(hashes))
        pages, told = [], False
        while first + len(pages) < end:
            page = self.manager.lookup(hashes[first + len(pages)])
            if page is None and self.listeners and not told:
                told = True
                for listener in self.listeners:
                    listener.lookup_missed(self, hashes, first + len(pages), end)
                pages = []  # (loading may have evicted cached pages of the run: look it up again)
                continue
            if page is None:
                break
            pages.append(page)
        return pages

    def stats(self) -> dict:
        """The listeners' counters (`PrefixListener.stats`), summed."""
        out = {}
        for listener in self.listeners:
            for key, value in listener.stats().items():
                out[key] = out.get(key, 0) + value
        return out

    def load_run(self, hashes: list[bytes], write: Callable[[list[int], list[int]], None]) -> int:
        """A listener supplies the content of a run of hashes (in sequence order): the ones no page holds get pages
        from the pool (free, else the least recently used cached ones; as many as it can spare, in order),
        ``write(rows, pages)`` fills ``pages[j]`` with the content of ``hashes[rows[j]]`` through ``store``, and they
        join the cached pages under their hashes (released tail first, as a row is). Returns how many leading hashes
        of the run a page holds afterwards. A failing ``write`` gives the pages back and raises."""
        rows = [i for i, h in enumerate(hashes) if self.manager.lookup(h) is None]
        rows = rows[:max(0, min(len(rows), self.manager.available()))]
        pages = []
        try:
            for _ in rows:
                pages.append(self.manager.allocate())
            if pages:
                write(rows, pages)
        except BaseException:
            self.manager.release_row(pages)
            raise
        for row, page in zip(rows, pages):
            self.register(page, hashes[row])
        self.manager.release_row(pages)
        held = 0
        while held < len(hashes) and self.manager.lookup(hashes[held]) is not None:
            held += 1
        return held
