"""Write a small synthetic JSONL corpus (for smoke runs and benchmarks; no download).

    python tools/make_corpus.py OUT.jsonl [--documents N] [--seed S]

The same generator `llmtrain quickstart` uses: sentences from a fixed vocabulary with a little
grammar, numbers and non-ASCII words, so a tokenizer has something to learn and a tiny model has
patterns to fit.
"""

from __future__ import annotations

import argparse

from llmtrain.train_loop.experiments.quickstart import write_corpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output")
    parser.add_argument("--documents", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_corpus(args.output, args.documents, args.seed)
    print(f"{args.output}: {args.documents} documents")


if __name__ == "__main__":
    main()
