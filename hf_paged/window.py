"""Which leading pages of a group's rows the next step still needs, by the group's attention window.

A full-attention group needs every page; a sliding-window group needs only the pages holding
the last ``size`` tokens the next query attends, so the pages before can be released (as vLLM's
``SlidingWindowManager.remove_skipped_blocks`` does). Assisted decoding may roll tokens back,
so while ``record_past`` is set the skipped pages are kept until the next crop.
"""

from __future__ import annotations


class FullWindow:
    """Every token stays attended: no page is ever skipped."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.record_past = False  # set by assisted decoding: keep skipped pages until `crop`

    def skipped_tokens(self, num_tokens: int) -> int:
        """Leading tokens that no query after ``num_tokens`` tokens attends."""
        return 0

    def first_needed_page(self, past: int, first_page: int) -> int:
        """First logical page a step starting after ``past`` tokens needs (rows start at ``first_page``)."""
        return max(first_page, self.skipped_tokens(past) // self.page_size)

    def first_kept_page(self, past: int, first_page: int) -> int:
        """First logical page a step starting after ``past`` tokens keeps (all of them while recording the past)."""
        return first_page if self.record_past else self.first_needed_page(past, first_page)


class SlidingWindow(FullWindow):
    """A query attends the last ``size`` tokens, itself included."""

    def __init__(self, size: int, page_size: int):
        super().__init__(page_size)
        self.size = size

    def skipped_tokens(self, num_tokens: int) -> int:
        return max(0, num_tokens - self.size + 1)


def make_window(size: int | None, page_size: int) -> FullWindow:
    """The window of a group of layers whose sliding window is ``size`` tokens (None: full attention)."""
    return FullWindow(page_size) if size is None else SlidingWindow(size, page_size)
