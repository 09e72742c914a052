"""A small SYNTHETIC downstream task for the demo, from text the demo's pretraining never saw:
is this sentence in its original word order, or were two adjacent words swapped?

The sentences are those of the documents --split assigns to validation and test (the
pretraining runs train on the train documents only), decoded from the indexed dataset.
Each sentence appears once, either as it is ("original") or with one random pair of
adjacent words exchanged ("swapped"), half and half; 80% of the sentences go to train.tsv,
20% to dev.tsv, in the custom task's layout (tasks/: header "sentence<TAB>label").
The rows: megatron_taco/evaluation/word_order.py.

    python examples/make_word_order_task.py --data-path demo_output/demo_text_sentence \\
        --tokenizer-model demo_output/tokenizer.model --split 90,5,5 --output demo_output/word_order
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_taco.data.tokenizer import Tokenizer
from megatron_taco.evaluation.word_order import CORRUPTIONS, held_out_sentences, train_dev_rows


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
