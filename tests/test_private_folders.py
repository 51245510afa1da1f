"""`hf_paged.paths.unsafe_folder_reason`, the one rule for folders whose files hf_paged trusts (kernel libraries,
the converted model), and the converted model folder (issue 30, item 8: it was used even when another user
owned it)."""

import os
import warnings
from pathlib import Path

import pytest

from hf_paged import assets
from hf_paged.paths import private_folder, unsafe_folder_reason

as_root = pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another user needs root")


def test_a_private_folder_is_trusted_and_its_problems_are_named(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    assert unsafe_folder_reason(private) is None
    os.chmod(private, 0o775)
    assert "writable by other users" in unsafe_folder_reason(private)
    os.chmod(private, 0o755)
    (private / "file").write_text("x")
    assert "is not a folder" in unsafe_folder_reason(private / "file")
    assert "cannot be checked" in unsafe_folder_reason(tmp_path / "missing")


@pytest.mark.parametrize("mode,trusted", [(0o777, False), (0o770, False), (0o1777, True), (0o755, True)])
def test_a_folder_below_one_others_can_write_is_trusted_only_when_that_one_is_sticky(tmp_path, mode, trusted):
    shared = tmp_path / "shared"
    (shared / "mine").mkdir(parents=True, mode=0o700)
    os.chmod(shared, mode)
    reason = unsafe_folder_reason(shared / "mine")
    assert (reason is None) == trusted, reason
    if not trusted:
        assert f"{shared}, above" in reason and "not sticky" in reason


def test_a_link_is_checked_where_it_leads(tmp_path):
    shared = tmp_path / "shared"
    (shared / "target").mkdir(parents=True, mode=0o700)
    os.chmod(shared, 0o777)
    (tmp_path / "link").symlink_to(shared / "target")
    assert "not sticky" in unsafe_folder_reason(tmp_path / "link")


@as_root
def test_folders_of_another_user_are_refused(tmp_path):
    theirs = tmp_path / "theirs"
    (theirs / "mine").mkdir(parents=True, mode=0o700)
    os.chown(theirs / "mine", 65534, 65534)
    assert "owned by uid 65534" in unsafe_folder_reason(theirs / "mine")
    os.chown(theirs / "mine", 0, 0)
    os.chown(theirs, 65534, 65534)
    assert "above" in unsafe_folder_reason(theirs / "mine") and "neither this user nor root" in \
        unsafe_folder_reason(theirs / "mine")


def test_private_folder_falls_back_to_a_new_private_folder(tmp_path):
    folder, reason = private_folder(tmp_path / "new" / "kernels", "hf_paged-test-")
    assert folder == tmp_path / "new" / "kernels" and reason is None and folder.stat().st_mode & 0o777 == 0o700
    os.chmod(tmp_path / "new", 0o777)
    folder, reason = private_folder(tmp_path / "new" / "kernels", "hf_paged-test-")
    assert folder.name.startswith("hf_paged-test-") and unsafe_folder_reason(folder) is None and "not sticky" in reason
    folder.rmdir()


def _fake_convert(calls):
    def convert(out_dir):
        calls.append(out_dir)
        (out_dir / "config.json").write_text('{"fake": true}')
    return convert


@pytest.mark.parametrize("tamper", ["world-writable model folder", "world-writable cache folder",
                                    pytest.param("model folder of another user", marks=as_root)])
def test_a_converted_model_folder_others_control_is_not_used(tmp_path, monkeypatch, tamper):
    cache = tmp_path / "cache"
    planted = cache / "SmolLM2-135M-Instruct.Q4_1"
    planted.mkdir(parents=True)
    (planted / "config.json").write_text('{"planted": true}')
    if tamper == "world-writable model folder":
        os.chmod(planted, 0o777)
    elif tamper == "world-writable cache folder":
        os.chmod(cache, 0o777)
    else:
        os.chown(planted, 65534, 65534)
    monkeypatch.setenv("HF_PAGED_CACHE_DIR", str(cache))
    calls = []
    monkeypatch.setattr(assets, "_convert_gguf", _fake_convert(calls))
    monkeypatch.setattr(assets, "_process_folder", assets._process_folder.__wrapped__)  # a fresh folder here
    with pytest.warns(UserWarning, match="not using the converted model in the cache folder"):
        path = assets.resolve_model_path()
    assert os.path.commonpath([path, str(cache)]) != str(cache) and len(calls) == 1
    assert (Path(path) / "config.json").read_text() == '{"fake": true}'
    assert unsafe_folder_reason(Path(path)) is None


def test_a_private_converted_model_folder_is_used_without_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_PAGED_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(assets, "_convert_gguf", _fake_convert(calls))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = assets.resolve_model_path()
        assert assets.resolve_model_path() == first == str(tmp_path / "cache" / "SmolLM2-135M-Instruct.Q4_1")
    assert len(calls) == 1 and (tmp_path / "cache").stat().st_mode & 0o777 == 0o700
