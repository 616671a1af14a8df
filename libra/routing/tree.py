"""The causal prefix tree of C-MLFQ.

A node is reached from a root by the ordered tool-return states of an episode; a state
is `(tool, size class, status)`. There is one root per prompt (`task_id`) and one pooled
root that every episode also updates, which serves prompts the tree has not seen. Each
node keeps two length distributions (`LengthHistogram`) of the episodes that passed
through it: the *remaining* length from that point, and the *total* length.

A prompt's subtree below its root is built when the prompt is looked up again, not as
its episodes arrive: until then the tree keeps the episodes' paths and the subtree's shape
(so `nodes` and eviction are exactly as if it were built). Most prompts of a training run
come back an epoch later or never, and building theirs eagerly was most of the cost of
learning; the first lookup of a returning prompt replays its episodes once.

Memory is bounded: past `max_nodes` whole prompt subtrees are evicted, least recently
updated first; if the pooled tree alone is too big its rarest branches are pruned. Paths
deeper than `max_depth` states stop growing. Trees merge (counts add), and serialise to
bytes (`to_bytes` / `from_bytes`); file I/O lives in `libra.routing.store`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from libra.routing.histogram import LengthHistogram

StateKey = tuple[str, str, str]
"""(tool name, payload size class `small` / `medium` / `large`, status)."""

FORMAT_VERSION = 1
_SEP = "\t"
_DEFER_EPISODES = 64
"""A prompt's subtree is built once it holds this many episodes even if the prompt is
not looked up (bounds the paths kept and what one lookup replays)."""


class Node:
    __slots__ = ("children", "rem", "total")

    def __init__(self, window: int):
        self.children: dict[StateKey, Node] = {}
        self.rem = LengthHistogram(window)
        """Remaining length (tokens) from this point to the end of the episode."""
        self.total = LengthHistogram(window)
        """Final total length of the episodes that passed here."""

    def size(self) -> int:
        n, stack = 0, [self]
        while stack:
            node = stack.pop()
            n += 1
            stack.extend(node.children.values())
        return n


class _PromptRoot(Node):
    """A prompt's root. Until `build`, the subtree below it exists only as the paths of
    its episodes (`episodes`) and its shape (`shape`, nested dicts of state keys, to
    count the nodes it will have: `below`)."""

    __slots__ = ("below", "episodes", "shape")

    def __init__(self, window: int):
        super().__init__(window)
        self.episodes: list[tuple[Sequence[tuple[StateKey, int]], int]] | None = []
        self.shape: dict[StateKey, Any] = {}
        self.below = 0

    def defer(self, path: Sequence[tuple[StateKey, int]], total: int) -> int:
        """Keep an episode for `build`; the nodes its path adds to the subtree."""
        assert self.episodes is not None
        self.episodes.append((path, total))
        new, shape = 0, self.shape
        for key, _ in path:
            nxt = shape.get(key)
            if nxt is None:
                nxt = shape[key] = {}
                new += 1
            shape = nxt
        self.below += new
        return new

    def build(self, window: int) -> list[Node]:
        """Grow the subtree from the kept episodes, in their order (the same histograms
        as adding them one by one); the nodes built."""
        episodes, self.episodes, self.shape = self.episodes or [], None, {}
        built: list[Node] = []
        for path, total in episodes:
            node: Node = self
            for key, remaining in path:
                child = node.children.get(key)
                if child is None:
                    child = node.children[key] = Node(window)
                    built.append(child)
                child.rem.add(remaining)
                child.total.add(total)
                node = child
        return built

    def size(self) -> int:
        return 1 + self.below if self.episodes is not None else super().size()


@dataclass(frozen=True, slots=True)
class Match:
    node: Node
    depth: int
    """States matched from the root (0 = the root itself)."""
    tree: str
    """`prompt` or `pooled`."""


class PrefixTree:
    def __init__(self, *, window: int = 256, max_nodes: int = 200_000, max_depth: int = 64):
        self.window = window
        self.max_nodes = max_nodes
        self.max_depth = max_depth
        self.pooled = Node(window)
        self.prompts: OrderedDict[str, Node] = OrderedDict()
        self.nodes = 1
        self.episodes = 0
        self._touched: list[Node] = []
        self.meta: dict[str, Any] = {}
        """Saved with the tree: what its keys mean (e.g. the payload size thresholds)."""

    # --- learning ----------------------------------------------------------------
    def insert(
        self, task_id: str, path: Sequence[tuple[StateKey, int]], start_remaining: int, total: int
    ) -> None:
        """Add one finished episode: `path` pairs each tool-return state with the
        remaining length after it; `start_remaining` is the length after the prompt."""
        root = self.prompts.get(task_id)
        if root is None:
            root = self.prompts[task_id] = _PromptRoot(self.window)
            self.nodes += 1
        else:
            self.prompts.move_to_end(task_id)
        path = path[: self.max_depth]
        tops: tuple[Node, ...] = (root, self.pooled)
        if isinstance(root, _PromptRoot) and root.episodes is not None:
            root.rem.add(start_remaining)
            root.total.add(total)
            self._touched.append(root)
            self.nodes += root.defer(path, total)
            if len(root.episodes) >= _DEFER_EPISODES:  # bound what a lookup replays
                self._touched.extend(root.build(self.window))
            tops = (self.pooled,)
        for top in tops:
            top.rem.add(start_remaining)
            top.total.add(total)
            node = top
            for key, remaining in path:
                child = node.children.get(key)
                if child is None:
                    child = node.children[key] = Node(self.window)
                    self.nodes += 1
                child.rem.add(remaining)
                child.total.add(total)
                self._touched.append(child)
                node = child
            self._touched.append(top)
        self.episodes += 1
        if self.nodes > self.max_nodes:
            self._evict()

    def refresh(self, min_samples: int = 1) -> None:
        """Precompute the statistics of the nodes changed since the last refresh, so
        that lookups (the routing hot path) never pay for it. Nodes with fewer than
        `min_samples` episodes are skipped: `lookup` never reads them (their statistics
        are computed on demand if something else does)."""
        for node in self._touched:
            if node.rem.count >= min_samples:
                node.rem.summary()
                node.total.summary()
        self._touched = []

    def _evict(self) -> None:
        while self.nodes > self.max_nodes and self.prompts:
            _, root = self.prompts.popitem(last=False)
            self.nodes -= root.size()
        floor = 2
        while self.nodes > self.max_nodes and self.pooled.children:
            self.nodes -= _prune(self.pooled, floor)
            floor *= 2

    # --- lookup ------------------------------------------------------------------
    def lookup(self, task_id: str, keys: Iterable[StateKey], min_samples: int) -> Match | None:
        """The deepest node along `keys` with at least `min_samples` episodes, in the
        prompt's tree or the pooled one (the prompt's wins a tie)."""
        best: Match | None = None
        for match in self.lookup_each(task_id, keys, min_samples):
            if match is not None and (best is None or match.depth > best.depth):
                best = match
        return best

    def lookup_each(
        self, task_id: str, keys: Iterable[StateKey], min_samples: int
    ) -> tuple[Match | None, Match | None]:
        """The deepest node along `keys` with at least `min_samples` episodes in the
        prompt's tree, and in the pooled one (None where the root has fewer)."""
        keys = tuple(keys)
        found: list[Match | None] = []
        mine = self.prompts.get(task_id)
        if isinstance(mine, _PromptRoot) and mine.episodes is not None:
            for node in mine.build(self.window):  # as `refresh` would have
                if node.rem.count >= min_samples:
                    node.rem.summary()
                    node.total.summary()
        for name, root in (("prompt", mine), ("pooled", self.pooled)):
            if root is None or root.rem.count < min_samples:
                found.append(None)
                continue
            node, depth = root, 0
            for key in keys:
                child = node.children.get(key)
                # counts only shrink going down: the first thin node ends the walk
                if child is None or child.rem.count < min_samples:
                    break
                node, depth = child, depth + 1
            found.append(Match(node, depth, name))
        return found[0], found[1]

    # --- combining and persistence -----------------------------------------------
    def merge(self, other: PrefixTree) -> None:
        """Add another tree's observations (e.g. from another rollout process)."""
        self._build_all()
        other._build_all()
        _merge(self.pooled, other.pooled, self.window)
        for task_id, root in other.prompts.items():
            mine = self.prompts.get(task_id)
            if mine is None:
                mine = self.prompts[task_id] = Node(self.window)
            _merge(mine, root, self.window)
        self.episodes += other.episodes
        self.nodes = self.pooled.size() + sum(r.size() for r in self.prompts.values())
        if self.nodes > self.max_nodes:
            self._evict()

    def _build_all(self) -> None:
        for root in self.prompts.values():
            if isinstance(root, _PromptRoot) and root.episodes is not None:
                root.build(self.window)

    def to_bytes(self) -> bytes:
        self._build_all()
        return orjson.dumps(
            {
                "format": "libra-cmlfq-tree",
                "version": FORMAT_VERSION,
                "window": self.window,
                "episodes": self.episodes,
                "meta": self.meta,
                "pooled": _dump(self.pooled),
                "prompts": {k: _dump(v) for k, v in self.prompts.items()},
            }
        )

    @classmethod
    def from_bytes(
        cls, data: bytes, *, window: int = 256, max_nodes: int = 200_000, max_depth: int = 64
    ) -> PrefixTree:
        doc = orjson.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != "libra-cmlfq-tree":
            raise ValueError("not a C-MLFQ tree file")
        if doc.get("version") != FORMAT_VERSION:
            raise ValueError(f"tree format version {doc.get('version')}; this Libra reads 1")
        tree = cls(window=window, max_nodes=max_nodes, max_depth=max_depth)
        tree.episodes = int(doc["episodes"])
        tree.meta = dict(doc.get("meta") or {})
        tree.pooled = _load(doc["pooled"], window)
        for task_id, node in doc["prompts"].items():
            tree.prompts[task_id] = _load(node, window)
        tree.nodes = tree.pooled.size() + sum(r.size() for r in tree.prompts.values())
        if tree.nodes > max_nodes:
            tree._evict()
        return tree


def _prune(node: Node, floor: int) -> int:
    """Drop the branches under `node` seen by fewer than `floor` episodes; nodes removed."""
    removed = 0
    for key, child in list(node.children.items()):
        if child.rem.count < floor:
            removed += child.size()
            del node.children[key]
        else:
            removed += _prune(child, floor)
    return removed


def _merge(into: Node, other: Node, window: int) -> None:
    into.rem.merge(other.rem)
    into.total.merge(other.total)
    for key, child in other.children.items():
        mine = into.children.get(key)
        if mine is None:
            mine = into.children[key] = Node(window)
        _merge(mine, child, window)


def _dump(node: Node) -> list[Any]:
    kids = {_SEP.join(k): _dump(c) for k, c in node.children.items()}
    return [node.rem.to_list(), node.total.to_list(), kids]


def _load(data: list[Any], window: int) -> Node:
    node = Node(window)
    node.rem = LengthHistogram.from_list(data[0], window)
    node.total = LengthHistogram.from_list(data[1], window)
    for key, child in data[2].items():
        tool, size, status = key.split(_SEP)
        node.children[(tool, size, status)] = _load(child, window)
    return node


__all__ = ["Match", "Node", "PrefixTree", "StateKey"]
