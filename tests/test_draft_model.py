"""The EAGLE-3 draft: TTT unroll vs incremental inference, target distribution, loss mask, gradients."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.draft.loss import TargetHead, ttt_loss
from eyas.draft.model import DraftConfig, DraftKVCache, Eagle3Draft, RMSNorm, shift_in_doc
from eyas.errors import EyasError


pytestmark = pytest.mark.usefixtures("one_thread")


def _vocab(vocab: int, draft_vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.randperm(vocab, generator=g)[:draft_vocab]] = True
    ids = torch.nonzero(t2d).flatten()
    return ids - torch.arange(draft_vocab), t2d


def _small_draft(seed: int = 0, **options) -> Eagle3Draft:
    torch.manual_seed(seed)
    cfg = DraftConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=50,
        draft_vocab_size=20,
        aux_layer_ids=[1, 2, 3],
        target_hidden_size=32,
        **options,
    )
    m = Eagle3Draft(cfg).double()
    with torch.no_grad():  # non-trivial norm weights, so a path that skips one is caught
        for mod in m.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return m


DRAFT_OPTIONS = [
    {"norm_before_residual": False},
    {"fc_norm": True},
    {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True},
]


@pytest.mark.parametrize("options", DRAFT_OPTIONS, ids=["plain", "fc_norm", "speculators_defaults"])
def test_ttt_unroll_matches_incremental_step_with_kv_cache(options):
    """TTT step j at position p equals inference: prefix with target features, then j own steps."""
    m = _small_draft(**options)
    t, k = 14, 5
    x = torch.randint(0, 50, (1, t))
    aux = torch.randn(1, t, 96, dtype=torch.float64)
    pos = torch.arange(t)[None]
    doc = torch.zeros(1, t, dtype=torch.long)
    with torch.no_grad():
        ttt = m(aux, x, pos, doc, k)
        for j, lg in enumerate(m(aux, x, pos, doc, k, attention="flex")):  # the flex kernel's unroll too
            torch.testing.assert_close(lg, ttt[j], rtol=0, atol=1e-10)
        checked = 0
        for p in range(t - k - 1):
            cache = DraftKVCache()
            logits, hid = m.step(aux[:, : p + 1], x[:, 1 : p + 2], pos[:, : p + 1], cache)
            torch.testing.assert_close(logits[0, p], ttt[0][0, p], rtol=0, atol=1e-10)
            h = hid[:, p : p + 1]
            for j in range(1, k):
                logits, h = m.step(h, x[:, p + 1 + j : p + 2 + j], pos[:, p : p + 1] + j, cache)
                torch.testing.assert_close(logits[0, 0], ttt[j][0, p], rtol=0, atol=1e-10)
                checked += 1
            assert len(cache) == p + 1 + (k - 1)
        assert checked == (t - k - 1) * (k - 1)
        # the check can fail: a chain that also saw a neighbour's step-1 key differs
        cache = DraftKVCache()
        _, hid = m.step(aux[:, :4], x[:, 1:5], pos[:, :4], cache)
        _, _ = m.step(hid[:, 2:3], x[:, 4:5], pos[:, 2:3] + 1, cache)  # chain of position 2
        wrong, _ = m.step(hid[:, 3:4], x[:, 5:6], pos[:, 3:4] + 1, cache)
        assert (wrong[0, 0] - ttt[1][0, 3]).abs().max() > 1e-6


def test_cache_crop_after_rejection():
    m = _small_draft(1)
    x = torch.randint(0, 50, (1, 8))
    aux = torch.randn(1, 8, 96, dtype=torch.float64)
    pos = torch.arange(8)[None]
    with torch.no_grad():
        c1 = DraftKVCache()
        _, h = m.step(aux[:, :6], x[:, 1:7], pos[:, :6], c1)
        m.step(h[:, -1:], x[:, 7:8], pos[:, 5:6] + 1, c1)  # a drafted token, then rejected
        c1.crop(6)
        a, _ = m.step(aux[:, 6:7], x[:, 7:8], pos[:, 6:7], c1)
        c2 = DraftKVCache()
        b, _ = m.step(aux[:, :7], x[:, 1:8], pos[:, :7], c2)
    torch.testing.assert_close(a[0, 0], b[0, -1])


def test_packed_documents_do_not_see_each_other():
    m = _small_draft(2)
    t = 12
    x = torch.randint(0, 50, (1, t))
    aux = torch.randn(1, t, 96, dtype=torch.float64)
    doc = torch.tensor([[0] * 5 + [1] * 7])
    pos = torch.tensor([list(range(5)) + list(range(7))])
    with torch.no_grad():
        packed = m(aux, x, pos, doc, 3)
        alone = m(aux[:, 5:], x[:, 5:], pos[:, 5:], doc[:, 5:], 3)
        first = m(aux[:, :5], x[:, :5], pos[:, :5], doc[:, :5], 3)
    for j in range(3):
        torch.testing.assert_close(packed[j][0, 5:], alone[j][0])
        torch.testing.assert_close(packed[j][0, :5], first[j][0])


def test_shift_in_doc():
    x = torch.arange(6)[None]
    doc = torch.tensor([[0, 0, 0, 1, 1, -1]])
    assert shift_in_doc(x, doc, 1, fill=-7).tolist() == [[1, 2, -7, 4, -7, -7]]
    assert shift_in_doc(x, doc, 2, fill=-7).tolist() == [[2, -7, -7, -7, -7, -7]]


def test_target_distribution_matches_full_model_forward(tiny_target):
    """softmax over the draft vocab of lm_head(norm(h_N)) from captured states == the model's own logits."""
    from eyas.features.capture import HiddenStateCapture

    model = tiny_target.load_model(dtype=torch.float32)
    vocab = model.config.vocab_size
    d2t, t2d = _vocab(vocab, 100)
    head = TargetHead.from_target(tiny_target.path, d2t, model.config.rms_norm_eps)
    x = torch.randint(0, vocab, (2, 17))
    cap = HiddenStateCapture(model, [1, 4, 6])
    _, final = cap.capture(x)
    cap.remove()
    with torch.no_grad():
        full = model(input_ids=x).logits
    ids = torch.arange(100) + d2t
    want = torch.softmax(full[..., ids].float(), -1)
    got = torch.softmax(head(final.clone()), -1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # the restriction matters: over the full vocab it would be a different distribution
    assert (torch.softmax(full.float(), -1)[..., ids] - want).abs().max() > 1e-3


def test_from_target_reads_embeddings_and_lm_head_rows(tiny_target, tmp_path):
    from safetensors import safe_open

    cfg_json = tiny_target.config()
    d2t, t2d = _vocab(cfg_json["vocab_size"], 64, seed=3)
    cfg = DraftConfig.from_target(cfg_json, [1, 4, 6], 64, tiny_target.identity)
    assert cfg.hidden_size == 64 and cfg.num_key_value_heads == 2 and cfg.target["id"] == tiny_target.id
    draft = Eagle3Draft.from_target(cfg, tiny_target.path, d2t, t2d)
    with safe_open(str(tiny_target.path / "model.safetensors"), "pt") as fh:
        emb = fh.get_tensor("model.embed_tokens.weight")
        lm = fh.get_tensor("lm_head.weight")
    torch.testing.assert_close(draft.embed_tokens.weight.data, emb.float())
    torch.testing.assert_close(draft.lm_head.weight.data, lm[torch.arange(64) + d2t].float())
    assert not draft.embed_tokens.weight.requires_grad
    # save / load round trip keeps every tensor and the config (the frozen embedding: from the target)
    draft.save_pretrained(tmp_path / "d")
    again = Eagle3Draft.from_pretrained(tmp_path / "d", target_dir=tiny_target.path)
    for k, v in draft.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k
    assert again.config == cfg
    names = set(draft.state_dict())
    for n in [
        "fc.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.self_attn.q_proj.weight",
        "midlayer.mlp.down_proj.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        "embed_tokens.weight",
    ]:
        assert n in names
    bad = json.loads((tmp_path / "d" / "config.json").read_text())
    bad["kind"] = "other"
    (tmp_path / "d" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(EyasError, match="kind"):
        Eagle3Draft.from_pretrained(tmp_path / "d", target_dir=tiny_target.path)


def test_config_overrides_and_wrong_hidden(tiny_target):
    cfg = DraftConfig.from_target(tiny_target.config(), [1, 4, 6], 64, intermediate_size=80, rope_theta=5e5)
    assert cfg.intermediate_size == 80 and cfg.rope_theta == 5e5
    bad = DraftConfig.from_target(tiny_target.config(), [1, 4, 6], 64, hidden_size=48)
    d2t, t2d = _vocab(tiny_target.config()["vocab_size"], 64)
    with pytest.raises(EyasError, match="hidden_size"):
        Eagle3Draft.from_target(bad, tiny_target.path, d2t, t2d)


def _reference_loss(step_logits, target_logits, mask, decay):
    """Loop version over one unpacked sequence: step j at i predicts x[i+2+j] from target logits at i+1+j."""
    t = mask.shape[1]
    total = 0.0
    for j, lg in enumerate(step_logits):
        s, n = 0.0, 0
        for i in range(t):
            if i + 2 + j < t and mask[0, i + 2 + j]:
                p = torch.softmax(target_logits[0, i + 1 + j], -1)
                s += float(-(p * torch.log_softmax(lg[0, i].detach(), -1)).sum())
                n += 1
        total += decay**j * s / max(n, 1)
    return total


def test_loss_matches_reference_and_honours_mask():
    torch.manual_seed(0)
    t, v, k = 11, 7, 3
    logits = [torch.randn(1, t, v, requires_grad=True) for _ in range(k)]
    tgt = torch.randn(1, t, v)
    mask = torch.tensor([[0, 0, 1, 1, 0, 1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    doc = torch.zeros(1, t, dtype=torch.long)
    loss, stats = ttt_loss(logits, tgt, mask, doc, 0.8)
    assert abs(loss.item() - _reference_loss(logits, tgt, mask, 0.8)) < 1e-5
    loss.backward()
    for j in range(k):
        g = logits[j].grad[0].abs().sum(-1)
        counted = torch.tensor([i + 2 + j < t and bool(mask[0, i + 2 + j]) for i in range(t)])
        assert (g[~counted] == 0).all() and (g[counted] > 0).all()
        assert stats[j].count.item() == counted.sum().item()
    # flipping the mask changes the loss: the mask is read, not ignored
    loss2, _ = ttt_loss([lg.detach() for lg in logits], tgt, ~mask, doc, 0.8)
    assert abs(loss2.item() - loss.item()) > 1e-4


def test_gradients_flow_only_into_the_draft(tiny_target):
    from eyas.features.capture import HiddenStateCapture

    model = tiny_target.load_model(dtype=torch.float32)
    vocab = model.config.vocab_size
    d2t, t2d = _vocab(vocab, 64)
    cfg = DraftConfig.from_target(tiny_target.config(), [1, 4, 6], 64, tiny_target.identity)
    draft = Eagle3Draft.from_target(cfg, tiny_target.path, d2t, t2d)
    head = TargetHead.from_target(tiny_target.path, d2t, 1e-6)
    x = torch.randint(0, vocab, (1, 20))
    cap = HiddenStateCapture(model, [1, 4, 6])
    aux, final = cap.capture(x)
    aux, final = aux.flatten(2).clone(), final.clone()
    pos = torch.arange(20)[None]
    doc = torch.zeros(1, 20, dtype=torch.long)
    logits = draft(aux, x, pos, doc, 3)
    loss, _ = ttt_loss(logits, head(final), torch.ones(1, 20, dtype=torch.bool), doc, 0.8)
    loss.backward()
    assert all(p.grad is None for p in model.parameters())
    assert draft.embed_tokens.weight.grad is None
    assert not head.weight.requires_grad and head.weight.grad is None
    for name, p in draft.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def _packed_batch(seed: int = 0):
    """Two packs of 2-3 documents each (and a padding tail, doc -1), positions restarting per document."""
    g = torch.Generator().manual_seed(seed)
    docs = [[9, 7, 6], [5, 13, 4]]  # lengths; the second pack ends in 4 padding tokens
    doc_ids, pos = [], []
    for row, lens in enumerate(docs):
        d, p = [], []
        for n, length in enumerate(lens):
            tag = -1 if (row == 1 and n == len(lens) - 1) else n
            d += [tag] * length
            p += list(range(length))
        doc_ids.append(d)
        pos.append(p)
    doc, pos = torch.tensor(doc_ids), torch.tensor(pos)
    x = torch.randint(0, 50, doc.shape, generator=g)
    aux = torch.randn(*doc.shape, 96, generator=g)
    return aux, x, pos, doc


def _gqa_draft(kv_heads: int) -> Eagle3Draft:
    torch.manual_seed(0)
    cfg = DraftConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=16,  # flex's Triton kernel needs head_dim >= 16
        intermediate_size=64,
        vocab_size=50,
        draft_vocab_size=20,
        aux_layer_ids=[1, 2, 3],
        target_hidden_size=32,
    )
    return Eagle3Draft(cfg)


def _flex_vs_dense(m: Eagle3Draft, aux, x, pos, doc, grads: bool):
    """Per-step logits (and parameter gradients of a random projection of them) under both kernels."""
    weights = [torch.randn(*doc.shape, 20, generator=torch.Generator().manual_seed(j)).to(aux.device) for j in range(3)]
    out = {}
    for kind in ("dense", "flex"):
        m.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(grads):
            logits = m(aux, x, pos, doc, 3, attention=kind)
        g = {}
        if grads:
            sum((lg * w).sum() for lg, w in zip(logits, weights)).backward()
            g = {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}
        out[kind] = ([lg.detach() for lg in logits], g)
    return out


@pytest.mark.parametrize("kv_heads", [2, 4])  # GQA through flex's enable_gqa, and plain MHA
def test_flex_attention_matches_dense_logits(kv_heads):
    """On CPU flex runs eagerly, forward only (torch has no flex backward on CPU)."""
    m = _gqa_draft(kv_heads)
    aux, x, pos, doc = _packed_batch()
    out = _flex_vs_dense(m, aux, x, pos, doc, grads=False)
    for j in range(3):
        torch.testing.assert_close(out["flex"][0][j], out["dense"][0][j], atol=1e-5, rtol=1e-5)
    # the comparison can fail: the mask is read (one document per pack gives other logits)
    with torch.no_grad():
        merged = m(aux, x, pos, torch.zeros_like(doc), 3, attention="flex")
    assert (merged[2] - out["dense"][0][2]).abs().max() > 1e-3
    # training with flex off CUDA is refused up front, in eyas's words
    with pytest.raises(EyasError, match="no backward"):
        m(aux, x, pos, doc, 3, attention="flex")


def _random_layout(b: int, t: int, seed: int) -> torch.Tensor:
    """doc_ids [b, t]: documents of random lengths in order; row 1 ends in padding, row 2 is one document."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for r in range(b):
        lens, total = [], 0
        while total < t:
            lens.append(int(torch.randint(1, 300, (), generator=g)))
            total += lens[-1]
        d = torch.cat([torch.full((n,), k) for k, n in enumerate(lens)])[:t]
        if r == 1:
            d[-100:] = -1
        if r == 2:
            d[:] = 0
        rows.append(d)
    return torch.stack(rows)


def _block_sets(num: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """A BlockMask table (counts [B,H,rows], indices [B,H,rows,cols]) as a dense bool [B,H,rows,cols]."""
    out = torch.zeros(*idx.shape, dtype=torch.bool)
    for b in range(num.shape[0]):
        for r in range(num.shape[2]):
            out[b, 0, r, idx[b, 0, r, : num[b, 0, r]].long()] = True
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tiled_block_mask_equals_create_block_mask(seed):
    """The TTT block mask built from the documents' tile layout (no mask_mod evaluation over all
    pairs: compiled, that took 242 s of a cold --compile start) has create_block_mask's partial and
    full tiles, forward and transposed, at every step."""
    from torch.nn.attention.flex_attention import create_block_mask

    from eyas.draft import flex

    b, t, steps = 3, 512, 4
    doc = _random_layout(b, t, seed)
    masks = flex.ttt_block_masks(doc, steps)
    for step in range(steps):
        last = torch.tensor(step)

        def mask_mod(bi, h, q, kv):
            block = kv // t
            src = kv - block * t
            return ((block == 0) & (src <= q) & (doc[bi, src] == doc[bi, q])) | (
                (block >= 1) & (block <= last) & (src == q)
            )

        ref = create_block_mask(mask_mod, b, None, t, steps * t, device="cpu")
        got = masks[step]
        for kind in ("kv", "full_kv", "q", "full_q"):
            torch.testing.assert_close(
                _block_sets(getattr(got, f"{kind}_num_blocks"), getattr(got, f"{kind}_indices")),
                _block_sets(getattr(ref, f"{kind}_num_blocks"), getattr(ref, f"{kind}_indices")),
                msg=f"step {step} {kind}",
            )


def test_flex_with_tiled_block_mask_matches_dense_logits():
    """At a pack length that is a multiple of the tile (the tiled mask's case), flex's logits
    equal the dense path's (CPU: flex forward only)."""
    m = _gqa_draft(2)
    b, t = 3, 256
    doc = _random_layout(b, t, 3)
    g = torch.Generator().manual_seed(0)
    pos = torch.zeros(b, t, dtype=torch.long)
    for r in range(b):
        for d in doc[r].unique():
            where = (doc[r] == d).nonzero().flatten()
            pos[r, where] = torch.arange(len(where))
    x = torch.randint(0, 50, (b, t), generator=g)
    aux = torch.randn(b, t, 96, generator=g)
    out = _flex_vs_dense(m, aux, x, pos, doc, grads=False)
    for j in range(3):
        torch.testing.assert_close(out["flex"][0][j], out["dense"][0][j], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("passed_in", [False, True])
def test_compiled_forward_never_builds_block_masks_inside_its_graph(passed_in):
    """Issue 16's cause: built inside the compiled whole-forward graph, the block masks made flex
    compute wrong attention on CUDA (benchmarks/compile_grads.md; inductor on this CPU does not
    reproduce the numbers). The graphs `eyas train --compile` traces must hold no mask building
    (its tables come from a sort), whether the caller passes the masks (the trainer) or not."""
    from eyas.draft import flex

    m = _gqa_draft(2)
    b, t = 2, 256
    doc = _random_layout(b, t, 1)
    pos = torch.zeros(b, t, dtype=torch.long)
    for r in range(b):
        for d in doc[r].unique():
            where = (doc[r] == d).nonzero().flatten()
            pos[r, where] = torch.arange(len(where))
    x = torch.randint(0, 50, (b, t), generator=torch.Generator().manual_seed(0))
    aux = torch.randn(b, t, 96, generator=torch.Generator().manual_seed(1))
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(m, backend=record)
    with torch.no_grad():
        ref = m(aux, x, pos, doc, 3, attention="flex")
        masks = flex.ttt_block_masks(doc, 3) if passed_in else None
        got = compiled(aux, x, pos, doc, 3, attention="flex", block_masks=masks)
    ops = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert graphs and not any("sort" in op for op in ops), sorted(op for op in ops if "sort" in op)
    for j in range(3):
        torch.testing.assert_close(got[j], ref[j], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention's backward needs CUDA")
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_flex_attention_matches_dense_gradients_on_cuda(kv_heads):
    """Compiled flex (the kernel training uses) vs dense: logits and every parameter gradient, fp32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    m = _gqa_draft(kv_heads).cuda()
    aux, x, pos, doc = (t.cuda() for t in _packed_batch())
    out = _flex_vs_dense(m, aux, x, pos, doc, grads=True)
    for j in range(3):
        torch.testing.assert_close(out["flex"][0][j], out["dense"][0][j], atol=1e-5, rtol=1e-5)
    g_dense, g_flex = out["dense"][1], out["flex"][1]
    assert g_dense.keys() == g_flex.keys()
    for n in g_dense:
        assert g_dense[n].abs().sum() > 0, n
        torch.testing.assert_close(g_flex[n], g_dense[n], atol=1e-5, rtol=1e-5)


def test_attention_choice():
    from eyas.draft import flex

    assert flex.resolve("auto", torch.device("cpu")) == "dense"
    assert flex.resolve("auto", torch.device("cuda", 0)) == "flex"
    assert flex.resolve("flex", torch.device("cpu")) == "flex"
    assert flex.resolve("flex", torch.device("cuda", 0), backward=True) == "flex"
    with pytest.raises(EyasError, match="--attention 'sdpa'"):
        flex.resolve("sdpa", torch.device("cpu"))


def test_flex_kernel_first_asked_for_inside_a_compiled_graph_stays_compiled(monkeypatch):
    """Under `eyas train --compile` the first flex call comes while dynamo traces the draft. The
    kernel kept for later eager calls (held-out evaluation) must still be the compiled one, not
    the plain function, which runs unfused and materialises every score (found in the H200 logs
    of 2026-11-30e: flex's "called without torch.compile" warning at the end of compiled runs)."""
    from torch.nn.attention.flex_attention import flex_attention

    from eyas.draft import flex

    monkeypatch.setattr(flex, "_compiled", None)
    cuda = torch.device("cuda")  # only its type is read: nothing runs on a GPU here

    @torch.compile(backend="eager", fullgraph=True)
    def traced(x):
        assert flex._kernel(cuda) is flex_attention  # inside the graph: dynamo compiles flex itself
        return x + 1

    traced(torch.ones(2))
    kept = flex._kernel(cuda)
    assert kept is not flex_attention and flex._kernel(cuda) is kept


def test_compiled_regions_trace_once_for_every_ttt_step_and_match_eager():
    """`eyas train --compile` compiles the TTT step's regions, not the whole unroll: two graphs
    whatever --ttt-steps is (the whole-unroll graph took ~4 minutes to compile for TTT 7 on the
    H200), and the same logits and gradients as the eager model."""
    aux, x, pos, doc = _packed_batch()
    weights = [torch.randn(*doc.shape, 20, generator=torch.Generator().manual_seed(j)).double() for j in range(5)]

    def run(m, steps):
        m.zero_grad(set_to_none=True)
        logits = m(aux.double(), x, pos, doc, steps, attention="dense")
        sum((lg * w).sum() for lg, w in zip(logits, weights)).backward()
        return [lg.detach() for lg in logits], {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}

    ref_logits, ref_grads = run(_small_draft(), 5)
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    m = _small_draft()
    m.compile_regions(backend=counting_backend)
    logits, grads = run(m, 5)
    assert len(graphs) == 2  # _step_in and _step_out, each traced once for all 5 steps
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n])
    run(m, 3)  # another unroll length reuses the same graphs
    assert len(graphs) == 2


def test_compiled_soft_cross_entropy_matches_eager():
    """`eyas train --compile` swaps in the compiled loss: same values and gradients, for the
    different position counts the TTT steps score (one dynamic graph)."""
    from eyas.draft.loss import soft_cross_entropy

    compiled = torch.compile(soft_cross_entropy, dynamic=True)
    torch.manual_seed(0)
    for n in (9, 8, 7):
        z = torch.randn(2, n, 50, requires_grad=True)
        p = torch.softmax(torch.randn(2, n, 50), -1)
        ref = -(p * torch.log_softmax(z.detach(), -1)).sum(-1)
        out = compiled(z, p)
        assert torch.allclose(out, ref, atol=1e-5)
        (g,) = torch.autograd.grad(out.sum(), z)
        assert torch.allclose(g, torch.softmax(z.detach(), -1) - p, atol=1e-5)


def test_fc_norm_normalises_each_aux_layer_before_fc():
    """fc_norm: each aux layer's state is RMS-normed on its own, so rescaling one layer's input
    (as the target's layers differ in scale) changes nothing; without it, it does."""
    for fc_norm in (True, False):
        m = _small_draft(fc_norm=fc_norm)
        aux = torch.randn(1, 6, 96, dtype=torch.float64)
        scaled = aux.clone()
        scaled[..., 64:] *= 25.0  # the last aux layer, 25x larger
        same = torch.allclose(m.combine(aux), m.combine(scaled), atol=1e-5)  # eps: ~1e-7 apart
        assert same == fc_norm
    ref = m.fc(aux)  # fc_norm False: plain fc
    torch.testing.assert_close(m.combine(aux), ref)


@pytest.mark.parametrize("chunk,compiled", [(5, False), (4096, False), (5, True)])
def test_fused_loss_equals_unfused_value_stats_and_gradients(chunk, compiled):
    """fused_ttt_loss (lm_head + target distribution + CE chunked over the counted positions)
    gives ttt_loss's value, per-step stats and gradients w.r.t. the draft (float64); compiled
    (`--compile`) too, through chunks of different lengths (one dynamic graph)."""
    from eyas.draft.fused_loss import fused_ttt_loss

    torch.manual_seed(0)
    b, t, h, vocab, dv, k = 2, 17, 32, 50, 20, 3
    m = _small_draft()
    d2t, _ = _vocab(vocab, dv)
    head = TargetHead(torch.rand(h, dtype=torch.float64) + 0.5, torch.randn(vocab, h, dtype=torch.float64), d2t, 1e-6)
    x = torch.randint(0, 50, (b, t))
    aux = torch.randn(b, t, 96, dtype=torch.float64)
    pos = torch.arange(t).repeat(b, 1)
    doc = torch.tensor([[0] * 9 + [1] * 8, [0] * 17])
    mask = torch.rand(b, t) > 0.3
    final = torch.randn(b, t, h, dtype=torch.float64) * 3

    def grads(loss):
        m.zero_grad()
        loss.backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    ref, ref_stats = ttt_loss(m(aux, x, pos, doc, k), head(final), mask, doc, 0.8)
    ref_g = grads(ref)
    got, got_stats = fused_ttt_loss(
        m(aux, x, pos, doc, k, return_normed=True),
        m.lm_head.weight,
        head,
        final,
        mask,
        doc,
        0.8,
        chunk=chunk,
        compiled=compiled,
    )
    got_g = grads(got)
    torch.testing.assert_close(got, ref.float(), rtol=1e-6, atol=1e-6)
    for r, g in zip(ref_stats, got_stats):
        assert int(g.count) == int(r.count) > 0 and int(g.correct) == int(r.correct)
        torch.testing.assert_close(g.loss_sum, r.loss_sum.float(), rtol=1e-6, atol=1e-6)
    assert set(got_g) == set(ref_g) and "lm_head.weight" in got_g and "fc.weight" in got_g
    for n in ref_g:
        torch.testing.assert_close(got_g[n], ref_g[n], rtol=1e-5, atol=1e-6, msg=n)  # CE in fp32 (both)


@pytest.mark.parametrize(
    "world,draft_vocab,chunk,compiled", [(2, 21, 5, False), (2, 21, 4096, False), (3, 4, 3, False), (2, 21, 5, True)]
)
def test_sharded_fused_loss_equals_single_process(world, draft_vocab, chunk, compiled):
    """The fused loss with lm_head sharded over the vocab by FSDP2 (eyas.draft.sharded_loss), on
    gloo ranks with a micro-batch each (one too short for the last TTT step): each rank's loss and
    stats are its single-process fused loss's, every gradient (lm_head's shards included) the mean
    over ranks of the single-process gradients, twice in a row and under no_grad. Uneven shards
    (21 rows: 11 + 10) and an empty one (4 rows over 3 ranks: 2 + 2 + 0); chunks of 5 and whole;
    the chunk functions compiled (``--compile``) against the eager single-process loss.
    The checks run in tests/sharded_loss_worker.py."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).parent / "sharded_loss_worker.py"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(world),
            str(worker),
            str(draft_vocab),
            str(chunk),
        ]
        + (["compiled"] if compiled else []),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert all(f"rank {r} ok:" in res.stdout for r in range(world)), res.stdout


def test_fused_loss_positions_are_what_each_step_scores():
    """positions(): the target rows are the positions whose next token is in the loss mask, and
    step j's indices are step_valid's (the trainer finds them on the host, before the forward);
    handed to fused_ttt_loss they are the ones it scores (other positions give another loss)."""
    from eyas.draft.fused_loss import Scored, fused_ttt_loss, positions
    from eyas.draft.loss import step_valid

    torch.manual_seed(1)
    b, t, k = 3, 23, 4
    doc = torch.tensor([[0] * 10 + [1] * 13, [0] * 23, [0] * 7 + [1] * 9 + [-1] * 7])
    mask = (torch.rand(b, t) > 0.4) & (doc >= 0)
    s = positions(mask, doc, k)
    want = [r * t + i for r in range(b) for i in range(t - 1) if mask[r, i + 1]]
    assert s.flat.tolist() == want
    for j in range(k):
        bi, ii = s.steps[j]
        assert torch.stack([bi, ii], 1).tolist() == step_valid(mask, doc, j).nonzero().tolist()
    # moved to another device (one packed copy, split there), each part keeps its shape and place
    moved = s.to(torch.device("meta"))
    assert moved.flat.is_meta and moved.flat.shape == s.flat.shape
    assert [(b.shape, i.shape) for b, i in moved.steps] == [(b.shape, i.shape) for b, i in s.steps]

    m = _small_draft()
    vocab, dv, h = 50, 20, 32
    d2t, _ = _vocab(vocab, dv)
    head = TargetHead(torch.rand(h, dtype=torch.float64) + 0.5, torch.randn(vocab, h, dtype=torch.float64), d2t, 1e-6)
    x, pos = torch.randint(0, 50, (b, t)), torch.arange(t).repeat(b, 1)
    aux, final = torch.randn(b, t, 96, dtype=torch.float64), torch.randn(b, t, h, dtype=torch.float64)
    with torch.no_grad():
        normed = m(aux, x, pos, doc, k, return_normed=True)
        plain, _ = fused_ttt_loss(normed, m.lm_head.weight, head, final, mask, doc, 0.8)
        given, _ = fused_ttt_loss(normed, m.lm_head.weight, head, final, mask, doc, 0.8, scored=s)
        fewer = Scored(s.flat, [(bi[:1], ii[:1]) for bi, ii in s.steps])
        other, _ = fused_ttt_loss(normed, m.lm_head.weight, head, final, mask, doc, 0.8, scored=fewer)
    assert torch.equal(plain, given) and not torch.allclose(plain, other)
