"""Safe checkpoints: safetensors round trips, and pickles that would run code are refused."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

import attnkit
from attnkit.checkpoints import load_checkpoint, load_module, safe_torch_load, save_checkpoint


class _CreatesFile:
    """A pickle payload that, if unpickled by plain pickle, creates the file at ``target``."""

    def __init__(self, target: Path) -> None:
        self.target = str(target)

    def __reduce__(self):
        return (open, (self.target, "w"))


def _write_malicious(path: Path, target: Path) -> None:
    with open(path, "wb") as f:
        pickle.dump({"weight": _CreatesFile(target)}, f, protocol=2)


def test_malicious_pickle_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    _write_malicious(evil, target)
    # The payload is real: plain pickle would create the file.
    with open(evil, "rb") as f:
        pickle.load(f).get("weight").close()
    assert target.exists()
    target.unlink()
    with pytest.raises(ValueError, match=r"refusing to load .*evil\.pt.*nothing in it was run"):
        safe_torch_load(evil)
    with pytest.raises(ValueError, match="refusing to load"):
        load_checkpoint(evil)
    assert not target.exists()


def test_plain_torch_save_loads(tmp_path: Path) -> None:
    state = {"w": torch.randn(3, 4), "b": torch.arange(4)}
    torch.save(state, tmp_path / "ok.pt")
    loaded = load_checkpoint(tmp_path / "ok.pt")
    assert loaded.keys() == state.keys()
    for k in state:
        assert torch.equal(loaded[k], state[k])


def test_torch_file_without_state_dict_is_rejected(tmp_path: Path) -> None:
    torch.save([torch.ones(2)], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="does not hold a state dict"):
        load_checkpoint(tmp_path / "list.pt")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_module_round_trip_is_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    mha = attnkit.MultiHeadAttention(6, 8, 10, 0.0, num_heads=2, qkv_bias=True).to(dtype)
    path = save_checkpoint(mha, tmp_path / "mha.safetensors", metadata={"format": "attnkit"})
    assert path.read_bytes()[:8] != b"\x80\x04\x95"  # not a pickle
    torch.manual_seed(1)
    other = attnkit.MultiHeadAttention(6, 8, 10, 0.0, num_heads=2, qkv_bias=True).to(dtype)
    load_module(other, path)
    for (k, a), (_, b) in zip(mha.state_dict().items(), other.state_dict().items(), strict=True):
        assert a.dtype == b.dtype == dtype, k
        assert torch.equal(a, b), k
    x = torch.randn(2, 5, 6, dtype=dtype)
    assert torch.equal(mha(x), other(x))


def test_tied_and_view_tensors_are_saved(tmp_path: Path) -> None:
    base = torch.randn(4, 6)
    state = {"emb": base, "head": base, "half": base[:2]}  # tied weight and a view
    save_checkpoint(state, tmp_path / "tied.safetensors")
    loaded = load_checkpoint(tmp_path / "tied.safetensors")
    assert torch.equal(loaded["emb"], base)
    assert torch.equal(loaded["head"], base)
    assert torch.equal(loaded["half"], base[:2])


def test_save_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\.safetensors.*model\.pt"):
        save_checkpoint({"w": torch.ones(1)}, tmp_path / "model.pt")
    with pytest.raises(TypeError, match="'w' is a list"):
        save_checkpoint({"w": [1.0]}, tmp_path / "a.safetensors")
    with pytest.raises(TypeError, match="state dict or an nn.Module"):
        save_checkpoint(torch.ones(2), tmp_path / "a.safetensors")
    with pytest.raises(TypeError, match="metadata"):
        save_checkpoint({"w": torch.ones(1)}, tmp_path / "a.safetensors", metadata={"n": 1})


def test_load_rejects_missing_and_corrupt_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path / "absent.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        load_checkpoint(bad)


def test_load_module_strict_reports_missing_keys(tmp_path: Path) -> None:
    save_checkpoint({"W_query.weight": torch.ones(2, 3)}, tmp_path / "part.safetensors")
    with pytest.raises(RuntimeError, match="Missing key"):
        load_module(attnkit.SelfAttentionV2(3, 2), tmp_path / "part.safetensors")


# --- regressions from the reliability audit ---------------------------------------------------


def test_tied_weights_are_written_once_and_come_back_tied(tmp_path: Path) -> None:
    from safetensors import safe_open

    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied, as GPT-2 does
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    path = save_checkpoint(model, tmp_path / "tied.safetensors")
    with safe_open(str(path), framework="pt") as f:
        assert list(f.keys()) == ["emb.weight"]  # one copy on disk
    loaded = load_checkpoint(path)
    assert loaded["head.weight"] is loaded["emb.weight"]
    other = torch.nn.ModuleDict(
        {"emb": torch.nn.Embedding(10, 4), "head": torch.nn.Linear(4, 10, bias=False)}
    )
    other["head"].weight = other["emb"].weight
    load_module(other, path)
    assert torch.equal(other["head"].weight, emb.weight)
    assert other["head"].weight is other["emb"].weight


def test_empty_and_truncated_pt_files_raise_value_error(tmp_path: Path) -> None:
    (tmp_path / "empty.pt").write_bytes(b"")
    torch.save({"w": torch.ones(64)}, tmp_path / "ok.pt")
    data = (tmp_path / "ok.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 3])
    for name in ("empty.pt", "cut.pt"):
        with pytest.raises(ValueError, match=name) as info:
            safe_torch_load(tmp_path / name)
        assert "\n" not in str(info.value)


def _umask() -> int:
    import os

    old = os.umask(0)
    os.umask(old)
    return old


def test_checkpoint_files_have_normal_permissions_and_no_temporaries(tmp_path: Path) -> None:
    import os
    import stat

    from attnkit.checkpoints import write_directory

    d = write_directory(tmp_path / "ck", {"a.bin": b"1", "b.bin": lambda p: p.write_bytes(b"2")})
    save_checkpoint({"w": torch.ones(2)}, d / "w.safetensors")
    expected_file, expected_dir = 0o666 & ~_umask(), 0o777 & ~_umask()
    for p in [*d.iterdir()]:
        assert stat.S_IMODE(os.stat(p).st_mode) == expected_file, p  # not mkstemp's 0600
    assert stat.S_IMODE(os.stat(d).st_mode) == expected_dir  # not mkdtemp's 0700
    write_directory(d, {"a.bin": b"3"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no .ck.new-* / .ck.old-*
    assert not [p for p in d.iterdir() if p.name.startswith(".")]


def test_directory_save_is_whole_and_keeps_other_files(tmp_path: Path) -> None:
    from attnkit.checkpoints import CheckpointError, read_directory, write_directory

    d = write_directory(tmp_path / "ck", {"model.bin": b"old", "config.json": b"{}"})
    (d / "loss.png").write_bytes(b"picture")
    (d / "attention").mkdir()
    (d / "attention" / "layer0.png").write_bytes(b"map")
    write_directory(d, {"model.bin": b"new", "config.json": b'{"step": 2}'})
    assert (d / "model.bin").read_bytes() == b"new"
    assert (d / "loss.png").read_bytes() == b"picture"  # carried over
    assert (d / "attention" / "layer0.png").read_bytes() == b"map"
    assert set(read_directory(d)) == {"model.bin", "config.json"}
    (d / "model.bin").write_bytes(b"neW")  # same size, other bytes: a torn save
    with pytest.raises(CheckpointError, match="torn checkpoint .*model.bin"):
        read_directory(d)
    (d / "model.bin").unlink()
    with pytest.raises(CheckpointError, match="model.bin is missing"):
        read_directory(d)
    with pytest.raises(ValueError, match="bad checkpoint file name"):
        write_directory(d, {"../escape": b""})


def test_directory_save_through_a_symlink_writes_the_target(tmp_path: Path) -> None:
    from attnkit.checkpoints import read_directory, write_directory

    real = write_directory(tmp_path / "real", {"model.bin": b"old"})
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    assert write_directory(link, {"model.bin": b"new"}) == real.resolve()
    assert link.is_symlink() and (real / "model.bin").read_bytes() == b"new"
    assert set(read_directory(link)) == {"model.bin"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]  # no leftovers


def test_directory_lock_is_exclusive_and_shared_by_a_link(tmp_path: Path) -> None:
    from attnkit.checkpoints import CheckpointLockedError, lock_directory

    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    with lock_directory(real) as path:
        assert path == tmp_path.resolve() / ".real.lock"
        with (
            pytest.raises(CheckpointLockedError, match="in use by another process"),
            lock_directory(tmp_path / "link"),
        ):
            pass
    assert not path.exists()  # removed on leaving the block
    with lock_directory(tmp_path / "link"):  # and free again
        pass
