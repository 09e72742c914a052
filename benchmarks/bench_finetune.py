"""Fine-tuning throughput with dynamic padding, side by side in one run, in training
examples per second on real sentence lengths:

- ours, dynamic: SAS-small under the classification head, batches padded to their longest
  example (rounded up to 8), length-grouped (--group-by-length), through the recipe's own
  pieces: EpochShuffled, the driver's PretrainingSampler, DataLoader and tasks.base.Collate;
- ours, padded: the same, every batch padded to --seq-length (--pad-to-seq-length), in the
  plain shuffled order;
- transformers' Trainer on ELECTRA-small (hidden 256, 12 layers, 4 heads, embedding 128,
  ElectraForSequenceClassification) with DataCollatorWithPadding(pad_to_multiple_of=8) and
  train_sampling_strategy="group_by_length" (group_by_length=True before transformers 5):
  the same examples (the same token ids), batch size and optimizer.

Each step is forward, loss, backward, gradient clipping at 1.0 and AdamW, with the data
loading in between (one process, no workers). The examples: single sentences and pairs of
consecutive sentences drawn from the bundled corpora (examples/corpus/demo.jsonl.gz and
tests/fixtures/text), split by the preprocessing's sentence splitter and tokenised by a
sentencepiece model trained on them (8000 pieces, cached in build/bench/), cut to 128
tokens. Each task has 200 batches of examples, so that both samplers sort runs of 50
batches by length (transformers sorts "50 or the number to get 4 megabatches, whichever is
smaller"; so does --group-by-length), as on GLUE's training sets. What a step costs depends
on the lengths its batch drew, so the two dynamic paths are timed over 50 steps each: the
Trainer over its first run of 50 batches (its steps 1-50; step 0, the longest batch by
construction, and the optimizer's first step are left out), ours over 50 consecutive steps
of its stream, whose batches are shuffled across the epoch (any 50 are a fair sample); the
padded path, whose every step has the same shape, over --steps steps. Goals: ours >= 2.5x
our padded path on single sentences, >= 1.0x the Trainer. The paths run alternately
(A B C A B C ...); the median of the per-repeat ratios is reported.

    python -m benchmarks.bench_finetune [--threads 1 --clock cpu] [--repeats 3]   # ~2.5 CPU-min a repeat
    python -m benchmarks.bench_finetune --vs-pretraining   # also fine-tuning / pretraining
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from benchmarks.harness.paths import BENCH_OUT, BUNDLED_CORPUS, REPO
from benchmarks.harness.timing import add_common_args, ratio_row, report, setup, sync, time_steps
from megatron_taco.models.finetune import TaskModel
from megatron_taco.models.sas.config import SasConfig
from megatron_taco.parallel.state import single_process_state
from megatron_taco.recipes.finetune import LENGTH_GROUP_BATCHES

CORPORA = (
    BUNDLED_CORPUS,
    os.path.join(REPO, "tests", "fixtures", "text", "botchan_excerpt.txt"),
)
PIECES = 8000
GOAL_PADDED = 2.5  # ours dynamic / ours padded, single sentences
GOAL_TRAINER = 1.0  # ours dynamic / transformers' Trainer


def corpus_sentences() -> list[str]:
    from megatron_taco.preprocessing.text import make_sentence_splitter

    texts = []
    for path in CORPORA:
        if path.endswith(".gz"):
            with gzip.open(path, "rt", encoding="utf-8") as f:
                texts += [json.loads(line)["text"] for line in f]
        else:
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
    splitter = make_sentence_splitter("blingfire")
    return [s for doc in splitter.split_many(texts) for s in doc if len(s.split()) >= 2]


def tokenizer_model(sentences: list[str], out_dir: str) -> str:
    from megatron_taco.cli.train_tokenizer import TrainTokenizerConfig, train_tokenizer

    prefix = os.path.join(out_dir, f"finetune_bench_spm{PIECES}")
    if os.path.isfile(prefix + ".model"):
        return prefix + ".model"
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
        f.write("\n".join(sentences))
    try:
        config = TrainTokenizerConfig(input=(f.name,), model_prefix=prefix, vocab_size=PIECES,
                                      num_threads=1)  # fmt: skip
        return train_tokenizer(config)
    finally:
        os.unlink(f.name)


def task_features(sentences, tokenizer, n: int, pairs: bool, seq: int, seed: int):
    """n examples (random consecutive sentence pairs with ``pairs``), labels 0/1, as the GLUE
    reader builds them: [CLS] a [SEP] (b [SEP]), longest-first truncation to ``seq``."""
    from megatron_taco.tasks.glue import Examples, featurize

    rng = np.random.default_rng(seed)
    starts = rng.choice(len(sentences) - 1, size=n, replace=False)
    a = [sentences[i] for i in starts]
    b = [sentences[i + 1] for i in starts] if pairs else None
    examples = Examples(a, b, rng.integers(0, 2, n).astype(np.int64), ["corpus"])
    features, _ = featurize(examples, tokenizer, seq)
    return features


class OurPath:
    """The recipe's data path into a training step; ``run(k)`` does k steps, continuing the
    example stream where the last call stopped."""

    def __init__(self, model, features, batch: int, dynamic: bool, seed: int = 0):
        from megatron_taco.recipes.finetune import EpochShuffled
        from megatron_taco.tasks.base import Collate, row_lengths

        per_epoch = len(features) - len(features) % batch
        lengths = row_lengths(features) if dynamic else None
        self.stream = EpochShuffled(features, per_epoch, 1000, seed, lengths=lengths,
                                    global_batch_size=batch)  # fmt: skip
        self.collate, self.batch, self.model = Collate(dynamic=dynamic), batch, model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        self.consumed, self.tokens, self.examples = 0, 0, 0
        self._iter = None

    def _next(self) -> dict:
        from megatron_taco.data.sampler import PretrainingSampler

        if self._iter is None:
            sampler = PretrainingSampler(len(self.stream), self.consumed, self.batch, 0, 1)
            loader = torch.utils.data.DataLoader(
                self.stream, batch_sampler=sampler, collate_fn=self.collate, num_workers=0
            )
            self._iter = iter(loader)
        self.consumed += self.batch
        return next(self._iter)

    def seconds_per_example(self, steps: int, clock: str) -> float:
        """Over the next ``steps`` steps of the stream."""
        now = time.process_time if clock == "cpu" else time.perf_counter
        start = now()
        for _ in range(steps):
            self.step()
        return (now() - start) / (steps * self.batch)

    def step(self) -> None:
        batch = self._next()
        self.tokens += batch["input_ids"].numel()
        self.examples += len(batch["input_ids"])
        self.model(batch)["loss"].backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class TrainerPath:
    """transformers' Trainer: each ``seconds_per_example(steps, clock)`` call trains
    steps + 1 steps from the start of an epoch and times steps 1..steps."""

    def __init__(self, features, batch: int, vocab_size: int, tokenizer_path: str, out: str):
        import transformers
        from transformers import (
            DataCollatorWithPadding,
            ElectraConfig,
            ElectraForSequenceClassification,
            PreTrainedTokenizerFast,
        )

        from megatron_taco.cli.export_hf import hf_tokenizer

        torch.manual_seed(0)
        config = ElectraConfig(vocab_size=vocab_size, embedding_size=128, hidden_size=256,
                               num_hidden_layers=12, num_attention_heads=4,
                               intermediate_size=1024, max_position_embeddings=512,
                               num_labels=2)  # fmt: skip
        self.model = ElectraForSequenceClassification(config)
        tok = PreTrainedTokenizerFast(tokenizer_object=hf_tokenizer(tokenizer_path),
                                      pad_token="[PAD]")  # fmt: skip
        # The same token ids, unpadded: the collator pads each batch.
        rows = []
        for i in range(len(features)):
            n = int(features.lengths[i])
            ids = features.input_ids[i, :n].astype(np.int64).tolist()
            rows.append({"input_ids": ids, "attention_mask": [1] * n,
                         "labels": int(features.targets["labels"][i])})  # fmt: skip
        self.dataset, self.batch, self.out = rows, batch, out
        self.collator = DataCollatorWithPadding(tok, pad_to_multiple_of=8)
        self.transformers = transformers

    def seconds_per_example(self, steps: int, clock: str) -> float:
        now = time.process_time if clock == "cpu" else time.perf_counter
        marks = {}

        class Timer(self.transformers.TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                if state.global_step == 1:
                    marks["start"] = now()

            def on_step_end(self, args, state, control, **kw):
                if state.global_step == steps + 1:
                    marks["end"] = now()

        args = self.transformers.TrainingArguments(
            output_dir=self.out, per_device_train_batch_size=self.batch,
            max_steps=steps + 1, dataloader_drop_last=True, learning_rate=1e-5,
            train_sampling_strategy="group_by_length",  # transformers 5: was group_by_length=True
            max_grad_norm=1.0, optim="adamw_torch", report_to=[], save_strategy="no",
            logging_strategy="no", disable_tqdm=True, use_cpu=True,
            dataloader_num_workers=0, seed=0,
        )  # fmt: skip
        trainer = self.transformers.Trainer(
            model=self.model, args=args, train_dataset=self.dataset,
            data_collator=self.collator, callbacks=[Timer()],
        )  # fmt: skip
        trainer.train()
        return (marks["end"] - marks["start"]) / (steps * self.batch)


def dynamic_padding_rows(args, device) -> list[dict]:
    from megatron_taco.data.tokenizer import Tokenizer

    sentences = corpus_sentences()
    out_dir = BENCH_OUT
    spm = tokenizer_model(sentences, out_dir)
    tokenizer = Tokenizer(spm)
    rows = []
    examples = 4 * LENGTH_GROUP_BATCHES * args.batch  # 50-batch runs in both samplers
    window = LENGTH_GROUP_BATCHES
    for task, pairs in (("single sentences", False), ("sentence pairs", True)):
        features = task_features(sentences, tokenizer, examples, pairs, args.seq_length, 0)
        lengths = features.lengths
        print(f"{task}: {len(features)} examples, tokens per example mean {lengths.mean():.1f}, "
              f"median {np.median(lengths):.0f}, max {lengths.max()} (of {args.seq_length})")  # fmt: skip
        paths = {}
        for name, dynamic in (("ours dynamic", True), ("ours padded", False)):
            torch.manual_seed(0)
            config = SasConfig.preset("small", vocab_size=tokenizer.vocab_size)
            model = TaskModel("SAS", config, single_process_state(),
                              task_kind="classification", num_labels=2).to(device)  # fmt: skip
            paths[name] = OurPath(model, features, args.batch, dynamic)
        with tempfile.TemporaryDirectory() as tmp:
            trainer = TrainerPath(features, args.batch, tokenizer.vocab_size, spm, tmp)
            for path in paths.values():
                for _ in range(args.warmup):
                    path.step()
            times = {name: [] for name in (*paths, "Trainer")}  # seconds per example
            for _ in range(args.repeats):  # interleaved: A B C A B C ...
                sync(device)
                ours = paths["ours dynamic"].seconds_per_example(window, args.clock)
                times["ours dynamic"].append(ours)
                step = time_steps(paths["ours padded"].step, args.steps, device, args.clock)
                times["ours padded"].append(step / args.batch)
                times["Trainer"].append(trainer.seconds_per_example(window, args.clock))
        for name, t in times.items():
            print(f"  {name:13s} {1 / statistics.median(t):8.1f} examples/s")
        dyn, pad = paths["ours dynamic"], paths["ours padded"]
        padded = (dyn.tokens / dyn.examples) / (pad.tokens / pad.examples)
        what = f"{task}, batch {args.batch}, SAS-small vs ELECTRA-small"
        rows.append(ratio_row(f"{task}: ours dynamic / ours padded examples/s",
                              times["ours padded"], times["ours dynamic"],
                              GOAL_PADDED if not pairs else None, ">=",
                              f"{what}; our batches hold {padded:.0%} of the padded tokens"))  # fmt: skip
        rows.append(ratio_row(f"{task}: ours dynamic / transformers Trainer examples/s",
                              times["Trainer"], times["ours dynamic"], GOAL_TRAINER, ">=",
                              what))  # fmt: skip
    return rows


def pretraining_rows(args, device) -> list[dict]:
    """Fine-tuning step throughput against pretraining's, same small model and batch x
    --seq-length (goal >= 0.9x, in sequences/s; TACO's pretraining sample is two rows)."""
    from benchmarks.harness.batches import sas_batch, taco_batch
    from megatron_taco.models.sas.model import SasForPretraining
    from megatron_taco.models.taco.config import TacoConfig
    from megatron_taco.models.taco.model import TacoForPretraining

    vocab, b, s = 30522, args.batch, args.seq_length
    g = torch.Generator().manual_seed(0)
    ft_batch = {"input_ids": torch.randint(5, vocab, (b, s), generator=g),
                "attention_mask": torch.ones(b, s, dtype=torch.bool),
                "labels": torch.randint(0, 3, (b,), generator=g)}  # fmt: skip
    ft_batch = {k: v.to(device) for k, v in ft_batch.items()}

    def train_step(model, batch):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step():
            model(batch)["loss"].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    rows = []
    for kind in ("TACO", "SAS"):
        torch.manual_seed(0)
        if kind == "TACO":
            config = TacoConfig.preset("small", vocab_size=vocab)
            pre = TacoForPretraining(config, single_process_state()).to(device)
            pre_batch = taco_batch(2 * b, s, vocab, config.max_position_embeddings, g, device)
            pre_rows = 2 * b
        else:
            config = SasConfig.preset("small", vocab_size=vocab)
            pre = SasForPretraining(config, single_process_state()).to(device)
            pre_batch = {k: v.to(device) for k, v in sas_batch(b, s, g).items()}
            pre_rows = b
        ft = TaskModel(kind, config, single_process_state(), task_kind="classification",
                       num_labels=3).to(device)  # fmt: skip
        steps = {"pretrain": train_step(pre, pre_batch), "finetune": train_step(ft, ft_batch)}
        for step in steps.values():
            step()
        times = {name: [] for name in steps}
        for _ in range(args.repeats):
            for name, step in steps.items():
                times[name].append(time_steps(step, args.steps, device, args.clock))
        # sequences/s ratio = (b / t_ft) / (pre_rows / t_pre)
        rows.append(ratio_row(f"{kind}-small finetune / pretrain sequences/s",
                              [t * b / pre_rows for t in times["pretrain"]], times["finetune"],
                              0.9, ">=", f"batch {b} x seq {s}, classification head"))  # fmt: skip
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_finetune",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--batch", type=int, default=16, help="Examples per step.")
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--vs-pretraining", action="store_true",
                        help="Also fine-tuning against pretraining step throughput.")  # fmt: skip
    add_common_args(parser, repeats=2, steps=3, warmup=1)
    args = parser.parse_args(argv)
    device = setup(args)
    rows = dynamic_padding_rows(args, device)
    if args.vs_pretraining:
        rows += pretraining_rows(args, device)
    report(args, "bench_finetune.py", rows, f"batch {args.batch}, seq {args.seq_length}")


if __name__ == "__main__":
    main()
