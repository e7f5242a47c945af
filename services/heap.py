"""A service process's garbage collector, tuned once its start-up is done.

The step path makes thousands of short-lived objects a step (a struct per row, outputs,
lists), and with CPython's default threshold (700) a collection ran every few steps, each
walking every long-lived object too once it reached the older generations: 10-15 % of a
worker's host time a step at 256 rows (measured with the null model). `settle` moves what
start-up made (modules, the model's config, the tokenizer) out of the collector's sight
(`gc.freeze`) and collects the young generation less often. Cycles are rare in the step path;
those there are still get collected.
"""

import gc

YOUNG_THRESHOLD = 20_000     # allocations between young collections (CPython: 700)


def settle() -> None:
    """Call at the end of a process's start-up."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
