"""The layer-id convention, shared by every backend and stage (DESIGN.md section 2).

id k (0 <= k < N) is the residual stream *entering* decoder layer k (HF ``hidden_states[k]``;
id 0 is the embeddings). id N is the output of the last layer *before* the final norm.
This is vLLM's ``eagle_aux_hidden_state_layer_ids`` convention.
"""

from __future__ import annotations

from eyas.errors import EyasError

CONVENTION = "vllm-input-of-layer"


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layers; on a target too shallow for those to be distinct (under
    8 layers: [2, 3, 3] for 6), distinct ids spread over 1 .. N-2 instead."""
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) == len(ids) and all(0 <= k < num_layers for k in ids):
        return ids
    lo, hi = min(1, num_layers - 1), max(0, num_layers - 2)
    return sorted({round(lo + (hi - lo) * i / 2) for i in range(3)})


def resolve_layers(num_layers: int, aux: list[int] | None = None) -> tuple[list[int], int]:
    """Validate aux ids for a target with ``num_layers`` decoder layers; returns (aux, final_id)."""
    given = bool(aux)
    aux = list(aux) if aux else default_aux_layers(num_layers)
    if not given and num_layers < 1:
        raise EyasError(f"the target has {num_layers} layers; a draft needs at least one to read")
    bad = [k for k in aux if not 0 <= k < num_layers]
    if bad:
        raise EyasError(
            f"layer ids {bad} out of range: the target has {num_layers} layers, "
            f"so aux ids must lie in 0..{num_layers - 1} (id {num_layers} is the final state)"
        )
    if len(set(aux)) != len(aux):
        raise EyasError(
            f"layer ids {aux} contain duplicates (vLLM dedups them and then fails "
            "with a shape error); pass distinct ids with --layers"
        )
    return sorted(aux), num_layers


def parse_layers(text: str | list[int] | None) -> list[int] | None:
    if not text:
        return None
    if isinstance(text, list):  # a YAML list
        return [int(x) for x in text]
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise EyasError(f"--layers {text!r}: expected comma-separated integers like 2,15,27") from e
