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


def check_positive_int(name: str, value, allow_none: bool = False, most: int | None = None) -> None:
    """Raise `CacheUsageError` unless ``value`` is a positive int (at most ``most``; or None when allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or (most is not None and value > most):
        fix = "None (unbounded) or a positive int" if allow_none else "a positive int"
        fix += f" of at most {most}" if most is not None else ""
        raise CacheUsageError(f"{name} must be {fix}, got {value!r}.")
