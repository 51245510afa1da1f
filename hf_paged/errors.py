"""Errors raised by hf_paged. Every message says what was wrong and what to do."""


class PagePoolExhausted(RuntimeError):
    """A bounded page pool cannot provide the pages a step needs.

    Raised before anything is changed: the cache stays consistent and usable.
    """

    def __init__(self, needed: int, available: int, max_pages: int, page_size: int):
        self.needed, self.available, self.max_pages = needed, available, max_pages
        super().__init__(
            f"The page pool is exhausted: this step needs {needed} new page(s) but only {available} of "
            f"max_pages={max_pages} (page_size={page_size}) can be freed. Raise max_pages, shorten the "
            "generation, or choose a lossy eviction policy (eviction='lru' or 'fifo')."
        )


class CacheUsageError(ValueError):
    """The cache was used in a way it cannot serve (wrong shapes, batch, device...)."""
