"""Training in several processes: torchrun starts them, and each runs the train stage on the same
:class:`~eyas.train.config.TrainConfig`, read from a spec file (``python -m eyas.train.launch SPEC``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from eyas.errors import EyasError
from eyas.settings import from_json, to_json
from eyas.train.config import TrainConfig

SPEC = "train-config.json"  # in the run directory: the settings every process trains with


def torchrun(cfg: TrainConfig, launcher: dict[str, Any]) -> Path:
    """Train ``cfg`` under torchrun with the pipeline's ``launcher`` section (nproc_per_node, nnodes,
    rdzv_endpoint, node_rank); returns RUN_DIR/draft."""
    run_dir = Path(cfg.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = run_dir / SPEC
    spec.write_text(to_json(cfg))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={int(launcher.get('nproc_per_node', 1))}",
        f"--nnodes={launcher.get('nnodes', 1)}",
    ]
    if "rdzv_endpoint" in launcher:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={launcher['rdzv_endpoint']}"]
    if "node_rank" in launcher:
        cmd += [f"--node-rank={launcher['node_rank']}"]
    cmd += ["-m", "eyas.train.launch", str(spec)]
    print("train: " + " ".join(cmd), file=sys.stderr, flush=True)
    res = subprocess.run(cmd)
    if res.returncode != 0:
        raise EyasError(
            f"torchrun training exited with {res.returncode}; fix the error above and "
            "re-run `eyas pipeline` (training resumes from its last checkpoint)"
        )
    return run_dir / "draft"


def main(spec: str) -> None:
    """Each torchrun process: the train stage on the spec's settings."""
    import warnings

    from eyas.errors import show_warning
    from eyas.train.trainer import run

    warnings.showwarning = show_warning  # as `eyas` shows them

    run(from_json(TrainConfig, Path(spec).read_text()))


if __name__ == "__main__":
    main(sys.argv[1])
