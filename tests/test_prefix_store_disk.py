"""The folder-backed prefix store: round trips, restart, faults, permissions, concurrency, size cap."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
from prefix_store_cases import chain, joined, layout, pages, run_python, same_pages, store_warnings

from hf_paged.prefix_store import (BackgroundWriter, DiskStore, StoreUnavailable, UnsafeStoreDirectory, open_store,
                                   parse_size)
from hf_paged.prefix_store.entry import encode_entry


def entry_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.safetensors"))


@pytest.mark.parametrize("kind", ["run", "page", "quant"])
def test_round_trip_of_a_sequence(tmp_path, kind):
    lay = layout(kind)
    store = DiskStore(tmp_path)
    hashes, tensors = chain(10), pages(lay, 10)
    assert store.put(lay, hashes, tensors) == 10
    assert store.put(lay, hashes, tensors) == 0  # stored already: nothing rewritten
    entries = -(-10 // lay.pages_per_entry)
    assert len(entry_files(tmp_path)) == entries
    assert store.contains_prefix(lay, hashes) == 10
    runs = store.get(lay, hashes)
    assert [run.first for run in runs] == list(range(0, 10, lay.pages_per_entry))
    assert same_pages(joined(runs), tensors)
    stats = store.stats()
    assert stats["store_pages_written"] == 10 and stats["store_pages_read"] == 10 and stats["store_hits"] == 10
    on_disk = sum(p.stat().st_size for p in entry_files(tmp_path))
    assert stats["store_bytes_read"] == stats["store_bytes_written"] == on_disk
    assert stats["store_load_seconds"] > 0 and stats["store_read_bytes_per_s"] > 0


def test_prefix_walk_over_runs(tmp_path):
    lay = layout("run")  # 4 pages an entry
    store = DiskStore(tmp_path)
    hashes, tensors = chain(10), pages(lay, 10)
    store.put(lay, hashes, tensors)
    assert store.contains_prefix(lay, hashes[:9]) == 8     # the run 8..9 is keyed by page 9
    assert store.contains_prefix(lay, hashes[:7]) == 4     # the run 4..7 is keyed by page 7
    assert store.contains_prefix(lay, hashes + chain(3, seed=9)) == 10  # a longer prompt: the stored 10
    other = chain(12, seed=5)
    assert store.contains_prefix(lay, other) == 0
    assert store.stats()["store_misses"] == 1 + 3 + 3 + 12
    # a continuation written from the entry that holds its first new page extends the stored prefix
    longer = hashes + chain(6, seed=9)
    start = lay.entry_start(10)
    full = {**pages(lay, 16)}
    assert store.put(lay, longer[start:], {n: t[start:] for n, t in full.items()}, first=start) == 16 - start
    assert store.contains_prefix(lay, longer) == 16
    assert same_pages(joined(store.get(lay, longer)), full)
    # pages before the first whole entry cannot form one: they are not stored
    fresh = chain(8, seed=3)
    assert store.put(lay, fresh[2:], {n: t[2:] for n, t in pages(lay, 8, seed=3).items()}, first=2) == 4
    assert store.contains_prefix(lay, fresh) == 0


def test_namespaces_isolate(tmp_path):
    store = DiskStore(tmp_path)
    a, b = layout("run"), layout("run", fingerprint=b"model-b")
    hashes = chain(4)
    store.put(a, hashes, pages(a, 4))
    assert store.contains_prefix(b, hashes) == 0 and store.get(b, hashes) == []
    for changed in (dict(page_size=32), dict(dtype=torch.bfloat16), dict(page_format="kv-other"),
                    dict(layout_version=2), dict(layer_windows=[None, 64])):
        assert store.contains_prefix(layout("run", **changed), hashes) == 0, changed
    assert store.contains_prefix(a, hashes) == 4


def test_a_new_process_finds_every_entry(tmp_path):
    lay = layout("quant")
    DiskStore(tmp_path).put(lay, chain(13), pages(lay, 13))
    for seed in (1, 2):
        DiskStore(tmp_path).put(lay, chain(5, seed), pages(lay, 5, seed))
    found = run_python("""
        import json, sys
        from prefix_store_cases import chain, joined, layout, pages, same_pages
        from hf_paged.prefix_store import open_store
        store, lay = open_store("file://" + sys.argv[1]), layout("quant")
        out = {}
        for seed, n in ((0, 13), (1, 5), (2, 5)):
            runs = store.get(lay, chain(n, seed))
            out[seed] = [store.contains_prefix(lay, chain(n, seed)), same_pages(joined(runs), pages(lay, n, seed))]
        print(json.dumps(out))
    """, str(tmp_path))
    assert found == {"0": [13, True], "1": [5, True], "2": [5, True]}


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "corrupt":
        path.write_bytes(data[:-10] + bytes([data[-10] ^ 1]) + data[-9:])
    elif how == "empty":
        path.write_bytes(b"")


def test_truncated_corrupt_and_empty_files_are_skipped_with_one_warning(tmp_path):
    lay = layout("page")  # one page an entry
    store = DiskStore(tmp_path)
    hashes, tensors = chain(6), pages(lay, 6)
    store.put(lay, hashes, tensors)
    files = {p.stem: p for p in entry_files(tmp_path)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for page, how in ((4, "truncate"), (2, "corrupt"), (1, "empty")):
            _damage(files[hashes[page].hex()], how)
            runs = store.get(lay, hashes)
            assert sum(run.pages for run in runs) == page  # the pages before the bad one, verified
            assert same_pages(joined(runs), {n: t[:page] for n, t in tensors.items()}) if runs else page == 0
            assert not files[hashes[page].hex()].exists()  # removed
    assert len(store_warnings(caught)) == 1 and "removed" in store_warnings(caught)[0]
    assert store.stats()["store_rejected"] == 3
    assert store.put(lay, hashes, tensors) == 3  # the removed entries are written again
    assert same_pages(joined(store.get(lay, hashes)), tensors)


def test_foreign_files_are_skipped(tmp_path):
    a, b = layout("page"), layout("page", fingerprint=b"model-b")
    store = DiskStore(tmp_path)
    hashes = chain(2)
    store.put(a, hashes, pages(a, 2))
    # an entry of namespace a copied under namespace b's name; a file with another shape under a's name
    target = store._path(b, hashes[0])
    target.parent.mkdir(parents=True, mode=0o700)
    shutil.copy(store._path(a, hashes[0]), target)
    store._path(a, hashes[1]).write_bytes(encode_entry(layout("quant"), 1, hashes[1:], pages(layout("quant"), 1)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert store.get(b, hashes) == []
        assert [run.pages for run in store.get(a, hashes)] == [1]
    assert len(store_warnings(caught)) == 1 and "foreign" in store_warnings(caught)[0]
    assert store.stats()["store_rejected"] == 2 and not target.exists()


def test_a_symlinked_entry_is_not_followed(tmp_path):
    lay = layout("page")
    store = DiskStore(tmp_path / "store")
    hashes = chain(1)
    store.put(lay, hashes, pages(lay, 1))
    path = store._path(lay, hashes[0])
    path.rename(tmp_path / "elsewhere")
    path.symlink_to(tmp_path / "elsewhere")
    with pytest.warns(RuntimeWarning, match="cannot be opened"):
        assert store.get(lay, hashes) == []


def test_a_folder_others_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafeStoreDirectory, match="writable by other users.*keys and values"):
        DiskStore(shared)
    shared.chmod(0o775)
    with pytest.raises(UnsafeStoreDirectory, match="chmod go-w"):
        open_store(f"file://{shared}")
    with pytest.warns(RuntimeWarning, match="continuing without a prefix store"):
        assert open_store(shared, best_effort=True) is None
    shared.chmod(0o755)
    assert isinstance(open_store(shared), DiskStore)
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreUnavailable, match="not a folder"):
        DiskStore(tmp_path / "file")


@pytest.mark.skipif(os.getuid() != 0, reason="giving a folder or file to another user needs root")
def test_folders_and_files_of_another_user_are_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(UnsafeStoreDirectory, match="owned by uid 65534"):
        DiskStore(theirs)
    lay = layout("page")
    store = DiskStore(tmp_path / "mine")
    hashes = chain(2)
    store.put(lay, hashes, pages(lay, 2))
    os.chown(store._path(lay, hashes[1]), 65534, 65534)
    store._path(lay, hashes[0]).chmod(0o666)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert store.get(lay, hashes) == []  # page 0 is writable by others
        store.put(lay, hashes[:1], pages(lay, 1))
        assert [run.pages for run in store.get(lay, hashes)] == [1]  # page 1 belongs to uid 65534
    assert len(store_warnings(caught)) == 1 and store.stats()["store_rejected"] == 2


WRITER = """
    import json, os, sys, time
    from prefix_store_cases import chain, layout, pages
    from hf_paged.prefix_store import DiskStore
    root, go, ready = sys.argv[1], sys.argv[2], sys.argv[3]
    lay = layout("page")
    entries = [(chain(1, seed), pages(lay, 1, seed)) for seed in range(24)]
    store = DiskStore(root)
    open(ready, "w").close()
    while not os.path.exists(go):
        time.sleep(0.001)
    written = sum(store.put(lay, hashes, tensors) for hashes, tensors in entries)
    print(json.dumps({"written": written, "errors": store.stats()["store_errors"]}))
"""


def test_two_processes_writing_the_same_keys_both_succeed(tmp_path):
    root, go = tmp_path / "store", tmp_path / "go"
    DiskStore(root)
    code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\n" + textwrap.dedent(WRITER)
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", code, str(root), str(go), str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in ready]
    deadline = time.monotonic() + 600  # generous: on a loaded machine importing hf_paged takes minutes
    while not all(r.exists() for r in ready) and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()  # both start writing the same 24 keys in the same order at once
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["errors"] == 0 for r in results)
    assert sum(r["written"] for r in results) >= 24  # every key was written by at least one of them
    lay, store = layout("page"), DiskStore(root)
    for seed in range(24):
        assert same_pages(joined(store.get(lay, chain(1, seed))), pages(lay, 1, seed)), seed
    assert len(entry_files(root)) == 24 and not list(root.rglob("*.tmp"))
    assert store.stats()["store_rejected"] == 0


def test_size_cap_evicts_least_recently_used_and_survives_a_restart(tmp_path):
    lay = layout("page")
    entry = len(encode_entry(lay, 0, chain(1), pages(lay, 1)))
    cap = int(entry * 4.5)  # four entries fit; a fifth makes the store evict down to 90% of the cap (four)
    store = DiskStore(tmp_path, max_bytes=cap)
    for seed in range(4):
        store.put(lay, chain(1, seed), pages(lay, 1, seed))
    assert store.get(lay, chain(1, 0))  # seed 0 becomes the most recently used
    store.put(lay, chain(1, 4), pages(lay, 1, 4))
    present = [seed for seed in range(5) if store.contains_prefix(lay, chain(1, seed))]
    assert present == [0, 2, 3, 4] and store.stats()["store_evicted"] == 1
    assert sum(p.stat().st_size for p in entry_files(tmp_path)) <= cap * 0.9
    restarted = DiskStore(tmp_path, max_bytes=cap)  # the sizes come from the files
    restarted.put(lay, chain(1, 5), pages(lay, 1, 5))
    restarted.put(lay, chain(1, 6), pages(lay, 1, 6))
    present = [seed for seed in range(7) if restarted.contains_prefix(lay, chain(1, seed))]
    assert present == [0, 4, 5, 6] and restarted.stats()["store_evicted"] == 2


def test_stale_temporary_files_are_removed_by_a_scan(tmp_path):
    lay = layout("page")
    store = DiskStore(tmp_path, max_bytes=10 << 20)
    store.put(lay, chain(1), pages(lay, 1))
    folder = store._path(lay, chain(1)[0]).parent
    stale, fresh = folder / ".x.safetensors.dead.tmp", folder / ".y.safetensors.live.tmp"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    DiskStore(tmp_path, max_bytes=10 << 20)
    assert not stale.exists() and fresh.exists()


FULL = """
    import json, sys, warnings
    from prefix_store_cases import chain, layout, pages
    from hf_paged.prefix_store import DiskStore
    lay = layout("page")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = DiskStore(sys.argv[1])
        written = [store.put(lay, chain(1, seed), pages(lay, 1, seed)) for seed in range(4)]
        read = store.contains_prefix(lay, chain(1, 0)) and len(store.get(lay, chain(1, 0)))
    print(json.dumps({"written": written, "read": read, "writable": store.writable,
                      "warnings": [str(w.message) for w in caught], "errors": store.stats()["store_errors"]}))
"""


def test_a_file_size_limit_turns_writes_off_with_one_warning(tmp_path):
    lay = layout("page")
    DiskStore(tmp_path).put(lay, chain(1, 0), pages(lay, 1, 0))  # page 0 is there already
    limited = ["python3", "-c", "import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
               "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000)); os.execv(sys.argv[1], sys.argv[1:])"]
    out = run_python(FULL, str(tmp_path), prefix=limited)
    assert out["written"] == [0, 0, 0, 0] and out["read"] == 1 and out["writable"] is False
    assert len(out["warnings"]) == 1 and "file size limit" in out["warnings"][0] and out["errors"] == 1
    assert not list(tmp_path.rglob("*.tmp"))


def _can_mount(tmp_path) -> bool:
    probe = tmp_path / "probe"
    probe.mkdir()
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1m none {probe}"], capture_output=True).returncode == 0


def test_a_full_disk_and_a_read_only_folder_turn_writes_off(tmp_path):
    if not _can_mount(tmp_path):
        pytest.skip("mounting a small tmpfs needs a private mount namespace (unshare -m), not available here")
    mount = tmp_path / "mnt"
    mount.mkdir()
    script = tmp_path / "full.py"
    script.write_text(f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
                      + textwrap.dedent(FULL))
    py = sys.executable
    shell = (f"mount -t tmpfs -o size=1500k,mode=0700 none {mount} && {py} {script} {mount}/s && "
             f"mount -o remount,ro {mount} && {py} {script} {mount}/s")
    result = subprocess.run(["unshare", "-m", "sh", "-c", shell], capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr
    full, read_only = (json.loads(line) for line in result.stdout.strip().splitlines()[-2:])
    assert full["written"][:2] == [1, 1] and full["written"][2:] == [0, 0] and full["writable"] is False
    assert len(full["warnings"]) == 1 and "disk is full" in full["warnings"][0]
    assert read_only["written"] == [0, 0, 0, 0] and read_only["read"] == 1 and read_only["writable"] is False
    assert len(read_only["warnings"]) == 1 and "read-only" in read_only["warnings"][0]


def test_open_store_uris(tmp_path):
    assert open_store(tmp_path / "a").root == tmp_path / "a"
    assert open_store(f"file://{tmp_path}/b%20c").root == tmp_path / "b c"
    assert open_store(f"file://{tmp_path}/d?max_bytes=2G").max_bytes == 2 << 30
    assert open_store(str(tmp_path / "e"), max_bytes="512M").max_bytes == 512 << 20
    store = DiskStore(tmp_path / "f")
    assert open_store(store) is store
    background = open_store(tmp_path / "g", background=True)
    assert isinstance(background, BackgroundWriter) and open_store(background) is background
    background.close()
    with pytest.raises(ValueError, match="unknown prefix store URI scheme 's3'.*redis://"):
        open_store("s3://bucket/kv")
    with pytest.raises(ValueError, match="unknown prefix store URI scheme"):
        open_store("s3://bucket/kv", best_effort=True)  # bad input is not a fault to continue past
    with pytest.raises(ValueError, match="this machine"):
        open_store("file://otherhost/kv")
    with pytest.raises(ValueError, match="max_size"):
        open_store(f"file://{tmp_path}/h?max_size=1G")
    with pytest.raises(ValueError, match="maxmemory"):
        open_store("redis://127.0.0.1:1/0", max_bytes=1 << 20)
    assert [parse_size(s) for s in (1024, "1k", "1.5 GiB", "20GB", "3t")] == [1024, 1024, 3 << 29, 20 << 30, 3 << 40]
    with pytest.raises(ValueError, match="cannot read the size"):
        parse_size("lots")
    with pytest.raises(ValueError, match="max_bytes must be positive"):
        DiskStore(tmp_path / "i", max_bytes=0)
