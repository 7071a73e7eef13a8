"""Write a small synthetic JSONL corpus (for the quickstart and smoke runs; no download).

    python tools/make_corpus.py OUT.jsonl [--documents N] [--seed S]

Sentences are made from a fixed vocabulary with a little grammar, numbers and non-ASCII words,
so a tokenizer has something to learn and a tiny model has patterns to fit.
"""

from __future__ import annotations

import argparse
import json
import random

SUBJECTS = ["the cat", "a dog", "the model", "our team", "the river", "a student", "the city"]
VERBS = ["sees", "likes", "builds", "follows", "crosses", "reads", "trains"]
OBJECTS = ["the bridge", "a book", "the data", "a small boat", "the garden", "a long road"]
EXTRAS = ["today", "in the morning", "with care", "again", "near the café", "under 3 trees"]


def sentence(rng: random.Random) -> str:
    words = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
    if rng.random() < 0.5:
        words.append(rng.choice(EXTRAS))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice([".", ".", "!", "?"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output")
    parser.add_argument("--documents", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with open(args.output, "w", encoding="utf-8") as f:
        for i in range(args.documents):
            text = " ".join(sentence(rng) for _ in range(rng.randint(2, 12)))
            f.write(json.dumps({"id": i, "text": text}, ensure_ascii=False) + "\n")
    print(f"{args.output}: {args.documents} documents")


if __name__ == "__main__":
    main()
