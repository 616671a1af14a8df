"""A deterministic training corpus for the tiny model's tokenizer.

Nothing can be downloaded, so the byte-level BPE of `libra make-model` is trained on text
generated here from a fixed seed: English sentences from a small word list, numbers and
arithmetic, JSON tool calls and tool responses in the Hermes/Qwen format, Python code, and
shell commands — the shapes of text an agentic rollout sees. The corpus does not depend on
the model seed, so every checkpoint made by `make-model` shares one tokenizer (a weight
update never changes token ids).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

CORPUS_SEED = 20260603


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_NOUNS = _words(
    "time year people way day man woman child world life hand part place case week company "
    "system program question work government number night point home water room mother area "
    "money story fact month lot right study book eye job word business issue side kind head "
    "house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door "
    "health person art war history party result change morning reason research girl guy moment "
    "air teacher force education file function answer tool server model token search river "
    "table value list error test queue bucket length reward policy episode trainer memory"
)
_VERBS = _words(
    "is was has made said went took came saw knew got gave found thought told became left felt "
    "brought began kept held wrote stood heard let meant set met ran paid sat spoke lay led read "
    "grew lost fell sent built understood drew broke spent cut rose drove bought wore chose "
    "returns calls computes searches answers reads writes sorts counts checks moves learns"
)
_ADJS = _words(
    "good new first last long great little own other old right big high different small large "
    "next early young important few public bad same able late hard major better economic strong "
    "possible whole free military true federal international full special easy clear recent "
    "certain personal open red difficult available likely short single medical current wrong "
    "private past foreign fine common poor natural significant similar hot dead central happy"
)
_WORDS = _words(
    "the of and to a in that it for on with as at by from this but or an not which all "
    "there their what so up out if about who get when make can like no just him know take "
    "into your some could them than then now look only its over think also after use two how"
)
_NAMES = _words(
    "Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Mallory Niaj Olivia Peggy Rupert "
    "Sybil Trent Victor Walter Paris London Berlin Tokyo Cairo Lima Oslo Rome Madrid Vienna"
)
# Roots and affixes: compounds give the BPE trainer English-like morphemes to merge,
# far more than the small word lists above could.
_ROOTS = _words(
    "act add agree allow appear apply argue arrange attach attend bake balance bear beat "
    "believe bind block board break build burn calculate camp care carry cast cause center "
    "charge chart claim class clean close code collect color comfort command compare compile "
    "compute connect consider construct contain control convert correct count cover craft "
    "create cross cycle damage deal decide define deliver depend design develop direct "
    "discover distribute divide document draw dress drink drive employ end engine equip "
    "estimate examine exchange expect experiment explain export express fill finish fit fix "
    "flow fold follow form found frame function gather govern grade graph grow guard guide "
    "handle harm help hold honest hope hunt import improve include increase inform inspect "
    "install instruct interest invent invest join judge kind know label land launch lead "
    "learn light limit link load locate lock manage mark market master match measure merge "
    "mind mix model monitor mount move name nation need normal note number observe offer "
    "open operate order organ own pack paint part pass pay perform place plan play please "
    "point polish port power press print process produce program project protect prove "
    "publish pull push qualify question reach read real reason record reflect relate rely "
    "remark remove render repair report require resolve respect rest return review reward "
    "route rule run sample save scale schedule score search season select sense separate "
    "serve settle shape share shift sign simple sort sound speak spend stand start state "
    "store strong structure succeed supply support system talk teach tend test think trace "
    "track trade train transfer trust turn type use value verify view visit walk watch weight "
    "work write"
)
_PREFIXES = ("", "", "", "un", "re", "pre", "dis", "over", "under", "mis", "non", "inter", "sub")
_SUFFIXES = (
    "",
    "",
    "s",
    "ed",
    "ing",
    "er",
    "ers",
    "ion",
    "ions",
    "able",
    "ly",
    "ment",
    "ments",
    "ness",
    "ful",
    "less",
    "ive",
    "ity",
    "al",
    "ize",
    "ized",
    "ation",
    "ance",
    "ence",
)
_TOOLS = ("search", "python", "bash", "calculator", "view_file", "edit_file", "get_weather")
_PY_NAMES = ("x", "y", "i", "n", "total", "items", "result", "value", "data", "count", "path")


def _compound(r: random.Random) -> str:
    word = r.choice(_PREFIXES) + r.choice(_ROOTS) + r.choice(_SUFFIXES)
    return word.capitalize() if r.random() < 0.1 else word


def _sentence(r: random.Random) -> str:
    parts = [r.choice(_WORDS), r.choice(_ADJS), r.choice(_NOUNS), r.choice(_VERBS)]
    parts += [r.choice(_WORDS), _compound(r), r.choice(_NOUNS), _compound(r)]
    if r.random() < 0.4:
        parts += [r.choice(_WORDS), r.choice(_NAMES)]
    if r.random() < 0.3:
        parts += ["in", str(r.randint(1800, 2030))]
    text = " ".join(parts)
    return text[0].upper() + text[1:] + r.choice(".!?..")


def _paragraph(r: random.Random) -> str:
    return " ".join(_sentence(r) for _ in range(r.randint(2, 6)))


def _arithmetic(r: random.Random) -> str:
    a, b = r.randint(0, 10 ** r.randint(1, 6)), r.randint(0, 10 ** r.randint(1, 4))
    op = r.choice("+-*/")
    result = {"+": a + b, "-": a - b, "*": a * b, "/": round(a / max(b, 1), 4)}[op]
    return f"What is {a} {op} {b}? The answer is <answer>{result}</answer>"


def _tool_call(r: random.Random) -> str:
    name = r.choice(_TOOLS)
    args: dict[str, object] = {"query": f"{_compound(r)} {r.choice(_NOUNS)}"}
    if r.random() < 0.5:
        args["top_k"] = r.randint(1, 10)
    call = json.dumps({"name": name, "arguments": args})
    response = json.dumps({"result": _sentence(r), "score": round(r.random(), 3)})
    think = f"<think>\nI should use {name} to find the {r.choice(_NOUNS)}.\n</think>\n"
    return (
        f"<|im_start|>assistant\n{think}<tool_call>\n{call}\n</tool_call><|im_end|>\n"
        f"<|im_start|>user\n<tool_response>\n{response}\n</tool_response><|im_end|>\n"
    )


def _code(r: random.Random) -> str:
    fn = f"{r.choice(_ROOTS)}_{r.choice(_NOUNS)}"
    a, b = r.sample(_PY_NAMES, 2)
    k = r.randint(0, 99)
    return (
        f"def {fn}({a}: int, {b}: list[int]) -> int:\n"
        f'    """Return the {r.choice(_ADJS)} {r.choice(_NOUNS)}."""\n'
        f"    for i in range(len({b})):\n"
        f"        if {b}[i] > {a} + {k}:\n"
        f"            {a} = {b}[i] * 2\n"
        f"    return {a}\n\n"
        f"print({fn}({k}, [{', '.join(str(r.randint(0, 9)) for _ in range(4))}]))\n"
    )


def _shell(r: random.Random) -> str:
    return r.choice(
        (
            f"$ ls -la /tmp/{r.choice(_NOUNS)}\n",
            f"$ grep -rn '{r.choice(_NOUNS)}' src/ | head -n {r.randint(1, 50)}\n",
            f"$ python -m pytest -q tests/test_{r.choice(_NOUNS)}.py\n{r.randint(1, 99)} passed\n",
            f"$ git diff --stat HEAD~{r.randint(1, 9)}\n",
        )
    )


_KINDS = ((_paragraph, 6), (_arithmetic, 2), (_tool_call, 3), (_code, 2), (_shell, 1))


def corpus(n_docs: int = 20000, seed: int = CORPUS_SEED) -> Iterator[str]:
    """Yield `n_docs` generated documents; the same seed yields the same text."""
    r = random.Random(seed)
    makers = [fn for fn, weight in _KINDS for _ in range(weight)]
    for _ in range(n_docs):
        yield r.choice(makers)(r)


__all__ = ["CORPUS_SEED", "corpus"]
