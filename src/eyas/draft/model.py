"""The EAGLE-3 draft head: fc over the target's aux states, one Llama layer of width 2H in, lm_head.

Parameter names are those of the SGLang/EAGLE checkpoint (``midlayer.*``, ``fc``, ``norm``,
``lm_head``, ``d2t``, ``t2d``) that vLLM also loads, so export is a rename-free copy.

Alignment (as vLLM serves it): at position i the draft takes the target's features of position
i and the embedding of token x[i+1] and predicts x[i+2]. Training-time-test (TTT) step j at
position i takes the draft's own hidden from step j-1 and token x[i+1+j], RoPE position i+j,
predicts x[i+2+j], and attends to the step-0 keys of positions <= i (same document) plus the
keys of steps 1..j of its own chain: exactly what :meth:`Eagle3Draft.step` with a
:class:`DraftKVCache` sees at inference. Both run the one decoder layer through
:meth:`Eagle3Draft.layer`; they differ only in what the queries attend to.

Reading order: :class:`DraftConfig`, the layer's parts (:class:`Attention`, :class:`MLP`,
:class:`MidLayer`), :class:`Eagle3Draft` (``layer``, then ``step`` for inference and ``forward`` for
the TTT unroll). Saving and loading a draft: :mod:`eyas.draft.io`.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eyas.draft import flex
from eyas.errors import EyasError

CONFIG_KIND = "eyas-eagle3-draft"


@dataclass
class DraftConfig:
    """Shape of the draft; JSON-serialisable (``config.json`` of a draft checkpoint)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    aux_layer_ids: list[int]
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    # The residual around attention starts from the *normed* fused hidden (vLLM's and speculators'
    # default; EAGLE-3's original head used the raw one): the raw fc output carries the target's
    # outliers.
    norm_before_residual: bool = True
    # RMSNorm on each aux layer's state before fc (vLLM's `fc_norm`): the target's layers differ in
    # scale by an order of magnitude (SmolLM2: RMS ~3, ~6, ~23 at layers 2, 15, 27), which an
    # un-normalised fc sees as one dominant input. Served by vLLM 0.32.0, not by 0.16.0.
    fc_norm: bool = False
    # One RMSNorm over the whole concatenation instead (vLLM's and speculators' `norm_before_fc`,
    # speculators 0.9.0's EAGLE-3 default); exclusive with fc_norm. Served by vLLM 0.32.0.
    norm_before_fc: bool = False
    # Feed the *normed* output hidden to the next draft step (vLLM's `norm_output`, "EAGLE 3.1",
    # speculators 0.9.0's default): keeps its scale from drifting across steps. vLLM 0.32.0.
    norm_output: bool = False
    target_num_layers: int = 0
    target_model_type: str = "llama"
    target_architectures: list[str] = field(default_factory=list)
    target: dict[str, str] = field(default_factory=dict)  # target identity
    # Where the target was (its resolved local directory) and how it was named (--target) at
    # train time: `eyas export` takes the verifier from here without resolving the target.
    target_name_or_path: str = ""
    target_spec: str = ""
    target_token_ids: dict[str, Any] = field(default_factory=dict)  # bos/eos/pad_token_id
    kind: str = CONFIG_KIND

    def __post_init__(self) -> None:
        check_fields(self)
        if self.fc_norm and self.norm_before_fc:
            raise EyasError(
                "draft config: fc_norm (a norm per aux layer) and norm_before_fc (one norm "
                "over their concatenation) exclude each other; set one of them"
            )

    @property
    def serving_options(self) -> list[str]:
        """The options set that older servers ignore (vLLM 0.16 reads none of them)."""
        return [k for k in ("fc_norm", "norm_before_fc", "norm_output") if getattr(self, k)]

    @classmethod
    def from_target(
        cls,
        target_config: dict[str, Any],
        aux_layer_ids: list[int],
        draft_vocab_size: int,
        identity: dict[str, str] | None = None,
        **overrides: Any,
    ) -> "DraftConfig":
        """Defaults from the target's HF ``config.json``; any field can be overridden (None = keep)."""
        tc = target_config.get("text_config", target_config)  # multimodal wrappers
        h = tc["hidden_size"]
        heads = tc["num_attention_heads"]
        rope = tc.get("rope_parameters") or {}
        theta = rope.get("rope_theta", tc.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"} or tc.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = None
        cfg = dict(
            hidden_size=h,
            num_attention_heads=heads,
            num_key_value_heads=tc.get("num_key_value_heads") or heads,
            head_dim=tc.get("head_dim") or h // heads,
            intermediate_size=tc.get("intermediate_size") or 4 * h,
            vocab_size=tc["vocab_size"],
            draft_vocab_size=draft_vocab_size,
            aux_layer_ids=list(aux_layer_ids),
            target_hidden_size=h,
            rms_norm_eps=tc.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=tc.get("max_position_embeddings", 4096),
            target_num_layers=tc.get("num_hidden_layers", 0),
            target_model_type=tc.get("model_type", "llama"),
            target_architectures=list(target_config.get("architectures") or []),
            target=dict(identity or {}),
            target_token_ids={
                k: tc[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if tc.get(k) is not None
            },
        )
        cfg.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**cfg)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DraftConfig":
        if data.get("kind") != CONFIG_KIND:
            raise EyasError(
                f"draft config has kind {data.get('kind')!r}, expected {CONFIG_KIND!r}: "
                "pass a directory written by `eyas train` (RUN_DIR/draft)"
            )
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)


# Fields that size a tensor: each a positive integer (an integral float such as 2048.0 is taken).
_SIZES = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "draft_vocab_size",
    "target_hidden_size",
    "max_position_embeddings",
)


def _value_problem(name: str, v: Any) -> tuple[Any, str | None]:
    """(the value, an integral float made an int; what is wrong with it or None) for a checked field."""
    if name in _SIZES or name == "target_num_layers":
        if isinstance(v, float) and math.isfinite(v) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            return v, "is not an integer; expected a positive integer"
        if v < (0 if name == "target_num_layers" else 1):
            return v, "must be >= 0" if name == "target_num_layers" else "must be >= 1"
    elif name in ("rms_norm_eps", "rope_theta"):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            return v, "must be a finite number > 0"
    elif name == "aux_layer_ids":
        if not isinstance(v, list) or not v or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in v):
            return v, "must be a non-empty list of layer ids >= 0"
    return v, None


def check_fields(cfg: "DraftConfig") -> None:
    """Types and ranges of a draft config's numbers, whether they come from ``--draft-config`` or a
    draft's config.json: one line naming the field and the value, before any tensor is made."""
    for name in (*_SIZES, "target_num_layers", "rms_norm_eps", "rope_theta", "aux_layer_ids"):
        v, problem = _value_problem(name, getattr(cfg, name))
        if problem:
            raise EyasError(
                f"draft config: {name} = {v!r} {problem} (set by --draft-config, or in the "
                "config.json of the draft or checkpoint read); change it"
            )
        setattr(cfg, name, v)
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise EyasError(
            f"draft config: num_key_value_heads = {cfg.num_key_value_heads} must divide "
            f"num_attention_heads ({cfg.num_attention_heads}); change it"
        )


def check_override_values(overrides: dict[str, Any]) -> None:
    """``--draft-config`` values checked as :func:`check_fields` checks a whole config, before any
    target loads (``intermediate_size=abc``, ``=-5``)."""
    for name, v in overrides.items():
        _, problem = _value_problem(name, v)
        if problem:
            raise EyasError(f"--draft-config: {name} = {v!r} {problem}; change it")


class RMSNorm(nn.Module):
    """Llama RMSNorm (computed in fp32, weight applied in the input dtype)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """RoPE for the draft; scaled variants come from transformers' own init functions."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        if cfg.rope_scaling:
            from transformers import LlamaConfig
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            params = dict(cfg.rope_scaling)
            rtype = params.get("rope_type", params.get("type"))
            params.update(rope_type=rtype, rope_theta=cfg.rope_theta)
            lc = LlamaConfig(
                hidden_size=cfg.hidden_size,
                num_attention_heads=cfg.num_attention_heads,
                head_dim=cfg.head_dim,
                max_position_embeddings=cfg.max_position_embeddings,
                rope_parameters=params,
            )
            inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[rtype](lc, None)
        else:
            d = cfg.head_dim
            inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
            self.scaling = 1.0
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [B, T, head_dim] in fp32."""
        freqs = position_ids.float()[..., None] * self.inv_freq.to(position_ids.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, d]; cos/sin: [B, T, d]."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """The layer's attention as three pieces, ``qkv`` -> (the caller's attention) -> ``out``: the TTT
    unroll and ``step`` attend to different keys (a block-sparse TTT pattern or a KV cache), so the
    attention itself is theirs. These are methods, not ``forward``, and they are called
    ``ttt_steps`` times per forward: under FSDP2 this module is therefore no unit of its own (a unit
    re-gathers its parameters on every call of its *forward* and would never unshard for these);
    the root unit gathers them once per forward (:mod:`eyas.train.parallel`)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(2 * h, self.nh * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.nkv * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.nkv * d, bias=False)
        self.o_proj = nn.Linear(self.nh * d, h, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """RoPE'd queries [B, heads, T, d] and keys, and values [B, kv_heads, T, d]."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.d).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def expand_kv(self, kv: torch.Tensor) -> torch.Tensor:
        rep = self.nh // self.nkv
        return kv if rep == 1 else kv.repeat_interleave(rep, dim=1)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.nh * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise EyasError(f"draft hidden_act {cfg.hidden_act!r}: only 'silu' is supported")
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The draft's one decoder layer; attention input is concat(norm(embed), norm(hidden)).

    Like :class:`Attention` it is used through methods, ``pre`` (norms, residual) and ``post``
    (residual, MLP), around the caller's attention, ``ttt_steps`` times per forward; so it is no
    FSDP2 unit (one per call would multiply the all-gathers and reduce-scatters by ``ttt_steps``,
    and methods other than ``forward`` would run on shards): the root unit holds it."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def pre(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input [B,T,2H], residual) as in vLLM's llama_eagle3 layer 0."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.cfg.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(embeds), normed], dim=-1), residual

    def post(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Residual + MLP; returns the layer's (pre-norm) output."""
        residual = attn_out + residual
        return residual + self.mlp(self.post_attention_layernorm(residual))


class DraftKVCache:
    """The draft layer's keys/values in the order they were appended ([B, kv_heads, L, d])."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, length: int) -> None:
        """Drop entries past ``length`` (after the target rejected drafted tokens)."""
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]

    def clone(self) -> "DraftKVCache":
        c = DraftKVCache()
        c.k = None if self.k is None else self.k.clone()
        c.v = None if self.v is None else self.v.clone()
        return c


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, h, bias=False)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.num_aux))
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(cfg.num_aux * cfg.target_hidden_size, cfg.rms_norm_eps)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.rotary = Rotary(cfg)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self._regions: tuple | None = None  # compiled (_layer_in, _layer_out), see compile_regions
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        nn.init.normal_(self.embed_tokens.weight, std=std)

    def target_ids(self) -> torch.Tensor:
        """The target's token id of each draft-vocab id (``d2t`` holds the offsets), on d2t's device."""
        d2t = self.d2t.to(torch.long)
        return torch.arange(d2t.numel(), device=d2t.device) + d2t

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """fc over the concatenated aux states [.., num_aux*H_t] (normed first with fc_norm or
        norm_before_fc)."""
        if self.config.norm_before_fc:
            aux = self.input_norm(aux)
        if self.config.fc_norm:
            chunks = aux.chunk(self.config.num_aux, dim=-1)
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    # ------------------------------------------------------------------ inference

    def features_to_hidden(self, features: torch.Tensor) -> torch.Tensor:
        """Target aux states [.., num_aux*H_t] go through fc; the draft's own hidden [.., H] passes."""
        cfg = self.config
        width = cfg.num_aux * cfg.target_hidden_size
        if features.shape[-1] == width and width != cfg.hidden_size:
            return self.combine(features)
        if features.shape[-1] == cfg.hidden_size and width != cfg.hidden_size:
            return features
        if width == cfg.hidden_size:
            raise EyasError(
                "ambiguous features: num_aux*target_hidden_size equals the draft's hidden "
                "size; call step(..., from_target=True/False)"
            )
        raise EyasError(
            f"features have width {features.shape[-1]}, expected {width} (target aux "
            f"states) or {cfg.hidden_size} (draft hidden)"
        )

    def _outputs(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(what lm_head takes, the hidden the next step feeds on) from the layer's output: the
        pre-norm output, or with ``norm_output`` the normed one."""
        normed = self.norm(out)
        return normed, (normed if self.config.norm_output else out)

    def head(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft-vocab logits, the hidden the next step feeds on) from the layer's output."""
        normed, hidden = self._outputs(out)
        return self.lm_head(normed), hidden

    def layer(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layer once, as vLLM's EAGLE-3 head runs it: embed ``tokens`` and norm them and
        ``hidden``, project to q/k/v at RoPE ``positions``, ``attend(q, k, v)`` -> o (the caller's
        choice of keys), output projection, residual, MLP. Returns (the normed hidden lm_head takes,
        the hidden the next step feeds on). ``step`` and the TTT unroll both run this."""
        layer_in, layer_out = self._regions or (self._layer_in, self._layer_out)
        q, k, v, residual = layer_in(tokens, hidden, positions)
        return layer_out(attend(q, k, v), residual)

    def _layer_in(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """Up to attention: (q, k, v, residual). One compiled region with --compile-scope regions."""
        layer = self.midlayer
        x, residual = layer.pre(self.embed_tokens(tokens).to(hidden.dtype), hidden)
        cos, sin = self.rotary(positions)
        q, k, v = layer.self_attn.qkv(x, cos, sin)
        return q, k, v, residual

    def _layer_out(self, o: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """After attention: (normed hidden for lm_head, hidden for the next step). The other region."""
        layer = self.midlayer
        return self._outputs(layer.post(layer.self_attn.out(o), residual))

    def step(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DraftKVCache,
        from_target: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One incremental draft forward over T new tokens, appending their keys to ``cache``.

        Each new token attends to every earlier cache entry and to the new ones up to itself.
        Returns (draft_logits [B,T,draft_vocab], hidden [B,T,H] for the next step).
        """
        if from_target is None:
            hidden = self.features_to_hidden(features)
        else:
            hidden = self.combine(features) if from_target else features
        attn = self.midlayer.self_attn

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            past = len(cache)
            k_all, v_all = cache.append(k, v)
            t, total = q.shape[2], k_all.shape[2]
            mask = torch.arange(total, device=q.device)[None, :] <= (past + torch.arange(t, device=q.device))[:, None]
            return F.scaled_dot_product_attention(q, attn.expand_kv(k_all), attn.expand_kv(v_all), attn_mask=mask)

        normed, hidden = self.layer(input_ids, hidden, position_ids, attend)
        return self.lm_head(normed), hidden

    # ------------------------------------------------------------------ training (TTT)

    def forward(
        self,
        aux: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        doc_ids: torch.Tensor,
        ttt_steps: int,
        attention: str = "auto",
        return_normed: bool = False,
        block_masks: list[flex.BlockMask] | None = None,
    ) -> list[torch.Tensor]:
        """Training-time-test unroll over packed sequences.

        aux [B,T,num_aux*H_t], input_ids/position_ids/doc_ids [B,T] (doc_ids separate packed
        documents; positions restart at 0 per document). Returns per-step draft logits
        [B,T,draft_vocab]; entry j at index i predicts x[i+2+j] (valid where it is in the document).
        ``attention``: dense, flex (block-sparse, :mod:`eyas.draft.flex`) or auto (flex on CUDA).
        ``return_normed``: per step the normed hidden lm_head would take [B,T,H] instead of the
        logits (for :func:`eyas.draft.fused_loss.fused_ttt_loss`).
        ``block_masks``: flex's per-step masks, :func:`eyas.draft.flex.ttt_block_masks` of
        ``doc_ids``; pass them when this forward is compiled, so that they are built outside the
        graph (see there); built here otherwise.
        """
        attn = self.midlayer.self_attn
        scale = 1.0 / math.sqrt(attn.d)
        use_flex = flex.resolve(attention, aux.device, backward=torch.is_grad_enabled()) == "flex"
        if not use_flex:
            # step-0 keys visible to query i: same document, not later (packs keep documents in order)
            same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
            causal = torch.ones(same_doc.shape[-2:], dtype=torch.bool, device=aux.device).tril()
            mask0 = (same_doc & causal)[:, None]  # [B,1,T,T]
        hidden = self.combine(aux)
        # per TTT step: flex takes the kv heads as they are (GQA in the kernel), dense expanded ones
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs = []
        masks = (block_masks or flex.ttt_block_masks(doc_ids, ttt_steps)) if use_flex else None
        for j in range(ttt_steps):

            def attend(q, k, v, j=j):  # step j: the step-0 keys of its document, then its own chain's
                keys.append(k if use_flex else attn.expand_kv(k))
                values.append(v if use_flex else attn.expand_kv(v))
                if use_flex:
                    return flex.ttt_attention(q, keys, values, masks[j], ttt_steps, scale)
                return _dense_ttt_attention(q, keys, values, mask0, scale)

            tokens = shift_in_doc(input_ids, doc_ids, 1 + j, fill=0)
            normed, hidden = self.layer(tokens, hidden, position_ids + j, attend)
            outs.append(normed if return_normed else self.lm_head(normed))
        return outs

    def compile_regions(self, backend="inductor") -> None:
        """torch.compile the TTT step's two dense regions (``eyas train --compile --compile-scope regions``).

        Every step of the unroll has the same shapes (flex pads the keys to ``ttt_steps`` blocks), so
        one compiled graph per region, forward and backward, serves all steps and the compile time
        does not grow with ``--ttt-steps`` (benchmarks/compile_time.md). The steps are slower than the
        whole-unroll graph's, as the glue between the regions runs eagerly (benchmarks/train_bench.md).
        Flex attention is compiled on its own (:mod:`eyas.draft.flex`)."""
        self._regions = (
            torch.compile(self._layer_in, backend=backend),
            torch.compile(self._layer_out, backend=backend),
        )

    # ------------------------------------------------------------------ on disk (eyas.draft.io)

    @classmethod
    def from_target(
        cls, cfg: DraftConfig, target_dir: str | os.PathLike, d2t: torch.Tensor, t2d: torch.Tensor, seed: int = 0
    ) -> "Eagle3Draft":
        """:func:`eyas.draft.io.new_draft`: a fresh draft with the target's embedding and lm_head rows."""
        from eyas.draft.io import new_draft

        return new_draft(cfg, target_dir, d2t, t2d, seed)

    def save_pretrained(self, directory: str | os.PathLike, state: dict[str, torch.Tensor] | None = None):
        """:func:`eyas.draft.io.save_draft` (the frozen embedding is not written)."""
        from eyas.draft.io import save_draft

        return save_draft(self, directory, state)

    @classmethod
    def from_pretrained(
        cls,
        directory: str | os.PathLike,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        target_dir: str | os.PathLike | None = None,
    ) -> "Eagle3Draft":
        """:func:`eyas.draft.io.load_draft` (the embedding from ``target_dir`` or the recorded target)."""
        from eyas.draft.io import load_draft

        return load_draft(directory, device, dtype, target_dir)


def _dense_ttt_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], mask0: torch.Tensor, scale: float
) -> torch.Tensor:
    """Dense TTT attention: q against the step-0 keys (block-causal ``mask0``) and against this
    chain's own later keys (``keys[1:]``, one per position); kv already expanded to q's heads."""
    k0, v0 = keys[0], values[0]
    s0 = _f32(torch.matmul(q, k0.transpose(-1, -2))) * scale
    s0 = s0.masked_fill(~mask0, float("-inf"))
    diag = [_f32((q * kk).sum(-1, keepdim=True)) * scale for kk in keys[1:]]
    probs = torch.softmax(torch.cat([s0, *diag], dim=-1), dim=-1)
    t = s0.shape[-1]
    o = torch.matmul(probs[..., :t].to(v0.dtype), v0)
    for n, vv in enumerate(values[1:]):
        o = o + probs[..., t + n : t + n + 1].to(vv.dtype) * vv
    return o


def _f32(x: torch.Tensor) -> torch.Tensor:
    """Attention scores in at least fp32 (softmax under bf16 autocast)."""
    return x if x.dtype == torch.float64 else x.float()


def shift_in_doc(x: torch.Tensor, doc_ids: torch.Tensor, n: int, fill: int | float = 0) -> torch.Tensor:
    """y[.., i] = x[.., i+n] where i+n lies in the same document, else ``fill`` (x: [B,T,...])."""
    b, t = doc_ids.shape
    if n >= t:
        return torch.full_like(x, fill)
    y = torch.cat([x[:, n:], torch.full_like(x[:, :n], fill)], dim=1)
    same = torch.cat([doc_ids[:, n:] == doc_ids[:, :-n], torch.zeros_like(doc_ids[:, :n], dtype=torch.bool)], dim=1)
    while same.dim() < y.dim():
        same = same.unsqueeze(-1)
    return torch.where(same, y, torch.full_like(y, fill))
