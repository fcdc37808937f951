"""Pipeline configuration: one YAML file, one section per stage.

Each section's keys are exactly the fields of that stage's settings dataclass, the same fields that
make the stage's CLI (:mod:`eyas.settings`), so the CLI, the config file and the API can never
drift apart: :func:`validate` checks every key against the dataclass and names the unknown ones.
"""

from __future__ import annotations

from dataclasses import fields
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from eyas.errors import EyasError

# a section per stage: its settings dataclass, less the fields the pipeline wires itself (WIRED)
from eyas.stages import STAGES, WIRED, PipelineConfig, stage_settings

TOP_LEVEL = {"target", "workdir", "features", "launcher", *STAGES}


def default_config_text() -> str:
    return resources.files("eyas").joinpath("default.yaml").read_text()


def load_config(path: str | Path | None = None) -> PipelineConfig:
    """Load and validate a pipeline config; ``None`` gives the default job."""
    if path is None:
        raw, source = yaml.safe_load(default_config_text()), "<default>"
    else:
        p = Path(path)
        if not p.is_file():
            raise EyasError(f"config {p}: no such file")
        raw, source = load_yaml(p), str(p)
    if not isinstance(raw, dict):
        raise EyasError(f"config {source}: expected a mapping of sections, got {type(raw).__name__}")
    return validate(raw, source)


# A pipeline config is a few hundred bytes; these bound what a file can make the loader build (an
# "alias bomb": a few lines of anchors whose aliases expand into billions of values).
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_NODES = 100_000  # values after every alias is expanded


def load_yaml(path: Path) -> Any:
    """``yaml.safe_load`` of ``path``, refused (one line, fast) when the file is over
    :data:`MAX_CONFIG_BYTES` or would expand into more than :data:`MAX_CONFIG_NODES` values through
    its aliases; counting walks the composed node graph once per node, not per expansion."""
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise EyasError(
            f"config {path}: {size:,} bytes; a pipeline config is a few hundred, this reads at "
            f"most {MAX_CONFIG_BYTES:,}: pass the YAML config, not a data file"
        )
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise EyasError(f"config {path}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is not None:
            n = _expanded_size(node, {}, set())
            if n > MAX_CONFIG_NODES:
                raise EyasError(
                    f"config {path}: its aliases (*name) expand to more than {MAX_CONFIG_NODES:,} "
                    "values, the most a config may hold; write the values out or use fewer "
                    "aliases (nothing was loaded)"
                )
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise EyasError(f"config {path}: not valid YAML ({str(e)[:500]})") from None
    except RecursionError:
        raise EyasError(f"config {path}: nested too deeply to read; a config is a few levels deep") from None


def _expanded_size(node: Any, memo: dict[int, int], active: set[int]) -> int:
    """Values ``node`` stands for with every alias expanded (an alias is the very node it names, so
    ``memo`` counts each node once); stops counting past the limit. A node that contains itself is
    refused."""
    key = id(node)
    if key in memo:
        return memo[key]
    if key in active:
        raise EyasError("config: an alias refers to a value that contains it (a recursive alias); write the values out")
    active.add(key)
    total = 1
    if isinstance(node, yaml.MappingNode):
        children = [x for kv in node.value for x in kv]
    elif isinstance(node, yaml.SequenceNode):
        children = list(node.value)
    else:
        children = []
    for child in children:
        total += _expanded_size(child, memo, active)
        if total > MAX_CONFIG_NODES:
            break
    active.discard(key)
    memo[key] = total
    return total


def _check_section(name: str, section: dict[str, Any], source: str) -> dict[str, Any]:
    """Each value against its field's type, range and allowed values (eyas.checks), so that a bad
    value stops the pipeline before prepare runs; returns the section with numbers YAML read as
    strings converted."""
    from eyas.checks import check_values, hints, ranges_of
    from eyas.settings import nested_class

    cls = stage_settings(name)
    types_ = hints(cls)
    nested = {}
    for key in [k for k in section if nested_class(types_.get(k)) is not None]:
        inner, value = nested_class(types_[key]), section[key]
        if isinstance(value, dict):
            params = {f.name for f in fields(inner)}
            bad = sorted(set(value) - params)
            if bad:
                raise EyasError(f"config {source}: {name}.{key} has unknown keys {bad}; allowed: {sorted(params)}")
            nested[key] = check_values(
                value, hints(inner), ranges_of(inner), lambda k, key=key: f"config {source}: {name}.{key}.{k}"
            )
        elif value not in (True, False, None):
            raise EyasError(
                f"config {source}: {name}.{key} = {value!r}: expected true, false or a mapping of {key} settings"
            )
        else:
            nested[key] = value
    plain = {k: v for k, v in section.items() if k not in nested}
    out = check_values(plain, types_, ranges_of(cls), lambda k: f"config {source}: {name}.{k}")
    if "device" in plain and name in ("extract", "evaluate"):
        from eyas.device import DEVICE_FORM

        if not DEVICE_FORM.fullmatch(str(plain["device"])):  # the form only: the GPU is looked for at run time
            raise EyasError(f"config {source}: {name}.device {plain['device']!r}: choose auto, cpu, cuda or cuda:N")
    # keep the config's own spelling except for numbers YAML left as strings (lr: 1e-4)
    kept = {k: out[k] if isinstance(v, str) and isinstance(out[k], (int, float)) else v for k, v in plain.items()}
    return {**kept, **nested}


def validate(raw: dict[str, Any], source: str = "<config>") -> PipelineConfig:
    unknown = set(raw) - TOP_LEVEL
    if unknown:
        raise EyasError(f"config {source}: unknown top-level keys {sorted(unknown)}; allowed: {sorted(TOP_LEVEL)}")
    if "target" not in raw:
        raise EyasError(f"config {source}: 'target' is required (a model dir, .gguf or built-in name)")
    from eyas.checks import check_values
    from eyas.train.config import FeatureSource

    features = check_values(
        {"features": raw.get("features", "online")}, {"features": FeatureSource}, {}, lambda k: f"config {source}: {k}"
    )["features"]
    sections: dict[str, dict[str, Any]] = {}
    for name in STAGES:
        section = raw.get(name) or {}
        if not isinstance(section, dict):
            raise EyasError(f"config {source}: section {name!r} must be a mapping")
        allowed = {f.name for f in fields(stage_settings(name))} - WIRED[name]
        bad = sorted(set(section) - allowed)
        if bad:
            raise EyasError(f"config {source}: section {name!r} has unknown keys {bad}; allowed: {sorted(allowed)}")
        sections[name] = _check_section(name, section, source)
    from eyas.evaluate.config import EvaluateConfig, check_k
    from eyas.settings import default_of

    ev, ev_fields = sections["evaluate"], {f.name: f for f in fields(EvaluateConfig)}
    check_k(
        *(ev.get(k, default_of(ev_fields[k])) for k in ("k", "also_k", "max_new_tokens")),
        where=f"config {source}: ",
        names=("evaluate.k", "evaluate.also_k", "evaluate.max_new_tokens"),
    )
    launcher = raw.get("launcher") or {}
    bad = sorted(set(launcher) - {"nproc_per_node", "nnodes", "rdzv_endpoint", "node_rank"})
    if bad:
        raise EyasError(f"config {source}: launcher has unknown keys {bad}")
    return PipelineConfig(
        target=str(raw["target"]),
        workdir=Path(raw.get("workdir", "runs/default")),
        features=features,
        launcher=launcher,
        sections=sections,
        source=source,
    )
