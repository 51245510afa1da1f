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


def check_all_given_back(manager, used: bool = True) -> None:
    """No reference left: every page is free or cached (``used``: and the manager did hand out pages)."""
    manager.check_invariants()
    assert all(r == 0 for r in manager.ref), f"references left: {manager.ref}"
    assert len(manager.free) + len(manager.cached) == manager.num_pages
    assert manager.num_pages > 0 or not used


def ref_counts(cache) -> dict:
    """Per group: page -> reference count, for referenced pages."""
    cache.commit()
    return {w: {p: r for p, r in enumerate(g.manager.ref) if r} for w, g in cache.groups.items()}


def held(cache) -> dict:
    """What a cache holds (the pool's capacity may have grown meanwhile: not counted)."""
    stats = cache.stats()
    return {k: stats[k] for k in ("pages_used", "pages_cached", "tokens_stored", "kv_bytes")}


def row_pages(cache) -> dict:
    return {w: [list(r) for r in g.rows] for w, g in cache.groups.items()}
