"""Regenerate `search_qa_corpus.jsonl` and `search_qa.jsonl` (the search-qa env's data).

Source: the per-country JSON files shipped in the `countryinfo` package (PyPI, MIT
licence, Copyright (c) 2018 Porimol Chandro). Every passage is written from those
facts by the templates below; every question is answerable from the corpus and has a
unique answer (questions whose key fact is shared by two countries are dropped).
Single-hop questions (NQ-like) need one passage; bridge questions (HotpotQA-like) need
two: the first search finds the bridge entity, the second the answer.

    pip install countryinfo==1.0.1
    python envs/data/make_search_qa.py          # deterministic for a given seed
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import random
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def load_countries() -> list[dict[str, Any]]:
    import countryinfo

    folder = os.path.join(os.path.dirname(countryinfo.__file__), "data")
    out = []
    for f in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(f, encoding="utf-8") as fh:
            c = json.load(fh)
        if isinstance(c.get("capital"), list):  # a few list several capitals
            c["capital"] = c["capital"][0] if c["capital"] else ""
        if c.get("capital") and c.get("region") and c.get("population"):
            out.append(c)
    return out


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def passages(c: dict[str, Any], names: dict[str, str]) -> list[dict[str, str]]:
    name, iso = c["name"], c["ISO"]["alpha3"]
    where = c.get("intermediateregion") or c["subregion"]
    out = [
        f"{name} is a country in {where}, part of {c['subregion']} in {c['region']}. "
        f"Its capital is {c['capital']}. Its people are called {c.get('demonym') or name}.",
        f"{name} has a population of about {c['population']:,} people"
        + (f" and covers {c['area']:,} square kilometres." if c.get("area") else "."),
    ]
    borders = [names[b] for b in c.get("borders") or [] if b in names]
    out.append(
        f"{name} shares land borders with {_join(borders)}."
        if borders
        else f"{name} has no land borders with other countries."
    )
    extras = []
    if c.get("currencies"):
        extras.append(f"The currency code used in {name} is {_join(c['currencies'])}.")
    if c.get("callingCodes") and c["callingCodes"][0]:
        extras.append(f"The international calling code of {name} is +{c['callingCodes'][0]}.")
    if c.get("tld"):
        extras.append(f"Its internet country code top-level domain is {c['tld'][0]}.")
    if extras:
        out.append(" ".join(extras))
    provinces = [p for p in c.get("provinces") or [] if p != c["capital"]][:12]
    if provinces:
        out.append(f"The provinces or regions of {name} include {_join(provinces)}.")
    return [{"id": f"{iso}-{i}", "title": name, "text": t} for i, t in enumerate(out)]


def _aliases(c: dict[str, Any]) -> list[str]:
    alts = [a.strip() for a in c.get("altSpellings") or [] if len(a.strip()) > 3]
    return list(dict.fromkeys([c["name"], *alts]))


def questions(countries: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    by_capital = collections.Counter(c["capital"] for c in countries)
    by_tld = collections.Counter((c.get("tld") or [""])[0] for c in countries)
    by_code = collections.Counter((c.get("callingCodes") or [""])[0] for c in countries)
    out: list[dict[str, Any]] = []
    for c in countries:
        name, cap = c["name"], c["capital"]
        tld = (c.get("tld") or [""])[0]
        code = (c.get("callingCodes") or [""])[0]
        iso = c["ISO"]["alpha3"]
        qs = [("capital", f"What is the capital of {name}?", [cap], 1)]
        if by_capital[cap] == 1:
            qs.append(
                ("country-of-capital", f"{cap} is the capital of which country?", _aliases(c), 1)
            )
            qs.append(
                (
                    "bridge-region",
                    f"In which region of the world is the country whose capital is {cap}?",
                    [c["region"]],
                    2,
                )
            )
        if tld and by_tld[tld] == 1:
            qs.append(
                (
                    "bridge-tld",
                    f"What is the capital of the country whose internet top-level domain is {tld}?",
                    [cap],
                    2,
                )
            )
        if code and by_code[code] == 1:
            qs.append(
                (
                    "bridge-calling-code",
                    "What is the capital of the country with the "
                    f"international calling code +{code}?",
                    [cap],
                    2,
                )
            )
        for kind, q, answers, hops in qs:
            out.append(
                {
                    "id": f"sqa-{iso}-{kind}",
                    "question": q,
                    "answers": answers,
                    "hops": hops,
                    "kind": kind,
                }
            )
    rng.shuffle(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--questions", type=int, default=256, help="questions written")
    p.add_argument("--out", type=Path, default=HERE)
    args = p.parse_args()
    countries = load_countries()
    names = {c["ISO"]["alpha3"]: c["name"] for c in countries}
    with open(args.out / "search_qa_corpus.jsonl", "w", encoding="utf-8") as f:
        for c in countries:
            for psg in passages(c, names):
                f.write(json.dumps(psg, ensure_ascii=False) + "\n")
    qs = questions(countries, args.seed)[: args.questions]
    with open(args.out / "search_qa.jsonl", "w", encoding="utf-8") as f:
        for q in qs:
            f.write(json.dumps(q, ensure_ascii=False) + "\n")
    print(f"{len(countries)} countries, {len(qs)} questions")


if __name__ == "__main__":
    main()
