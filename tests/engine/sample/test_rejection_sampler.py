"""rejection_sample: greedy rows follow "accept while equal to the argmax, then the
argmax"; random rows emit tokens distributed exactly as the target's (chi-square tests,
with a wrong residual shown to fail them); the accepted count follows the theory; padded
batches and seeded rows behave as single rows.

The statistical tests are seeded, so each run of one version of the code draws the same
numbers: a correct implementation fails a test only if the fixed seed happens to land in
the test's rejection region, which has probability alpha = 1e-4 per test (the tests'
significance level), and a code change that alters the random stream is a fresh draw
of that chance. With the 11 chi-square tests below (and two mean tests at ~6e-7), a
correct implementation fails any one of them with probability at most 1.1e-3 per
change of the random stream.
"""

import math

import pytest
import torch

from kvpilot.engine.sample.argmax_rows import argmax_rows
from kvpilot.engine.sample.rejection_sampler import rejection_sample

ALPHA = 1e-4
N = 40_000  # draws per statistical test: one row each, in one call

# A target p with zeros (as after top-k) and a draft q that puts mass where p has none.
P1 = torch.tensor([0.30, 0.05, 0.00, 0.20, 0.10, 0.00, 0.25, 0.10])
Q1 = torch.tensor([0.10, 0.25, 0.15, 0.05, 0.10, 0.20, 0.05, 0.10])


# ---------------------------------------------------------------- chi-square helpers


def chi2_sf(x: float, df: int) -> float:
    """P(chi2_df >= x), exactly, for an integer df (scipy is not in the venv): the
    regularized upper incomplete gamma Q(df/2, x/2) in closed form, its terms in logs."""
    half = x / 2.0
    if x <= 0:
        return 1.0
    if df % 2 == 0:
        return min(1.0, sum(math.exp(-half + i * math.log(half) - math.lgamma(i + 1))
                            for i in range(df // 2)))
    tail = sum(math.exp(-half + (i - 0.5) * math.log(half) - math.lgamma(i + 0.5))
               for i in range(1, (df - 1) // 2 + 1))
    return min(1.0, math.erfc(math.sqrt(half)) + tail)


def chi_square(observed: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float]:
    """(statistic, df, p-value) of the counts `observed` against the distribution `probs`
    (any shape, flattened). Cells p gives no mass must hold no count: checked exactly."""
    observed, probs = observed.flatten().double(), probs.flatten().double()
    probs = probs / probs.sum()
    assert observed[probs == 0].sum() == 0, "a token the target gives no mass was emitted"
    support = probs > 0
    expected = probs[support] * observed.sum()
    stat = float(((observed[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    return stat, df, chi2_sf(stat, df)


def test_chi2_sf_matches_tables():
    # The 1 - 1e-4 quantiles of chi2 with 1 and 7 degrees of freedom, and df=2's exp(-x/2).
    assert chi2_sf(15.137, 1) == pytest.approx(1e-4, rel=2e-3)
    assert chi2_sf(29.877, 7) == pytest.approx(1e-4, rel=2e-3)
    assert chi2_sf(3.0, 2) == pytest.approx(math.exp(-1.5))
    assert chi2_sf(11.0705, 5) == pytest.approx(0.05, rel=1e-3)


# ---------------------------------------------------------------- helpers


@pytest.fixture
def seeded():
    """The global RNG seeded for this test and restored after it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        yield


def _draw(probs: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """n ids drawn from `probs` [V] -> [n] int64."""
    return torch.multinomial(probs, n, replacement=True, generator=torch.Generator().manual_seed(seed))


def _first_tokens(out) -> torch.Tensor:
    return torch.tensor([ids[0] for ids in out.token_ids])


def _counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(ids.flatten(), minlength=vocab)


def _greedy_rule(argmax: list[int], drafts: list[int]) -> list[int]:
    """Accept while the draft equals the target's argmax, then emit the argmax."""
    out = []
    for i, x in enumerate(drafts):
        if x != argmax[i]:
            break
        out.append(x)
    return out + [argmax[len(out)]]


# ---------------------------------------------------------------- greedy rows


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_greedy_rows_follow_the_argmax_rule(with_draft_probs):
    b, k, vocab = 6, 4, 300  # vocab > 2 * CHUNK: argmax_rows' chunked path
    g = torch.Generator().manual_seed(0)
    # Few distinct logit values: ties, which argmax_rows breaks at the first index.
    logits = torch.randint(0, 3, (b, k + 1, vocab), generator=g).float()  # [B, K+1, V]
    argmax = argmax_rows(logits.flatten(0, 1)).view(b, k + 1)  # [B, K+1]
    drafts = argmax[:, :k].clone()  # [B, K]
    num = [4, 4, 0, 3, 2, 1]
    drafts[1, 0] = (argmax[1, 0] + 1) % vocab  # row 1: the first draft rejected
    drafts[3, 2] = (argmax[3, 2] + 7) % vocab  # row 3: two accepted, the third rejected
    drafts[4, 2] = (argmax[4, 2] + 1) % vocab  # row 4: a mismatch past K'=2 is padding
    target_probs = torch.full((b, k + 1, vocab), float("nan"))  # unused by greedy rows
    draft_probs = torch.softmax(torch.randn(b, k, vocab, generator=g), -1) if with_draft_probs else None
    outs = []
    for seed in (1, 2):  # different randomness: the same greedy tokens
        torch.manual_seed(seed)
        outs.append(rejection_sample(target_probs, argmax, drafts, num, draft_probs,
                                     torch.ones(b, dtype=torch.bool), [None] * b))
    assert outs[0] == outs[1]
    out = outs[0]
    for row in range(b):
        expected = _greedy_rule(argmax[row].tolist(), drafts[row, :num[row]].tolist())
        assert out.token_ids[row] == expected, row
        assert out.num_accepted[row] == len(expected) - 1
    assert out.num_accepted == [4, 0, 0, 2, 2, 1]
    assert out.token_ids[0] == argmax[0].tolist()  # all accepted: the bonus argmax too
    assert out.token_ids[2] == [argmax[2, 0].item()]  # no drafts: a normal greedy step


# ---------------------------------------------------------------- the first token ~ p_1


def _first_token_call(p1, draft_ids, draft_probs, k, generators=None, p_scale=1.0, q_scale=1.0):
    """N rows, each with drafts `draft_ids` [N, K]; p_1 = p1 at the first position and
    (for K=2) arbitrary later positions. Returns the first emitted token per row."""
    n = draft_ids.shape[0]
    vocab = p1.shape[0]
    later = torch.softmax(torch.arange(vocab, dtype=torch.float32), 0)
    target = torch.stack([p1] + [later] * k)[None].expand(n, k + 1, vocab) * p_scale
    out = rejection_sample(
        target.contiguous(), torch.zeros(n, k + 1, dtype=torch.int64), draft_ids, [k] * n,
        None if draft_probs is None else draft_probs * q_scale,
        torch.zeros(n, dtype=torch.bool), generators or [None] * n)
    return _first_tokens(out)


@pytest.mark.parametrize("case", ["draft_model", "draft_model_unnormalised", "draft_model_seeded_rows",
                                  "ngram", "no_drafts"])
def test_first_token_is_distributed_as_p(case, seeded):
    """The first emitted token's histogram over N=40,000 rows against p_1: chi-square at
    alpha = 1e-4 (false failure 1e-4 per case per change of the random stream). The draft
    model's q puts mass on tokens p has none; those must never be emitted. The n-gram case
    draws each row's (deterministic, point-mass) draft from Q1, so points p has no mass
    at are proposed too. `unnormalised` scales p by 0.6 and q by 1.7, as min-p masking leaves
    rows short of 1. `seeded_rows` gives every row its own generator."""
    vocab = P1.shape[0]
    if case == "ngram":
        # Not uniform: with uniform drafts, a residual that forgot to zero x would average
        # back to p exactly.
        drafts = _draw(Q1, N, seed=5)[:, None]
        first = _first_token_call(P1, drafts, None, k=1)
    elif case == "no_drafts":
        first = _first_token_call(P1, torch.zeros(N, 0, dtype=torch.int64), None, k=0)
    else:
        x1 = _draw(Q1, N, seed=6)
        x2 = _draw(torch.ones(vocab), N, seed=7)  # a second draft, whatever its fate
        q = torch.stack([Q1, torch.ones(vocab) / vocab])[None].expand(N, 2, vocab).contiguous()
        kwargs = {}
        if case == "draft_model_unnormalised":
            kwargs = dict(p_scale=0.6, q_scale=1.7)
        if case == "draft_model_seeded_rows":
            kwargs = dict(generators=[torch.Generator().manual_seed(i) for i in range(N)])
        first = _first_token_call(P1, torch.stack([x1, x2], 1), q, k=2, **kwargs)
    stat, df, pvalue = chi_square(_counts(first, vocab), P1)
    print(f"first token {case}: chi2={stat:.2f} df={df} p={pvalue:.4f}")
    assert pvalue > ALPHA


def _one_position(p, q, drafts, residual, seed):
    """A reference single-position verifier with a pluggable residual: accept x with
    probability min(1, p(x)/q(x)), else draw from norm(residual(p, q)) (p where empty).
    p, q [V]; drafts [N] -> the emitted tokens [N]."""
    g = torch.Generator().manual_seed(seed)
    n = drafts.shape[0]
    accept = torch.rand(n, generator=g) * q[drafts] < p[drafts]  # [N]
    r = residual(p, q)
    r = r / r.sum() if r.sum() > 0 else p
    resampled = torch.multinomial(r, n, replacement=True, generator=g)  # [N]
    return torch.where(accept, drafts, resampled)


@pytest.mark.parametrize("proposer", ["draft_model", "ngram"])
def test_the_chi_square_test_catches_the_wrong_residual(proposer):
    """The test above has power: the common mistake max(0, q - p) in place of
    max(0, p - q) gives a p-value below 1e-30 for the same p, q and N, while the same
    reference verifier with the right residual passes (alpha = 1e-4)."""
    vocab = P1.shape[0]
    if proposer == "draft_model":
        q, drafts = Q1, _draw(Q1, N, seed=8)
    else:  # a point mass at a token p gives 0.20
        q, drafts = torch.nn.functional.one_hot(torch.tensor(3), vocab).float(), torch.full((N,), 3)
    right = _one_position(P1, q, drafts, lambda p, q: (p - q).clamp(min=0), seed=9)
    wrong = _one_position(P1, q, drafts, lambda p, q: (q - p).clamp(min=0), seed=9)
    _, _, p_right = chi_square(_counts(right, vocab), P1)
    wrong_counts = _counts(wrong, vocab).double()
    support = P1 > 0  # the wrong residual emits where p is 0; score the other cells only
    stat_wrong, _, p_wrong = chi_square(wrong_counts * support, P1)
    print(f"{proposer}: right residual p={p_right:.4f}, wrong residual chi2={stat_wrong:.0f} "
          f"p={p_wrong:.3g}")
    assert p_right > ALPHA
    assert p_wrong < 1e-30


def test_an_empty_residual_falls_back_to_p(seeded):
    """A draft the draft model gives no mass to, where p has none either and p == q: it is
    rejected (u * 0 < 0 fails), the residual max(0, p - q) is empty, and p is drawn."""
    vocab = P1.shape[0]
    n = 2000
    drafts = torch.full((n, 1), 2)  # P1[2] == 0
    target = torch.stack([P1, P1])[None].expand(n, 2, vocab).contiguous()
    out = rejection_sample(target, torch.zeros(n, 2, dtype=torch.int64), drafts, [1] * n,
                           P1[None, None].expand(n, 1, vocab).contiguous(),
                           torch.zeros(n, dtype=torch.bool), [None] * n)
    assert out.num_accepted == [0] * n
    first = _first_tokens(out)
    assert bool((P1[first] > 0).all())
    assert len(set(first.tolist())) == int((P1 > 0).sum())  # p itself, not one token


# ---------------------------------------------------------------- two tokens ~ p_1 x p_2


# V=4; p_2 and q_2 depend on the first token, as a model's next distribution does.
P1_4 = torch.tensor([0.5, 0.3, 0.2, 0.0])
Q1_4 = torch.tensor([0.2, 0.3, 0.1, 0.4])
P2_4 = torch.tensor([[0.1, 0.2, 0.3, 0.4],
                     [0.7, 0.0, 0.3, 0.0],
                     [0.25, 0.25, 0.25, 0.25],
                     [0.4, 0.3, 0.2, 0.1]])  # [first token, V]
Q2_4 = torch.tensor([[0.4, 0.3, 0.2, 0.1],
                     [0.1, 0.6, 0.1, 0.2],
                     [0.25, 0.25, 0.25, 0.25],
                     [0.1, 0.1, 0.1, 0.7]])


def _two_tokens(seed):
    """N rows of one speculative step with K=2 draft-model drafts, then, for the rows
    that emitted only one token (first draft rejected), a second step with one draft.
    Returns (the first two tokens of each row's output [N, 2], num_accepted of step 1 [N])."""
    vocab = P1_4.shape[0]
    g = torch.Generator().manual_seed(seed)
    x1 = torch.multinomial(Q1_4, N, replacement=True, generator=g)  # [N]
    x2 = torch.multinomial(Q2_4[x1], 1, generator=g).squeeze(1)  # [N] from q_2(. | x1)
    target = torch.stack([P1_4.expand(N, vocab), P2_4[x1], torch.ones(N, vocab) / vocab], 1)
    draft = torch.stack([Q1_4.expand(N, vocab), Q2_4[x1]], 1)  # [N, 2, V]
    out = rejection_sample(target, torch.zeros(N, 3, dtype=torch.int64), torch.stack([x1, x2], 1),
                           [2] * N, draft, torch.zeros(N, dtype=torch.bool), [None] * N)
    first = _first_tokens(out)  # [N]
    # The next step for every row (used where step 1 emitted one token): context `first`.
    y = torch.multinomial(Q2_4[first], 1, generator=g).squeeze(1)  # [N]
    target2 = torch.stack([P2_4[first], torch.ones(N, vocab) / vocab], 1)  # [N, 2, V]
    out2 = rejection_sample(target2, torch.zeros(N, 2, dtype=torch.int64), y[:, None], [1] * N,
                            Q2_4[first][:, None], torch.zeros(N, dtype=torch.bool), [None] * N)
    second = torch.tensor([ids[1] if len(ids) > 1 else nxt[0]
                           for ids, nxt in zip(out.token_ids, out2.token_ids)])
    return torch.stack([first, second], 1), torch.tensor(out.num_accepted)


def _pair_counts(pairs: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(pairs[:, 0] * vocab + pairs[:, 1], minlength=vocab * vocab).view(vocab, vocab)


def test_first_two_tokens_are_distributed_as_p1_times_p2(seeded):
    """The first two tokens of each row's output (a second step where the first draft was
    rejected) against p_1(a) p_2(b | a): chi-square over the 4x4 pairs with nonzero mass,
    alpha = 1e-4 (false failure 1e-4 per change of the random stream)."""
    vocab = P1_4.shape[0]
    pairs, _ = _two_tokens(seed=10)
    stat, df, pvalue = chi_square(_pair_counts(pairs, vocab), P1_4[:, None] * P2_4)
    print(f"pairs: chi2={stat:.2f} df={df} p={pvalue:.4f}")
    assert pvalue > ALPHA


def test_pairs_after_an_accepted_first_draft(seeded):
    """Among rows whose first draft was accepted, the pair (x_1, second token) follows
    min(p_1, q_1)(a) / alpha_1 * p_2(b | a): the accepted draft is distributed as
    min(p, q) normalised (not p_1: conditioning on acceptance changes it), and the next
    token is still exactly p_2 given it. Chi-square at alpha = 1e-4."""
    vocab = P1_4.shape[0]
    pairs, accepted = _two_tokens(seed=11)
    given = pairs[accepted >= 1]
    first_law = torch.minimum(P1_4, Q1_4)
    stat, df, pvalue = chi_square(_pair_counts(given, vocab), first_law[:, None] * P2_4)
    alpha_1 = float(first_law.sum())
    print(f"pairs | accepted: n={len(given)} (expected {alpha_1 * N:.0f}) chi2={stat:.2f} df={df} "
          f"p={pvalue:.4f}")
    assert pvalue > ALPHA


# ---------------------------------------------------------------- acceptance counts


@pytest.mark.parametrize("proposer", ["draft_model", "ngram"])
def test_accepted_count_matches_the_theory(proposer, seeded):
    """With position-independent p_i, q_i, acceptance at i has probability
    alpha_i = sum_x min(p_i(x), q_i(x)) (p_i(x_i) for an n-gram's point mass), so
    P(A = j) = alpha_1...alpha_j (1 - alpha_j+1) and E[A] = sum_i alpha_1...alpha_i.
    The mean must be within 5 standard errors of E[A] (false failure ~6e-7) and the
    histogram of A must pass chi-square at alpha = 1e-4."""
    k, vocab = 3, 8
    g = torch.Generator().manual_seed(12)
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, -1)  # [K+1, V]
    if proposer == "draft_model":
        q = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, -1)  # [K, V]
        drafts = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g)
                              for i in range(k)], 1)  # [N, K]
        alphas = torch.minimum(p[:k], q).sum(-1)  # [K]
        draft_probs = q[None].expand(N, k, vocab).contiguous()
    else:
        fixed = torch.tensor([2, 5, 1])
        drafts = fixed[None].expand(N, k).contiguous()
        alphas = p[torch.arange(k), fixed]
        draft_probs = None
    out = rejection_sample(p[None].expand(N, k + 1, vocab).contiguous(),
                           torch.zeros(N, k + 1, dtype=torch.int64), drafts, [k] * N, draft_probs,
                           torch.zeros(N, dtype=torch.bool), [None] * N)
    accepted = torch.tensor(out.num_accepted, dtype=torch.float64)
    assert all(len(ids) == a + 1 for ids, a in zip(out.token_ids, out.num_accepted))
    reach = torch.cumprod(alphas.double(), 0)  # [K] P(A >= i)
    expected_mean = float(reach.sum())
    stderr = float(accepted.std()) / math.sqrt(N)
    law = torch.cat([torch.ones(1, dtype=torch.float64), reach]) - torch.cat(
        [reach, torch.zeros(1, dtype=torch.float64)])  # [K+1] P(A = j)
    stat, df, pvalue = chi_square(torch.bincount(accepted.long(), minlength=k + 1), law)
    print(f"accepted {proposer}: alphas={[round(a, 3) for a in alphas.tolist()]} mean="
          f"{float(accepted.mean()):.4f} expected={expected_mean:.4f} (stderr {stderr:.4f}) p={pvalue:.4f}")
    assert abs(float(accepted.mean()) - expected_mean) < 5 * stderr
    assert pvalue > ALPHA


# ---------------------------------------------------------------- batches and seeds


def _mixed_batch(with_draft_probs, seed=0):
    b, k, vocab = 5, 4, 50
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(b, k + 1, vocab, generator=g), -1)  # [B, K+1, V]
    argmax = argmax_rows(target.flatten(0, 1)).view(b, k + 1)
    # Drafts from a q close to p so that some are accepted, some rejected.
    draft_probs = torch.softmax(target[:, :k].log() + 0.5 * torch.randn(b, k, vocab, generator=g), -1)
    drafts = torch.multinomial(draft_probs.flatten(0, 1), 1, generator=g).view(b, k)
    drafts[2, 0] = argmax[2, 0]  # the greedy row accepts at least one
    num = [4, 0, 3, 1, 2]
    greedy = torch.tensor([False, False, True, False, False])
    return target, argmax, drafts, num, draft_probs if with_draft_probs else None, greedy


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_padded_rows_equal_single_rows(with_draft_probs):
    """Rows with different K'_b in one padded batch emit what each emits alone (with its
    own K = K'_b), given the same per-row seeds: a seeded row draws K'_b uniforms and V
    exponentials whatever the padding, so its result does not depend on its batch."""
    target, argmax, drafts, num, draft_probs, greedy = _mixed_batch(with_draft_probs)
    drafts[1, :] = -7  # padding may be any id
    b = len(num)
    batch = rejection_sample(target, argmax, drafts, num, draft_probs, greedy,
                             [torch.Generator().manual_seed(100 + i) for i in range(b)])
    for i, k in enumerate(num):
        alone = rejection_sample(
            target[i:i + 1, :k + 1], argmax[i:i + 1, :k + 1], drafts[i:i + 1, :k], [k],
            None if draft_probs is None else draft_probs[i:i + 1, :k], greedy[i:i + 1],
            [torch.Generator().manual_seed(100 + i)])
        assert batch.token_ids[i] == alone.token_ids[0], i
        assert batch.num_accepted[i] == alone.num_accepted[0]
        assert batch.token_ids[i][:-1] == drafts[i, :batch.num_accepted[i]].tolist()
        assert batch.num_accepted[i] <= k
    assert len(batch.token_ids[1]) == 1  # no drafts: one sampled token
    # The batch mixes outcomes: some drafts accepted, some rows stopped by a rejection.
    assert 0 < sum(batch.num_accepted) < sum(num)


def test_seeded_rows_are_reproducible():
    target, argmax, drafts, num, draft_probs, greedy = _mixed_batch(True, seed=3)
    b = len(num)

    def run(seed, global_seed):
        torch.manual_seed(global_seed)  # unseeded randomness must not matter
        return rejection_sample(target, argmax, drafts, num, draft_probs, greedy,
                                [torch.Generator().manual_seed(seed + i) for i in range(b)])

    with torch.random.fork_rng(devices=[]):
        assert run(7, global_seed=1) == run(7, global_seed=2)
        # Over many seeds the outcomes vary: the generators are used.
        assert len({str(run(s, global_seed=1).token_ids) for s in range(0, 200, 5)}) > 1


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("change, field", [
    (dict(target_probs=torch.zeros(2, 2, 5)), "target_probs"),
    (dict(target_argmax=torch.zeros(2, 2, dtype=torch.int64)), "target_argmax"),
    (dict(draft_token_ids=torch.zeros(2, dtype=torch.int64)), "draft_token_ids"),
    (dict(num_draft_tokens=[1, 3]), "num_draft_tokens"),
    (dict(num_draft_tokens=[1]), "num_draft_tokens"),
    (dict(num_draft_tokens=[True, 1]), "num_draft_tokens"),
    (dict(draft_probs=torch.zeros(2, 2, 4)), "draft_probs"),
    (dict(greedy=torch.zeros(2)), "greedy"),
    (dict(generators=[None]), "generators"),
])
def test_bad_input_names_the_argument(change, field):
    args = dict(target_probs=torch.ones(2, 3, 5) / 5, target_argmax=torch.zeros(2, 3, dtype=torch.int64),
                draft_token_ids=torch.zeros(2, 2, dtype=torch.int64), num_draft_tokens=[1, 2],
                draft_probs=None, greedy=torch.zeros(2, dtype=torch.bool), generators=[None, None])
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        rejection_sample(**{**args, **change})
