"""The C-MLFQ prefix tree and its length histograms."""

from __future__ import annotations

import numpy as np
import pytest

from libra.routing.histogram import LengthHistogram
from libra.routing.tree import PrefixTree

OK = ("search", "small", "ok")
ERR = ("search", "small", "error")


def test_histogram_mean_is_exact_and_quantiles_are_within_a_bin():
    rng = np.random.default_rng(0)
    xs = rng.lognormal(8, 1, size=400)
    h = LengthHistogram(window=1000)
    for x in xs:
        h.add(float(x))
    mean, p90 = h.mean_p90()
    assert mean == pytest.approx(xs.mean())
    assert p90 == pytest.approx(np.percentile(xs, 90), rel=0.06)
    for x in (1000.0, 3000.0, 10000.0):
        assert h.cdf(x) == pytest.approx((xs <= x).mean(), abs=0.03)
    above = xs[xs > 5000]
    assert h.conditional_mean(5000) == pytest.approx(above.mean(), rel=0.06)
    assert h.quantile(0.5, above=5000) == pytest.approx(np.median(above), rel=0.06)
    assert h.quantile(0.5, above=1e9) == 0.0 and h.conditional_mean(1e9) == 0.0


def test_histogram_forgets_what_is_two_windows_old():
    h = LengthHistogram(window=10)
    for _ in range(10):
        h.add(100.0)
    for _ in range(20):
        h.add(5000.0)
    assert h.count == 20
    assert h.mean_p90()[0] == pytest.approx(5000.0)


def test_histograms_merge_into_the_union_and_survive_serialisation():
    a, b, both = LengthHistogram(50), LengthHistogram(50), LengthHistogram(1000)
    for i in range(40):
        a.add(100.0 + i)
        b.add(9000.0 + i)
        both.add(100.0 + i)
        both.add(9000.0 + i)
    a.merge(b)
    assert a.count == 80 and a.mean_p90() == pytest.approx(both.mean_p90())
    again = LengthHistogram.from_list(a.to_list(), 50)
    assert again.count == 80 and again.mean_p90() == a.mean_p90()


def _tree(**kw):
    return PrefixTree(window=64, **kw)


def test_lookup_takes_the_deepest_node_with_enough_samples():
    t = _tree()
    for _ in range(5):
        t.insert("p", [(OK, 3000), (ERR, 2000)], 4000, 5000)
    for _ in range(5):
        t.insert("p", [(OK, 1000)], 1500, 2500)
    m = t.lookup("p", [OK, ERR], min_samples=5)
    assert (m.tree, m.depth) == ("prompt", 2)
    assert m.node.rem.mean_p90()[0] == pytest.approx(2000)
    m = t.lookup("p", [OK, ERR], min_samples=6)  # the ERR node has only 5
    assert m.depth == 1 and m.node.rem.count == 10
    assert t.lookup("p", [OK], min_samples=11) is None


def test_unseen_prompts_use_the_pooled_tree_and_a_tie_goes_to_the_prompt():
    t = _tree()
    for i in range(8):
        t.insert(f"p{i}", [(OK, 100)], 900, 1000)
    m = t.lookup("new", [OK], min_samples=4)
    assert (m.tree, m.depth, m.node.rem.count) == ("pooled", 1, 8)
    for _ in range(4):
        t.insert("p0", [(OK, 5000)], 6000, 7000)
    m = t.lookup("p0", [OK], min_samples=4)
    assert (m.tree, m.depth) == ("prompt", 1)


def test_node_cap_evicts_least_recently_updated_prompts():
    t = _tree(max_nodes=40)
    for i in range(30):
        t.insert(f"p{i}", [(OK, 10), (ERR, 5)], 20, 30)
    assert t.nodes <= 40
    assert t.nodes == t.pooled.size() + sum(r.size() for r in t.prompts.values())
    assert "p29" in t.prompts and "p0" not in t.prompts
    # the pooled tree keeps everything it learned
    assert t.lookup("p0", [OK, ERR], min_samples=30).node.rem.count == 30


def test_pooled_tree_is_pruned_when_it_alone_exceeds_the_cap():
    t = _tree(max_nodes=10)
    for i in range(50):
        t.insert("p", [(("tool", "small", str(i)), 1)], 2, 3)  # 50 distinct branches
    t.insert("p", [(OK, 1)], 2, 3)
    assert t.nodes <= 10


def test_save_load_and_merge_keep_the_statistics():
    a, b = _tree(), _tree()
    for i in range(20):
        a.insert(f"p{i % 3}", [(OK, 100 * i)], 100 * i + 50, 100 * i + 90)
        b.insert(f"p{i % 5}", [(ERR, 70 * i)], 70 * i + 50, 70 * i + 90)
    a.meta = {"small_payload": 500}
    loaded = PrefixTree.from_bytes(a.to_bytes(), window=64)
    assert loaded.meta == a.meta and loaded.nodes == a.nodes
    for key in (OK,):
        assert (
            loaded.lookup("p1", [key], 1).node.rem.mean_p90()
            == a.lookup("p1", [key], 1).node.rem.mean_p90()
        )
    a.merge(b)
    assert a.pooled.rem.count == 40 and a.lookup("p4", [ERR], 1).tree == "prompt"
    assert a.nodes == a.pooled.size() + sum(r.size() for r in a.prompts.values())
    with pytest.raises(ValueError, match="not a C-MLFQ tree"):
        PrefixTree.from_bytes(b'{"x": 1}')


def test_a_subtree_built_on_lookup_equals_one_built_as_episodes_arrived():
    # `late` defers each prompt's subtree until it is looked up (here: never before the
    # end); `early` looks each prompt up right after its first episode, so its subtree
    # grows episode by episode. Same statistics, node counts, evictions and bytes.
    rng = np.random.default_rng(3)
    states = [OK, ERR, ("bash", "large", "ok"), ("bash", "small", "timeout")]
    late, early = _tree(max_nodes=400), _tree(max_nodes=400)
    for _ in range(600):
        task = f"p{int(rng.integers(0, 40))}"
        path = [(states[int(rng.integers(0, 4))], int(rng.integers(0, 9000)))
                for _ in range(int(rng.integers(0, 7)))]  # fmt: skip
        total = int(rng.integers(9000, 20000))
        for t in (late, early):
            t.insert(task, path, total - 100, total)
        early.lookup(task, [], 1)
        assert late.nodes == early.nodes <= 400
        assert list(late.prompts) == list(early.prompts)  # the same evictions
    assert late.nodes == late.pooled.size() + sum(r.size() for r in late.prompts.values())
    task = next(iter(late.prompts))
    for keys in ([], [OK], [OK, ERR], states):
        a, b = late.lookup(task, keys, 2), early.lookup(task, keys, 2)
        assert (a.tree, a.depth, a.node.rem.mean_p90()) == (b.tree, b.depth, b.node.rem.mean_p90())
    assert late.to_bytes() == early.to_bytes()
