"""Tree verification in the GPT: one forward over a draft tree gives, for every node, the
logits of decoding its root-to-leaf branch one token at a time (tiny random GPTs in
float64); an accepted branch leaves the caches as sequential decoding does; greedy
speculative decoding with a draft tree emits exactly the tokens of greedy decoding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnkit.models import GPT, GPTConfig
from attnkit.models.speculative import greedy_accept
from attnkit.tree import build_tree

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = 6


def _model(**overrides) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig.preset("tiny", context_length=48, **{"rope": True, **overrides})
    model = GPT(cfg).double().eval()
    with torch.no_grad():  # weights away from the init's near-uniform logits
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _prefill(model: GPT, prompt: torch.Tensor, **cache) -> None:
    model.setup_cache(prompt.shape[0], 40, **cache)
    model(prompt, input_pos=torch.arange(prompt.shape[1]))


def _sequential(model, prompt, tokens, branch, **cache):
    """Logits of each node of ``branch``, decoding it token by token after the prompt."""
    _prefill(model, prompt, **cache)
    out = []
    for i, node in enumerate(branch):
        logits = model(tokens[:, node : node + 1], input_pos=torch.tensor([PROMPT + i]))
        out.append(logits[:, 0])
    return torch.stack(out, 1)  # (b, len(branch), v)


def _check_tree(model, parents, b=2, seed=0, **cache):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 256, (b, PROMPT), generator=gen)
    tokens = torch.randint(0, 256, (b, len(parents)), generator=gen)
    tree = build_tree(parents)
    with torch.no_grad():
        _prefill(model, prompt, **cache)
        logits = model.verify_tree(tokens, parents, PROMPT)  # (b, n, v)
        assert logits.shape == (b, len(parents), 256)
        for branch in tree.branches():
            want = _sequential(model, prompt, tokens, branch, **cache)
            torch.testing.assert_close(logits[:, branch], want, atol=1e-10, rtol=1e-10)


@st.composite
def trees(draw):
    n = draw(st.integers(1, 9))
    return [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, n)]


@settings(
    max_examples=12,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(trees(), st.sampled_from([None, 2, 1]))
def test_verify_tree_equals_sequential_branch_decoding(parents, kv_heads):
    """Random tree shapes (forests too), RoPE at depth-based positions, MHA/GQA/MQA."""
    _check_tree(_model(n_kv_heads=kv_heads), parents)


@pytest.mark.parametrize(
    ("overrides", "cache"),
    [
        (dict(rope=False), {}),  # learned position embeddings at start + depth
        (dict(mla_kv_rank=16), {}),  # MLA: its layers read the dense tree mask
        (dict(attn_sinks=True, n_kv_heads=2), {}),
        ({}, dict(static=True)),  # whole-buffer caches
    ],
    ids=["learned-positions", "mla", "sinks", "static-cache"],
)
def test_verify_tree_model_variants(overrides, cache):
    _check_tree(_model(**overrides), [-1, 0, 0, 1, 2, 2, 4], **cache)


def test_accepted_path_leaves_the_caches_of_sequential_decoding():
    model = _model(n_kv_heads=2)
    parents = [-1, 0, 0, 1, 1, 3]
    prompt = torch.randint(0, 256, (1, PROMPT))
    tokens = torch.randint(0, 256, (1, len(parents)))
    path = [0, 1, 3, 5]
    with torch.no_grad():
        _prefill(model, prompt)
        model.verify_tree(tokens, parents, PROMPT)
        model.accept_tree_path(parents, PROMPT, path)
        got = [(c.k_cache.clone(), c.v_cache.clone()) for c in model.caches]
        next_got = model(torch.tensor([[7]]), input_pos=torch.tensor([PROMPT + len(path)]))
        _sequential(model, prompt, tokens, path)
        end = PROMPT + len(path)
        for (k, v), c in zip(got, model.caches, strict=True):
            torch.testing.assert_close(k[:, :, :end], c.k_cache[:, :, :end], atol=1e-12, rtol=0)
            torch.testing.assert_close(v[:, :, :end], c.v_cache[:, :, :end], atol=1e-12, rtol=0)
        next_want = model(torch.tensor([[7]]), input_pos=torch.tensor([end]))
        torch.testing.assert_close(next_got, next_want, atol=1e-10, rtol=1e-10)


def test_greedy_accept_walks_the_argmax():
    parents = [-1, 0, 0, 1, 2]
    tokens = torch.tensor([5, 3, 4, 9, 8])
    logits = torch.zeros(5, 10)
    logits[0, 4] = 1  # root -> token 4: node 2
    logits[2, 8] = 1  # node 2 -> token 8: node 4
    logits[4, 6] = 1  # node 4 -> 6: the bonus token
    assert greedy_accept(tokens, parents, logits) == ([0, 2, 4], 6)
    logits[0] = 0
    logits[0, 1] = 1  # no child holds token 1: only the root, bonus 1
    assert greedy_accept(tokens, parents, logits) == ([0], 1)
    with pytest.raises(ValueError, match="single root"):
        greedy_accept(tokens, [-1, 0, -1, 1, 2], logits)


def test_speculative_greedy_decoding_emits_the_greedy_tokens():
    """A draft tree whose first branch is the target's own greedy continuation and whose
    other branches are noise: each round accepts >= 1 token, and the tokens are exactly
    ``generate``'s greedy ones."""
    model = _model(n_kv_heads=2)
    prompt = torch.randint(0, 256, (1, PROMPT))
    new = 12
    want = model.generate(prompt, new, pack_weights=False)[0, PROMPT:].tolist()
    parents = [-1, 0, 1, 2, 0, 4, 1]  # a chain of 3 drafts beside two wrong guesses
    out: list[int] = []
    with torch.no_grad():
        _prefill(model, prompt[:, :-1])
        start, last = PROMPT - 1, int(prompt[0, -1])
        rounds = 0
        while len(out) < new:
            guess = (want + [0] * 8)[len(out) : len(out) + 3]  # the draft's chain
            tokens = torch.tensor([[last, *guess, 1, 2, 3]])
            logits = model.verify_tree(tokens, parents, start)
            path, bonus = greedy_accept(tokens[0], parents, logits[0])
            model.accept_tree_path(parents, start, path)
            out += [int(tokens[0, i]) for i in path[1:]] + [bonus]
            start, last = start + len(path), bonus
            rounds += 1
    assert out[:new] == want
    assert rounds < new  # more than one token per round


@pytest.mark.parametrize(
    ("setup", "call", "error", "words"),
    [
        ("none", dict(), ValueError, "setup_cache"),
        ("ok", dict(tokens=torch.zeros(2, 3, dtype=torch.long)), ValueError, "rows"),
        ("ok", dict(tokens=torch.zeros(1, 4, dtype=torch.long)), ValueError, "nodes"),
        ("ok", dict(tokens=torch.zeros(1, 3)), TypeError, "integer"),
        ("ok", dict(start=39), ValueError, "max_seq_len"),
        ("ok", dict(start=-1), ValueError, "start"),
        ("ok", dict(parents=[-1, 2, 0]), ValueError, r"parents\[1\]"),
    ],
)
def test_bad_verification_inputs_are_named(setup, call, error, words):
    model = _model()
    if setup == "ok":
        model.setup_cache(1, 40)
    args = dict(tokens=torch.zeros(1, 3, dtype=torch.long), parents=[-1, 0, 0], start=2)
    args.update(call)
    with pytest.raises(error, match=words):
        model.verify_tree(args["tokens"], args["parents"], args["start"])


def test_windowed_models_are_refused():
    model = _model(window=8)
    model.setup_cache(1, 40)
    with pytest.raises(ValueError, match="ring|window"):
        model.verify_tree(torch.zeros(1, 2, dtype=torch.long), [-1, 0], 3)
    with pytest.raises(ValueError, match="path"):
        model.accept_tree_path([-1, 0, 0], 3, [0, 2, 1])


def test_a_float32_verification_of_one_row_is_one_native_pass_a_layer(isa, native_routes):
    """A float32 GPT verifying one row's draft tree hands each layer's cache and tree to
    the native kernel as one buffer: one pass a layer over cache ++ tree, the mask over
    the tree's keys alone; every node's logits equal decoding its branch token by token
    (float32 tolerances)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", context_length=96, rope=True, n_kv_heads=2)).eval()
    parents, start = [-1, 0, 0, 1, 1, 2, 3, 3], 70  # (70 cached keys: two chunks and a cut)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (1, start), generator=gen)
    tokens = torch.randint(0, 256, (1, len(parents)), generator=gen)
    with torch.no_grad():
        model.setup_cache(1, 90)
        model(prompt, input_pos=torch.arange(start))
        native_routes.clear()
        logits = model.verify_tree(tokens, parents, start)
        assert native_routes == ["suffix mask"] * model.cfg.n_layers
        for branch in build_tree(parents).branches():
            model.setup_cache(1, 90)
            model(prompt, input_pos=torch.arange(start))
            for i, node in enumerate(branch):
                step = model(tokens[:, node : node + 1], input_pos=torch.tensor([start + i]))
                torch.testing.assert_close(step[:, 0], logits[:, node], atol=2e-5, rtol=2e-5)
