"""`eyas export`: a trained draft -> the directory vLLM (speculators format) or SGLang loads."""

from __future__ import annotations

import sys
from pathlib import Path

from eyas.errors import EyasError
from eyas.export.config import ExportConfig
from eyas.fsio import refuse_overlap
from eyas.outdir import check_out, writer_lock


def run(cfg: ExportConfig) -> Path:
    """The export stage's entry point (`eyas export`, the pipeline, evaluate's vllm engine): check the
    draft against ``cfg.target`` when given, then write the ``cfg.format`` directory with its model
    card; returns that directory.

    Without a target nothing is resolved (no download, no conversion): the verifier and the
    target's token ids come from what the draft recorded about its target at train time.
    """
    import torch

    ckpt_dir, out, target_spec, dtype, verifier = cfg.ckpt, cfg.out, cfg.target, cfg.dtype, cfg.verifier
    torch_dtype = None if dtype == "auto" else getattr(torch, dtype)  # ExportConfig's dtype names are torch's
    # --out never is, holds or lies inside an input, with or without --overwrite; it is a folder this
    # process can write (and replace: not the current folder), held by this process alone
    check_out(
        out,
        inputs={
            "the draft CKPT": ckpt_dir,
            "the --target": target_spec,
            "the --verifier": verifier,
            "the --speed-report": cfg.speed_report,
        },
        replaces=True,
    )
    with writer_lock(out, command="eyas export"):
        path = _export(cfg, torch_dtype)
    print(f"wrote {cfg.format} draft to {path}, with its model card {path / 'README.md'}", file=sys.stderr, flush=True)
    return path


def _export(cfg: ExportConfig, torch_dtype) -> Path:
    """The export directory, then its model card (README.md, :mod:`eyas.export.card`)."""
    from eyas.export.card import read_speed_report, write_card

    # the report is checked before anything is written
    report = read_speed_report(cfg.speed_report, cfg.ckpt) if cfg.speed_report is not None else None
    out = _write_export(cfg, torch_dtype)
    write_card(out, cfg.ckpt, cfg.speed_report, report)
    return out


def _write_export(cfg: ExportConfig, torch_dtype) -> Path:
    from eyas.draft.checks import check_against_target, load_checkpoint
    from eyas.export.sglang import export_sglang
    from eyas.export.vllm import export_vllm
    from eyas.target import resolve_target

    ckpt_dir, fmt, out, target_spec, verifier = cfg.ckpt, cfg.format, cfg.out, cfg.target, cfg.verifier
    ckpt = load_checkpoint(ckpt_dir)
    inputs = {
        "the draft CKPT": ckpt_dir,
        "the --target": target_spec,
        "the --verifier": verifier,
        "the --speed-report": cfg.speed_report,
    }
    refuse_overlap(out, inputs)
    dcfg = ckpt.config
    if target_spec is not None:
        target = resolve_target(target_spec)
        inputs["the target's files"] = target.path
        refuse_overlap(out, inputs)
        target_config = target.config()
        check_against_target(
            ckpt, target_config, target.identity, f"target {target_spec!r}", check_identity=cfg.check_identity
        )
        verifier = verifier or str(target.path)
    else:
        target_config = None
        verifier = verifier or dcfg.target_name_or_path
        if fmt == "vllm" and not verifier:
            raise EyasError(
                f"checkpoint {ckpt_dir}: the draft does not record where its target is; pass "
                "--target (checked against the draft) or --verifier NAME_OR_PATH (the model vLLM "
                "should load as the verifier)"
            )
    if dcfg.draft_vocab_size == dcfg.vocab_size:
        # vLLM has no d2t parameter when the vocabularies are equal: only the identity map is valid.
        if bool((ckpt.tensors["d2t"] != 0).any()):
            raise EyasError(
                f"checkpoint {ckpt_dir}: draft_vocab_size equals the target vocab but d2t "
                "is not the identity; vLLM cannot load such a mapping"
            )
        ckpt.tensors.pop("d2t")
        ckpt.tensors.pop("t2d", None)
    if fmt == "sglang":
        return export_sglang(ckpt, target_config, out, torch_dtype, overwrite=cfg.overwrite, inputs=inputs)
    from eyas.fsio import sha256_file

    return export_vllm(
        ckpt,
        target_config,
        out,
        verifier,
        torch_dtype,
        cfg.num_speculative_tokens,
        overwrite=cfg.overwrite,
        inputs=inputs,
        source_sha256=sha256_file(Path(ckpt_dir) / "model.safetensors"),
    )
