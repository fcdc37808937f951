"""`eyas export CKPT --format vllm|sglang --out DIR`."""

from __future__ import annotations

from pathlib import Path

import typer

from eyas.checks import checked
from eyas.errors import EyasError
from eyas.fsio import refuse_overlap

FORMATS = ("vllm", "sglang")
DTYPES = {"auto": None, "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


@checked("export")
def export_checkpoint(ckpt_dir: Path, fmt: str, out: Path, target_spec: str | None = None,
                      dtype: str = "auto", verifier: str | None = None,
                      num_speculative_tokens: int = 3, check_identity: bool = True,
                      overwrite: bool = False) -> Path:
    """Check the draft against ``target_spec`` when given, then write the ``fmt`` directory.

    Without a target nothing is resolved (no download, no conversion): the verifier and the
    target's token ids come from what the draft recorded about its target at train time.
    """
    import torch

    from eyas.export.checks import check_against_target, load_checkpoint
    from eyas.export.sglang import export_sglang
    from eyas.export.vllm import export_vllm
    from eyas.target import resolve_target

    if fmt not in FORMATS:
        raise EyasError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise EyasError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    torch_dtype = getattr(torch, DTYPES[dtype]) if DTYPES[dtype] else None
    # --out never is, holds or lies inside an input, with or without --overwrite
    ckpt = load_checkpoint(ckpt_dir)
    inputs = {"the draft CKPT": ckpt_dir, "the --target": target_spec, "the --verifier": verifier}
    refuse_overlap(out, inputs)
    cfg = ckpt.config
    if target_spec is not None:
        target = resolve_target(target_spec)
        inputs["the target's files"] = target.path
        refuse_overlap(out, inputs)
        target_config = target.config()
        check_against_target(ckpt, target_config, target.identity, f"target {target_spec!r}",
                             check_identity=check_identity)
        verifier = verifier or str(target.path)
    else:
        target_config = None
        verifier = verifier or cfg.target_name_or_path
        if fmt == "vllm" and not verifier:
            raise EyasError(f"checkpoint {ckpt_dir}: the draft does not record where its target is "
                            "(trained by an older eyas); pass --target (checked against the draft) "
                            "or --verifier NAME_OR_PATH (the model vLLM should load as the verifier)")
    if cfg.draft_vocab_size == cfg.vocab_size:
        # vLLM has no d2t parameter when the vocabularies are equal: only the identity map is valid.
        if bool((ckpt.tensors["d2t"] != 0).any()):
            raise EyasError(f"checkpoint {ckpt_dir}: draft_vocab_size equals the target vocab but d2t "
                            "is not the identity; vLLM cannot load such a mapping")
        ckpt.tensors.pop("d2t")
        ckpt.tensors.pop("t2d", None)
    if fmt == "sglang":
        return export_sglang(ckpt, target_config, out, torch_dtype, overwrite=overwrite, inputs=inputs)
    from eyas.fsio import sha256_file

    return export_vllm(ckpt, target_config, out, verifier, torch_dtype,
                       num_speculative_tokens, overwrite=overwrite, inputs=inputs,
                       source_sha256=sha256_file(Path(ckpt_dir) / "model.safetensors"))


def register(app: typer.Typer) -> None:
    @app.command("export")
    def export_cmd(
        ckpt: Path = typer.Argument(..., help="Draft checkpoint directory (RUN_DIR/draft from `eyas train`)."),
        fmt: str = typer.Option("vllm", "--format", help="vllm (speculators-style, `vllm serve DIR`) or "
                                "sglang (LlamaForCausalLMEagle3, also loaded by vLLM)."),
        out: Path = typer.Option(..., "--out", help="Directory to write."),
        target: str = typer.Option(None, "--target",
                                   help="The target the draft serves: checked against the draft's "
                                   "layer ids, hidden size, vocab and identity. Default: none; the "
                                   "draft's record of its target is used and nothing is resolved."),
        dtype: str = typer.Option("auto", help="auto (keep), bfloat16, float16 or float32."),
        verifier: str = typer.Option(None, help="name_or_path recorded as the verifier (vllm format; "
                                     "default: the --target's local path, else the target path "
                                     "recorded in the draft at train time)."),
        num_speculative_tokens: int = typer.Option(3, "--num-speculative-tokens", "-k",
                                                   help="Default k recorded in the vllm format."),
        ignore_identity: bool = typer.Option(False, help="Allow a target whose weights/tokenizer "
                                             "fingerprint differs from the one the draft was trained on."),
        overwrite: bool = typer.Option(False, help="Replace --out if it exists."),
    ) -> None:
        """Export a trained draft for vLLM (speculators format) or SGLang (EAGLE-3 format)."""
        path = export_checkpoint(ckpt, fmt, out, target, dtype, verifier, num_speculative_tokens,
                                 check_identity=not ignore_identity, overwrite=overwrite)
        typer.echo(f"wrote {fmt} draft to {path}")
