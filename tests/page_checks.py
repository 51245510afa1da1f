"""Page accounting checks shared by the tests."""

from hf_paged.block_manager import EVICTED


def managers_of(*caches) -> dict[int, tuple]:
    """id(manager) -> (manager, live page entries of every row of the given caches that use it)."""
    held: dict[int, list] = {}
    for cache in caches:
        cache.commit()
        for group in cache.groups.values():
            entry = held.setdefault(id(group.manager), [group.manager, 0])
            entry[1] += sum(1 for r in group.rows for p in r if p != EVICTED)
    return {k: tuple(v) for k, v in held.items()}


def check_pages(*caches) -> None:
    """Invariants, and: pages referenced == pages held by rows (each live entry holds one reference)."""
    for manager, entries in managers_of(*caches).values():
        manager.check_invariants()
        assert sum(manager.ref) == entries, f"{sum(manager.ref)} references for {entries} row entries"
        assert manager.num_used == len({p for p in range(manager.num_pages) if manager.ref[p] > 0})
