"""The demo's last table: dev accuracy of the word-order task after fine-tuning each
pretrained encoder, beside the same head trained on the same architecture left at its
random initialisation (what pretraining bought)."""

from __future__ import annotations

import json
import os
import sys


def main(root: str) -> None:
    def dev(run: str) -> tuple[float, int] | None:
        path = os.path.join(root, run, "results.json")
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as f:
            r = json.load(f)
        return r["dev"]["acc"], r["chosen_epoch"]

    print("word-order task (synthetic, held-out sentences: original vs reordered), dev accuracy %")
    print("| encoder | pretrained (epoch) | random init (epoch) | difference |")
    print("|---|---|---|---|")
    for model in ("taco", "sas"):
        pre, rnd = dev(f"{model}_pretrained"), dev(f"{model}_random")
        if pre is None or rnd is None:
            print(f"| {model.upper()} | missing | missing | |")
            continue
        print(f"| {model.upper()} | {pre[0]:.1f} ({pre[1]}) | {rnd[0]:.1f} ({rnd[1]}) | "
              f"{pre[0] - rnd[0]:+.1f} |")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
