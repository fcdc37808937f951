"""Writes tests/data/store-v1-bf16 with eyas at edfadac (the store format before fp8)."""
import sys, torch
from eyas.extract.store import StoreWriter
out = sys.argv[1]
fields = {"target": {"id": "fixture"}, "aux_layers": [1, 2], "final_layer": 4, "convention": "vllm-input-of-layer",
          "dtype": "bf16", "hidden_size": 8, "num_samples": 3}
w = StoreWriter(out, fields, shard_tokens=5, num_writers=1)
for i in range(3):
    T = 4 + i
    s = (torch.arange(T * 3 * 8, dtype=torch.float32).reshape(T, 3, 8) * 0.37 - i)
    w.add(i, torch.arange(T) + 10 * i, torch.arange(T) % 2 == 0, s[:, :2], s[:, 2])
print(w.close()["complete"])
