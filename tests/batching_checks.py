"""Helpers for continuous-batching tests: the scheduler's invariants checked after every step, and the
documented per-output reference of sampled rows."""

from __future__ import annotations

import contextlib

import hf_paged
from hf_paged.scheduler import Scheduler


@contextlib.contextmanager
def checked_scheduling():
    """Within: every `Scheduler` checks its invariants after every step, and its reservations are all back
    (``reserved == 0``) when it has no rows left. Yields the list of schedulers made."""
    made, real_init, real_after, real_retire = [], Scheduler.__init__, Scheduler.after_step, Scheduler.retire

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self)

    def after_step(self, step):
        real_after(self, step)
        self.check_invariants()

    def retire(self, row):
        real_retire(self, row)
        self.check_invariants()
        assert self.running or self.reserved == 0, f"{self.reserved} pages still reserved with no row running"

    Scheduler.__init__, Scheduler.after_step, Scheduler.retire = init, after_step, retire
    try:
        yield made
    finally:
        Scheduler.__init__, Scheduler.after_step, Scheduler.retire = real_init, real_after, real_retire


def sampled_alone(model, prompts, max_new_tokens, num_return_sequences, seed, **kwargs):
    """What `generate_many` documents for sample ``j`` of prompt ``i``: that prompt alone, one sample, seeded
    ``seed + i * num_return_sequences + j`` (nothing forked, nothing shared)."""
    return [hf_paged.generate_many(model, [prompt], max_new_tokens=new, num_return_sequences=1, do_sample=True,
                                   seed=seed + i * num_return_sequences + j, progress=False, **kwargs)[0]
            for i, (prompt, new) in enumerate(zip(prompts, max_new_tokens)) for j in range(num_return_sequences)]
