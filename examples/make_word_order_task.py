"""A small SYNTHETIC downstream task for the demo, from text the demo's pretraining never saw:
is this sentence in its original word order, or were two adjacent words swapped?

The sentences are those of the documents --split assigns to validation and test (the
pretraining runs train on the train documents only), decoded from the indexed dataset.
Each sentence appears once, either as it is ("original") or with one random pair of
adjacent words exchanged ("swapped"), half and half; 80% of the sentences go to train.tsv,
20% to dev.tsv, in the custom task's layout (tasks/: header "sentence<TAB>label").

    python examples/make_word_order_task.py --data-path demo_output/demo_text_sentence \\
        --tokenizer-model demo_output/tokenizer.model --split 90,5,5 --output demo_output/word_order
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_taco.data.indexed_dataset import IndexedDataset
from megatron_taco.data.samples import get_split_document_ranges
from megatron_taco.data.tokenizer import Tokenizer


def held_out_sentences(
    prefix: str, tokenizer: Tokenizer, split: str, parts: tuple[str, ...] = ("valid", "test")
) -> list[str]:
    """The sentences of the documents --split keeps out of training: of its validation and
    test parts, or of those named in ``parts`` (a model selection on one, the figure on the
    other)."""
    data = IndexedDataset(prefix)
    docs = data.document_indices
    _, valid, test = get_split_document_ranges(len(docs) - 1, split)
    ranges = {"valid": valid, "test": test}
    out = []
    for start, end in (ranges[part] for part in parts):
        for seq in range(int(docs[start]), int(docs[end])):
            text = " ".join(tokenizer.decode(data[seq]).split())
            words = text.split()
            # Two distinct words at least: shuffle_words looks for an order other than this one.
            if 8 <= len(words) <= 40 and len(set(words)) > 1 and "\t" not in text:
                out.append(text)
    return out


def swap_adjacent(sentence: str, rng: np.random.Generator) -> str:
    words = sentence.split()
    # Never a pair of equal words (the swap would change nothing).
    pairs = [i for i in range(len(words) - 1) if words[i] != words[i + 1]]
    i = int(rng.choice(pairs))
    words[i], words[i + 1] = words[i + 1], words[i]
    return " ".join(words)


def shuffle_words(sentence: str, rng: np.random.Generator) -> str:
    words = sentence.split()
    while True:  # any order but the original one
        order = rng.permutation(len(words))
        shuffled = [words[i] for i in order]
        if shuffled != words:
            return " ".join(shuffled)


CORRUPTIONS = {"swap": (swap_adjacent, "swapped"), "shuffle": (shuffle_words, "shuffled")}


def train_dev_rows(
    sentences: list[str], corruption: str, rng: np.random.Generator, both_forms: bool = False
) -> dict[str, list[tuple[str, str]]]:
    """{"train", "dev"}: (text, label) rows, a fifth of them dev. Each sentence once, as it
    is or corrupted, half and half; ``both_forms``: each sentence in both forms, the
    sentences (not the rows) split, so that no dev sentence is seen in training."""
    corrupt, label = CORRUPTIONS[corruption]
    if both_forms:
        order = rng.permutation(len(sentences))
        n_dev = len(sentences) // 5
        return {name: [row for i in idx for row in ((sentences[i], "original"),
                                                   (corrupt(sentences[i], rng), label))]
                for name, idx in (("dev", order[:n_dev]), ("train", order[n_dev:]))}  # fmt: skip
    rows = [(corrupt(s, rng), label) if i % 2 else (s, "original") for i, s in enumerate(sentences)]
    order = rng.permutation(len(rows))
    n_dev = len(rows) // 5
    return {"dev": [rows[i] for i in order[:n_dev]], "train": [rows[i] for i in order[n_dev:]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-path", required=True)
    p.add_argument("--tokenizer-model", required=True)
    p.add_argument("--split", default="90,5,5")
    p.add_argument("--output", required=True)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--corruption",
        choices=sorted(CORRUPTIONS),
        default="swap",
        help="swap: two adjacent words exchanged; shuffle: every word of the sentence reordered.",
    )
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)
    sentences = held_out_sentences(args.data_path, Tokenizer(args.tokenizer_model), args.split)
    splits = train_dev_rows(sentences, args.corruption, rng)
    os.makedirs(args.output, exist_ok=True)
    for name, rows in splits.items():
        with open(os.path.join(args.output, f"{name}.tsv"), "w", encoding="utf-8") as f:
            f.write("sentence\tlabel\n")
            f.writelines(f"{text}\t{label}\n" for text, label in rows)
    print(
        f"word-order task (synthetic): {len(splits['train'])} train, {len(splits['dev'])} dev "
        f"sentences from the held-out documents of {args.data_path} -> {args.output}"
    )


if __name__ == "__main__":
    main()
