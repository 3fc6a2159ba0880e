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
