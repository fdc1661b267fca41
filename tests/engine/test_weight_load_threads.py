"""--num-weight-load-threads: the checkpoint read by several threads gives the same tensors, in the
same order, as one thread; the reads happen in the pool's threads; a loader that stops early
leaves no thread behind."""
from __future__ import annotations

import json
import threading

import torch
from safetensors.torch import save_file

from vllm_omni.model_executor import model_loader
from vllm_omni.model_executor.model_loader import iterate_safetensors, load_hf_config, load_model


def _sharded_checkpoint(folder, shards: int = 3, per_shard: int = 5):
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        g = torch.Generator().manual_seed(s)
        tensors = {f"layer{s}.w{i}": torch.randn(3 + i, 7, generator=g) for i in range(per_shard)}
        save_file(tensors, str(folder / name))
        weight_map.update(dict.fromkeys(tensors, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def test_threads_read_the_same_tensors_in_the_same_order(tmp_path, monkeypatch):
    folder = _sharded_checkpoint(tmp_path)
    one = list(iterate_safetensors(folder))
    reading_threads: set[str] = set()
    real_open = model_loader.safe_open

    class SpiedHandle:  # records which threads read tensors (the pool's, not the caller's)
        def __init__(self, *a, **kw):
            self._cm = real_open(*a, **kw)

        def __enter__(self):
            self._f = self._cm.__enter__()
            return self

        def __exit__(self, *exc):
            return self._cm.__exit__(*exc)

        def keys(self):
            return self._f.keys()

        def get_tensor(self, name):
            reading_threads.add(threading.current_thread().name)
            return self._f.get_tensor(name)

    monkeypatch.setattr(model_loader, "safe_open", SpiedHandle)
    four = list(iterate_safetensors(folder, num_threads=4))
    assert [n for n, _ in four] == [n for n, _ in one] and len(one) == 15
    for (_, a), (_, b) in zip(one, four):
        assert torch.equal(a, b)
    assert reading_threads and all(t.startswith("weight-load") for t in reading_threads)


def test_a_loader_that_stops_early_leaves_no_threads(tmp_path):
    folder = _sharded_checkpoint(tmp_path)
    before = {t.ident for t in threading.enumerate()}
    it = iterate_safetensors(folder, num_threads=3)
    next(it)
    it.close()
    assert not [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("weight-load")]


def test_a_model_loads_equal_with_any_number_of_threads(tiny_model):
    path = tiny_model("qwen3")
    config = load_hf_config(path)
    one = load_model(path, config, "float32", "cpu", load_threads=1).state_dict()
    eight = load_model(path, config, "float32", "cpu", load_threads=8).state_dict()
    assert one.keys() == eight.keys()
    assert all(torch.equal(one[k], eight[k]) for k in one)
