"""Errors raised by hf_paged. Every message says what was wrong and what to do."""


class PagePoolExhausted(RuntimeError):
    """A bounded page pool cannot provide the pages a step needs.

    Raised before anything is changed: the cache stays consistent and usable.
    """

    def __init__(self, needed: int, available: int, max_pages: int, page_size: int, lossy: bool = False):
        self.needed, self.available, self.max_pages = needed, available, max_pages
        fix = ("feed the prompt in chunks that fit (evicted pages cannot include the ones a step writes), "
               "lower sink_pages / recent_pages, or raise max_pages." if lossy else
               "raise max_pages, shorten the generation, or choose a lossy eviction policy "
               "(eviction='lru' or 'fifo').")
        super().__init__(
            f"The page pool is exhausted: this step needs {needed} new page(s) but only {available} of "
            f"max_pages={max_pages} (page_size={page_size}) can be freed. To fix it, {fix}"
        )


class CacheUsageError(ValueError):
    """The cache was used in a way it cannot serve (wrong shapes, batch, device...)."""
