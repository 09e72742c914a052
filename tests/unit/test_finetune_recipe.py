"""The fine-tuning recipe's data path and evaluation (recipes/finetune.py, finetune_eval.py,
tasks/base.Collate), against independent references in float64:

* dynamic padding: the logits of batches cut to their longest feature equal those of the
  same features padded to --seq-length (TACO, SAS, SAS^DA under every head): attention
  masks and position handling hide the padding exactly;
* the dev evaluation runs features sorted by length and puts the outputs back in feature
  order: they equal the model run on each feature alone;
* --group-by-length: every epoch still visits its own permutation, batches hold similar
  lengths, and the stream is a function of (seed, position) only (what resumption needs);
* the task model's TACO encoding is the pretraining TacoModel's on the same tokens at the
  positions the pretraining collator gives real tokens;
* DevEvaluation chooses MNLI's epoch on matched accuracy, not mismatched.
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_taco.models.finetune import TaskModel, encoder_state_from_pretraining
from megatron_taco.parallel.state import single_process_state
from megatron_taco.recipes.finetune import EpochShuffled, finetune_collate, for_run
from megatron_taco.recipes.finetune_eval import DevEvaluation, predict
from megatron_taco.tasks import TASKS
from megatron_taco.tasks.base import Collate, row_lengths
from megatron_taco.training.configure import build_parser
from tests.helpers import FINETUNE_ENCODERS as ENCODERS
from tests.helpers import FINETUNE_HEADS as HEADS
from tests.helpers import FINETUNE_SEQ as SEQ
from tests.helpers import VOCAB, EngineLike, tiny_config
from tests.helpers import finetune_features as _features
from tests.helpers import finetune_model as _model

RTOL = 1e-10


def _close(ours, theirs, what, rtol=RTOL):
    ours, theirs = torch.as_tensor(ours).double(), torch.as_tensor(theirs).double()
    scale = theirs.abs().max().item()
    err = (ours - theirs).abs().max().item()
    assert err <= rtol * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g}"


def _outputs(model, batch) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        out = model(batch)
    return {k: v for k, v in out.items() if k in ("logits", "predictions", "start_logits")}


# ---------------------------------------------------------------------------------------
# Dynamic padding


@pytest.mark.parametrize("task_kind", list(HEADS))
@pytest.mark.parametrize("encoder", list(ENCODERS))
def test_dynamic_padding_gives_the_logits_of_padding_to_seq_length(encoder, task_kind):
    features = _features(task_kind)
    model = _model(encoder, task_kind)
    for rows in ([0, 1, 2, 3], [4, 5, 6], [7, 8, 9, 10]):
        items = [features[i] for i in rows]
        full, cut = Collate(dynamic=False)(items), Collate()(items)
        longest = int(np.max(features.lengths[rows]))
        width = cut["input_ids"].shape[-1]
        assert full["input_ids"].shape[-1] == SEQ
        assert width % 8 == 0 and longest <= width < longest + 8, (width, longest)
        assert cut["attention_mask"].shape == cut["input_ids"].shape
        a, b = _outputs(model, full), _outputs(model, cut)
        for key in a:
            if key == "start_logits":  # [b, s]: the real tokens' logits, padding at the floor
                real = cut["attention_mask"]
                _close(b[key][real], a[key][:, :width][real], f"{encoder} {task_kind} {key}")
                lowest = torch.finfo(a[key].dtype).min
                assert (a[key][~full["attention_mask"]] == lowest).all()
                assert (b[key][~real] == lowest).all()
            else:
                _close(b[key], a[key], f"{encoder} {task_kind} {key}")


def test_collate_keeps_full_length_when_every_row_fills_it():
    features = _features("classification")
    features.lengths[:] = SEQ
    batch = Collate()([features[i] for i in range(3)])
    assert batch["input_ids"].shape == (3, SEQ) and batch["labels"].shape == (3,)


def _trainer(model) -> SimpleNamespace:
    return SimpleNamespace(parallel=single_process_state(), model_engine=EngineLike(model))


class _Recording(EngineLike):
    """The engine of predict(), noting which features each micro-batch held and its width."""

    def __init__(self, model):
        super().__init__(model)
        self.rows, self.widths = [], []

    def forward(self, batch):
        self.rows.append(batch["index"].numpy())
        self.widths.append(batch["input_ids"].shape[-1])
        return super().forward(batch)


@pytest.mark.parametrize("task_kind", ["classification", "span", "multiple_choice"])
def test_evaluation_sorts_by_length_and_returns_feature_order(task_kind):
    """predict() runs the features in order of length, in dynamically padded micro-batches,
    and returns every output in feature order: it equals the model on each feature alone,
    padded to --seq-length."""
    features = _features(task_kind, n=13, seed=3)
    model = _model("SAS^DA", task_kind, seed=2)
    engine = _Recording(model)
    trainer = SimpleNamespace(parallel=single_process_state(), model_engine=engine)
    got = predict(trainer, features, micro_batch_size=4, collate_fn=Collate())
    model.eval()  # predict() hands the model back in training mode
    # The micro-batches took the features shortest first (ties in feature order), each cut
    # to its longest feature rounded up to a multiple of 8.
    lengths = row_lengths(features)
    assert np.concatenate(engine.rows).tolist() == np.argsort(lengths, kind="stable").tolist()
    for rows, width in zip(engine.rows, engine.widths):
        assert width == min(SEQ, -(-int(lengths[rows].max()) // 8) * 8), (rows, width)
    key = "start_logits" if task_kind == "span" else "logits"
    assert got[key].shape[0] == len(features)
    for i in range(len(features)):
        alone = Collate(dynamic=False)([features[i]])
        alone = {k: v for k, v in alone.items() if not k.endswith("positions")}
        want = _outputs(model, alone)[key][0].float()  # predict gives float32
        if task_kind == "span":
            length = int(features.lengths[i])
            want = want[:length]
            assert (got[key][i, length:] <= np.finfo(np.float32).min).all()  # never a boundary
        _close(got[key][i, : len(want)], want, f"feature {i}", rtol=1e-6)


# ---------------------------------------------------------------------------------------
# --group-by-length


def _lengths(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 120, n)


def test_group_by_length_keeps_epochs_permutations_and_groups_lengths():
    n, gbs, epochs = 1037, 8, 3
    per_epoch = n - n % gbs
    lengths = _lengths(n)
    base = list(range(n))  # the stream's items are the example ids
    grouped = EpochShuffled(base, per_epoch, epochs, seed=5, lengths=lengths, global_batch_size=gbs)
    plain = EpochShuffled(base, per_epoch, epochs, seed=5)
    orders = []
    for e in range(epochs):
        got = np.array([grouped[e * per_epoch + j] for j in range(per_epoch)])
        # the same examples as the plain stream of that epoch, each once
        want = {plain[e * per_epoch + j] for j in range(per_epoch)}
        assert len(set(got.tolist())) == per_epoch and set(got.tolist()) == want
        orders.append(got)
        batches = lengths[got].reshape(-1, gbs)
        assert (np.diff(batches, axis=1) <= 0).all()  # each global batch sorted, longest first
        # padding to each micro-batch's longest: far less than in the plain order
        spread = (batches.max(1, keepdims=True) - batches).sum()
        plain_batches = lengths[[plain[e * per_epoch + j] for j in range(per_epoch)]]
        plain_spread = (plain_batches.reshape(-1, gbs).max(1, keepdims=True)
                        - plain_batches.reshape(-1, gbs)).sum()  # fmt: skip
        assert spread < 0.2 * plain_spread, (spread, plain_spread)
        # the batches are shuffled, not run longest to shortest through a whole epoch
        assert not (np.diff(batches[:, 0]) <= 0).all()
    assert not np.array_equal(orders[0], orders[1])  # epochs differ
    # A fresh stream (a resumed run, a DataLoader worker) read from the middle of an epoch
    # gives what the first one gave there.
    again = EpochShuffled(base, per_epoch, epochs, seed=5, lengths=lengths, global_batch_size=gbs)
    g = per_epoch + 300
    assert [again[i] for i in range(g, g + 40)] == orders[1][300:340].tolist()
    other = EpochShuffled(base, per_epoch, epochs, seed=6, lengths=lengths, global_batch_size=gbs)
    assert [other[i] for i in range(40)] != orders[0][:40].tolist()


def _built(tmp_path, **data_flags):
    """build_finetune's parts for a randomly initialised tiny SAS on 70 features."""
    from megatron_taco.checkpoint.config import CheckpointConfig
    from megatron_taco.parallel.config import ParallelConfig
    from megatron_taco.recipes.finetune import build_finetune
    from megatron_taco.recipes.finetune_config import (
        FinetuneConfig,
        FinetuneRecipe,
        PretrainedCheckpoint,
        TaskDataConfig,
    )
    from megatron_taco.tasks.base import TaskData
    from megatron_taco.training.config import TrainingConfig
    from megatron_taco.training.deepspeed_config import resolve_deepspeed_config
    from megatron_taco.training.spec import BuildContext, RunConfigs
    from tests.helpers import tiny_sas_config

    training = TrainingConfig(train_epochs=2, micro_batch_size=4, global_batch_size=8)
    cfg = RunConfigs(
        parallel=ParallelConfig(),
        model=tiny_sas_config(),
        data=TaskDataConfig(task="sst2", data_dir=str(tmp_path), seq_length=SEQ, **data_flags),
        recipe=FinetuneRecipe(
            FinetuneConfig(load="ckpt", output=str(tmp_path), random_init=True),
            PretrainedCheckpoint(load="ckpt", iteration=1, model="SAS"),
        ),
        training=training,
        checkpoint=CheckpointConfig(),
        deepspeed=resolve_deepspeed_config(training, 1, device_type="cpu"),
        world_size=1,
        device_type="cpu",
    )  # fmt: skip
    features = _features("classification", n=70)
    features.targets["labels"] %= 2
    task = TaskData(info=TASKS["sst2"], train=features, dev={"dev": features}, stats={},
                    scorer=None)  # fmt: skip
    ctx = BuildContext(configs=cfg, model_config=tiny_sas_config(),
                       parallel=single_process_state(), rng_tracker=None, tokenizer=None,
                       seed=1)  # fmt: skip
    return build_finetune(ctx, task), row_lengths(features)


def test_the_run_reads_what_its_flags_say(tmp_path):
    """--group-by-length and dynamic padding reach the run's stream, collate and dev
    evaluation (a resumed run only shows that the stream is deterministic, not grouped)."""
    parts, lengths = _built(tmp_path, group_by_length=True)
    (evaluation,) = parts.callbacks
    # The tasks' collator, wrapped to count on the host what the forward needs there.
    assert parts.collate_fn == finetune_collate(dynamic=True) == evaluation.collate_fn
    assert parts.collate_fn.collate == Collate()
    assert parts.samples_per_epoch == 64 and len(parts.train_dataset) == 128
    rows = np.array([parts.train_dataset[g]["index"] for g in range(128)]).reshape(-1, 8)
    assert (np.diff(lengths[rows], axis=1) <= 0).all()  # every global batch longest first
    assert parts.tokens_per_sample == 0  # a tokens/s from --seq-length would be false
    parts, _ = _built(tmp_path, pad_to_seq_length=True)
    assert parts.collate_fn == finetune_collate(dynamic=False) == parts.callbacks[0].collate_fn
    assert parts.tokens_per_sample == SEQ
    rows = np.array([parts.train_dataset[g]["index"] for g in range(128)]).reshape(-1, 8)
    assert not (np.diff(lengths[rows], axis=1) <= 0).all()  # the plain shuffled order


def test_group_by_length_needs_whole_global_batches():
    with pytest.raises(ValueError, match="multiple of the global batch size"):
        EpochShuffled(list(range(20)), 18, 1, seed=0, lengths=_lengths(20), global_batch_size=4)


# ---------------------------------------------------------------------------------------
# TACO's encoding: the pretraining model's


def test_taco_task_encoding_is_the_pretraining_models():
    """The task model feeds TacoModel what pretraining fed it for real tokens: the tokens at
    the positions the pretraining collator gives them (its MLM rows' true positions). A
    shift of those positions (1..s instead of 0..s-1) changes every vector."""
    from megatron_taco.data.taco_collator import TacoMaskingCollator
    from megatron_taco.models.taco.model import TacoForPretraining

    config = dataclasses.replace(tiny_config(), hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    pretraining = TacoForPretraining(config, single_process_state()).double().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in pretraining.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    model = TaskModel("TACO", config, single_process_state(), task_kind="classification",
                      num_labels=2).double().eval()  # fmt: skip
    model.encoder.load_state_dict(
        encoder_state_from_pretraining("TACO", pretraining.state_dict()), strict=True
    )
    s, rng = 32, np.random.default_rng(2)
    samples = []
    for index, length in enumerate((32, 21, 9)):
        tokens = np.zeros(s, dtype=np.int64)
        tokens[:length] = rng.integers(5, VOCAB, length)
        tokens[[0, length - 1]] = [2, 3]
        special = np.arange(s) >= length - 1
        special[0] = True
        samples.append({"tokens": tokens, "length": length, "word_starts": ~special | special,
                        "special": special, "index": index})  # fmt: skip
    collator = TacoMaskingCollator(mask_id=4, pad_id=0, vocab_size=VOCAB, seq_length=s, seed=0,
                                   num_positions=config.max_position_embeddings)  # fmt: skip
    batch = collator(samples)
    b = len(samples)
    ids, mask = batch["input_ids"][b:], batch["attention_mask"][b:]  # the true tokens
    positions = batch["position_ids"][:b]  # the true positions (MLM rows)
    with torch.no_grad():
        we, pe = pretraining.taco(ids, positions, mask)
        ours = model.encode(ids, mask)
    want = torch.cat([we, pe], -1)
    for r in range(b):
        n = int(mask[r].sum())
        _close(ours[r, :n], want[r, :n], f"row {r}")


# ---------------------------------------------------------------------------------------
# DevEvaluation's choice


MNLI_DEV_HEADER = (
    "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
    "sentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tlabel2\tlabel3\tlabel4\t"
    "label5\tgold_label"
)
LABELS = ("entailment", "neutral", "contradiction")


def _write_mnli_dev(folder, split: str, pairs) -> None:
    lines = [MNLI_DEV_HEADER] + [
        "\t".join(
            [
                str(i),
                "1",
                f"{i}e",
                "fiction",
                "( a )",
                "( b )",
                "(ROOT a)",
                "(ROOT b)",
                a,
                b,
                *[label] * 5,
                label,
            ]
        )  # fmt: skip
        for i, (a, b, label) in enumerate(pairs)
    ]
    (folder / f"{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")


class _TableModel(torch.nn.Module):
    """Stands in for the fine-tuned model: at ``epoch`` it gives each dev feature (known by
    its tokens) the logits the test chose for it."""

    def __init__(self, table):
        super().__init__()
        self.table, self.epoch = table, 0

    def forward(self, batch):
        rows = [tuple(ids[m].tolist()) for ids, m in zip(batch["input_ids"],
                                                         batch["attention_mask"])]  # fmt: skip
        return {"logits": torch.stack([self.table[self.epoch][r] for r in rows])}


def _write_mnli_test(path, texts) -> None:
    header = MNLI_DEV_HEADER.rsplit("\tlabel1", 1)[0]  # no labels
    rows = ["\t".join([str(i), "1", f"{i}e", "fiction", "( a )", "( b )", "(ROOT a)",
                       "(ROOT b)", a, b]) for i, (a, b) in enumerate(texts)]  # fmt: skip
    path.write_text("\n".join([header, *rows]) + "\n", encoding="utf-8")


def test_mnli_epoch_is_chosen_on_matched_accuracy(tmp_path, tokenizer):
    """Matched accuracy peaks at epoch 2, mismatched at epoch 3: the run reports epoch 2 with
    both of its splits' scores (choosing on mismatched would report epoch 3), and its GLUE
    server files (MNLI-m, MNLI-mm, AX) are epoch 2's predictions, although epoch 3 ran after."""
    from megatron_taco.tasks import load_task

    words = ("red", "green", "blue", "small", "large", "old", "new", "warm")
    matched = [(f"the {w} house", f"a {w} door", LABELS[i % 3]) for i, w in enumerate(words)]
    mismatched = [(f"my {w} car is here", f"your {w} boat", LABELS[(i + 1) % 3])
                  for i, w in enumerate(words)]  # fmt: skip
    folder = tmp_path / "MNLI"
    folder.mkdir()
    _write_mnli_dev(folder, "dev_matched", matched)
    _write_mnli_dev(folder, "dev_mismatched", mismatched)
    tests = {"test_matched": [("one pear", "a pear")], "test_mismatched": [("two figs", "figs")],
             "diagnostic": [("three plums ripen", "plums"), ("no limes", "limes")]}  # fmt: skip
    _write_mnli_test(folder / "test_matched.tsv", tests["test_matched"])
    _write_mnli_test(folder / "test_mismatched.tsv", tests["test_mismatched"])
    (tmp_path / "diagnostic").mkdir()
    (tmp_path / "diagnostic" / "diagnostic.tsv").write_text(
        "index\tsentence1\tsentence2\n0\tthree plums ripen\tplums\n1\tno limes\tlimes\n"
    )
    data = load_task("mnli", folder, tokenizer, seq_length=32,
                     splits=("dev_matched", "dev_mismatched", *TASKS["mnli"].test_splits))  # fmt: skip
    right = {"dev_matched": (2, 6, 4), "dev_mismatched": (5, 3, 8)}  # correct rows per epoch
    table = [{}, {}, {}]
    for split, dataset in data.dev.items():
        for i in range(len(dataset)):
            item = dataset[i]
            key = tuple(item["input_ids"][item["attention_mask"]].tolist())
            gold = int(item["labels"])
            for epoch in range(3):
                label = gold if i < right[split][epoch] else (gold + 1) % 3
                table[epoch][key] = torch.nn.functional.one_hot(torch.tensor(label), 3).float()
    for dataset in data.test.values():  # the test sets: label LABELS[epoch] at every epoch
        for i in range(len(dataset)):
            item = dataset[i]
            key = tuple(item["input_ids"][item["attention_mask"]].tolist())
            for epoch in range(3):
                table[epoch][key] = torch.nn.functional.one_hot(torch.tensor(epoch), 3).float()
    model = _TableModel(table)
    logged = []
    trainer = SimpleNamespace(
        parallel=single_process_state(),
        model_engine=EngineLike(model),
        logger=SimpleNamespace(log=lambda split, it, values: logged.append((split, values))),
        num_epochs=lambda: 3,
    )
    evaluation = DevEvaluation(data, output=str(folder), selection="best",
                               save_every_epoch=False, micro_batch_size=3,
                               summary={"task": "mnli"})  # fmt: skip
    for epoch in range(3):
        model.epoch = epoch
        evaluation.on_epoch_end(trainer, SimpleNamespace(iteration=10 * (epoch + 1)), epoch)
    results = json.loads((folder / "results.json").read_text())
    assert [e["dev_matched/acc"] for e in results["epochs"]] == [25.0, 75.0, 50.0]
    assert [e["dev_mismatched/acc"] for e in results["epochs"]] == [62.5, 37.5, 100.0]
    assert results["finished"] and results["chosen_epoch"] == 2
    assert results["dev"] == {"dev_matched/acc": 75.0, "dev_mismatched/acc": 37.5}
    assert results["main_split"] == "dev_matched"
    assert [s for s, _ in logged] == ["dev_matched", "dev_mismatched"] * 3
    files = {"test_matched": "MNLI-m.tsv", "test_mismatched": "MNLI-mm.tsv",
             "diagnostic": "AX.tsv"}  # fmt: skip
    assert results["submission"] == {"directory": "submission", "epoch": 2,
                                     "files": list(files.values())}  # fmt: skip
    for split, name in files.items():
        rows = [f"{i}\tneutral" for i in range(len(tests[split]))]  # epoch 2's label
        text = (folder / "submission" / name).read_text()
        assert text == "\n".join(["index\tprediction", *rows]) + "\n"


# ---------------------------------------------------------------------------------------
# --predict-test given to a run that chose its epoch without it


def test_predict_test_is_refused_where_the_chosen_epoch_ran_without_it(tmp_path):
    """The run's chosen epoch has no test files and a resumed run cannot go back to its
    model: one line before anything runs, not a run that ends without its submission."""
    from megatron_taco.errors import ConfigError
    from megatron_taco.recipes.finetune import SPEC
    from megatron_taco.recipes.finetune_output import check_test_predictable

    def command(results=None):  # what for_run reads of the command and the run's folder
        out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        if results is not None:
            (out / "results.json").write_text(json.dumps(
                {"task": "sst2", "main_metric": "acc", "dev": {}, "hyperparameters": {},
                 "selection": "best", "finished": True, "chosen_epoch": 2, **results}))  # fmt: skip
        cfg = SimpleNamespace(
            data=SimpleNamespace(predict_test=True, data_dir="SST-2"),
            deepspeed=SimpleNamespace(global_batch_size=2),
            recipe=SimpleNamespace(finetune=SimpleNamespace(output=str(out))),
        )
        return cfg, SimpleNamespace(info=TASKS["sst2"], train=[0] * 4)

    refused = r"^--predict-test: .*run\d chose epoch 2 before --predict-test was given"
    with pytest.raises(ConfigError, match=refused):
        for_run(SPEC, *command({}))
    with pytest.raises(ConfigError, match=refused):  # unfinished: epoch 2 may stay the best
        for_run(SPEC, *command({"finished": False, "submission": {"epoch": 1}}))
    # Accepted: the chosen epoch's files written, a later epoch sure to be chosen, a new run.
    for results in ({"submission": {"epoch": 2, "files": ["SST-2.tsv"]}},
                    {"selection": "last", "finished": False}, None):  # fmt: skip
        cfg, _ = command(results)
        check_test_predictable(cfg.recipe.finetune.output)


def test_task_help_lists_every_task_and_the_parser_takes_megatrons_precision_flags():
    from megatron_taco.recipes.finetune import SPEC

    parser = build_parser(SPEC)
    text = " ".join(parser.format_help().split())
    assert all(name in text for name in TASKS), text  # it used to say "(tasks.TASKS)"
    args = parser.parse_args(["--load", "x", "--task", "cola", "--data-dir", "d", "--bf16"])
    assert args.bf16 and not args.fp16
    # Sample-based training is pretraining's: fine-tuning counts epochs.
    with pytest.raises(SystemExit):
        parser.parse_args(["--load", "x", "--task", "cola", "--train-samples", "100"])


def test_a_run_started_before_the_checkpoint_flags_moved_still_resumes(tmp_path):
    """run.json of a run interrupted before issue 35 lists --save, --load, --finetune...
    under "training"; the same command after it records them nowhere (this recipe sets
    them): it resumes, and a real difference is still refused."""
    from megatron_taco.errors import ConfigError
    from megatron_taco.recipes.finetune_output import RUN_FILE, claim_output

    now = {"training": {"lr": 1e-4, "train_epochs": 3}, "data": {"task": "sst2"}}
    before = {
        "training": {**now["training"], "save": "o/checkpoints", "load": "o/checkpoints",
                     "save_interval": None, "ckpt_step": None, "finetune": False,
                     "no_load_optim": False, "no_load_rng": False},
        "data": now["data"],
    }  # fmt: skip
    (tmp_path / RUN_FILE).write_text(json.dumps(before))
    claim_output(str(tmp_path), now, write=False)
    other = {**now, "training": {**now["training"], "lr": 2e-4}}
    with pytest.raises(ConfigError, match=r"training\.lr: 0\.0001 before, 0\.0002 now"):
        claim_output(str(tmp_path), other, write=False)
