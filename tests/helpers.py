"""What several test files share: real gloo process groups (run_distributed, from
tests/processes.py), tiny model configs and batches, the real launchers' commands, and the
metric keys each model logs. Test files import from here, never from each other."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_taco.models.taco.config import TacoConfig
from megatron_taco.models.taco.model import TacoForPretraining
from megatron_taco.parallel.cross_entropy import vocab_parallel_argmax
from megatron_taco.parallel.state import single_process_state
from megatron_taco.training.observability.log import read_metrics
from tests.processes import BIN as BIN
from tests.processes import ENV as ENV
from tests.processes import REPO as REPO
from tests.processes import deepspeed as deepspeed
from tests.processes import deepspeed_command as deepspeed_command
from tests.processes import free_port as free_port
from tests.processes import kill_session as kill_session
from tests.processes import kill_when as kill_when
from tests.processes import launch as launch
from tests.processes import run as run
from tests.processes import run_distributed as run_distributed
from tests.processes import run_in_process as run_in_process

TACO_METRIC_KEYS = (
    "loss",
    "mlm_loss",
    "mpm_loss",
    "mlm_acc",
    "mpm_acc",
    "mlm_tokens",
    "mpm_tokens",
)
VOCAB = 97
SEQ = 32

# ---------------------------------------------------------------------------------------
# Versions


def needs_version(package: str, minimum: str, why: str):
    """A skipif mark for a test that fails with ``package`` older than ``minimum`` (the lent
    GPU nodes' stack is older than this repository's; docs/gpus.md), giving the reason."""
    import importlib.metadata

    import pytest
    from packaging.version import Version

    have = importlib.metadata.version(package)
    return pytest.mark.skipif(
        Version(Version(have).public) < Version(minimum),
        reason=f"needs {package} >= {minimum} (here {have}): {why}",
    )


# ---------------------------------------------------------------------------------------
# GPUs (tests/gpu)


def cuda_missing() -> str | None:
    """Why the GPU tier cannot run here, or None."""
    if torch.cuda.is_available():
        return None
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return f"needs a CUDA GPU: torch {torch.__version__} ({build}) sees none"


def require_gpus(n: int) -> None:
    """Skip the calling test, with the reason, on a machine with fewer than n GPUs."""
    import pytest

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < n:
        pytest.skip(f"needs {n} CUDA GPU(s), this machine has {count}")


# ---------------------------------------------------------------------------------------
# Numerics


class ScatterDtypes(TorchDispatchMode):
    """Records the dtype of every scatter_add the code runs: the accumulation dtype of the
    relative-position row sums, which CPU kernels do not show in the values (they accumulate
    a bf16 scatter_add_ in float32 whatever the output dtype; CUDA's bf16 atomics do not)."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.scatter_add_, torch.ops.aten.scatter_add):
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------------------
# TACO


def tiny_config(**overrides) -> TacoConfig:
    return TacoConfig.preset("tiny", vocab_size=VOCAB, **overrides)


def make_batch(
    b: int = 2, s: int = SEQ, seed: int = 0, vocab: int = VOCAB
) -> dict[str, torch.Tensor]:
    """A TACO batch as the collator builds it: rows [0, b) masked tokens + true positions,
    rows [b, 2b) true tokens + masked positions (-1, a shuffled span), some padding."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(5, vocab, (b, s), generator=g)
    lengths = [s - 3 * i for i in range(b)]
    ids = torch.cat([tokens, tokens]).clone()
    pos = torch.arange(s).repeat(2 * b, 1)
    mask = torch.zeros(2 * b, s, dtype=torch.bool)
    mlm = torch.full((2 * b, s), -100)
    mpm = torch.full((2 * b, s), -100)
    for r in range(b):
        n = lengths[r]
        mask[r, :n] = mask[b + r, :n] = True
        ids[r, n:] = ids[b + r, n:] = 0
        pos[r, n:] = pos[b + r, n:] = 0
        sel = torch.randperm(n - 2, generator=g)[:5] + 1
        mlm[r, sel] = tokens[r, sel]
        ids[r, sel] = 4  # [MASK]
        sel = torch.randperm(n - 2, generator=g)[:6] + 1
        mpm[b + r, sel] = pos[b + r, sel]
        pos[b + r, sel[:4]] = -1  # masked positions
        pos[b + r, sel[4:]] = pos[b + r, sel[4:]].flip(0)  # a shuffled pair
    return dict(
        input_ids=ids, position_ids=pos, attention_mask=mask, mlm_labels=mlm, mpm_labels=mpm
    )


def build(config: TacoConfig, seed: int = 0) -> TacoForPretraining:
    torch.manual_seed(seed)
    return TacoForPretraining(config, single_process_state())


# ---------------------------------------------------------------------------------------
# SAS

SAS_METRIC_KEYS = (
    "loss",
    "mlm_loss",
    "rtd_loss",
    "rtd_weight",
    "mlm_acc",
    "rtd_acc",
    "rtd_acc_replaced",
    "rtd_acc_original",
    "replaced_share",
    "mlm_tokens",
    "rtd_tokens",
)
SAS_SEQ = 24


def tiny_sas_config(**overrides):
    from megatron_taco.models.sas.config import SasConfig

    return SasConfig.preset("tiny", vocab_size=VOCAB, **overrides)


def make_sas_batch(
    b: int = 2, s: int = SAS_SEQ, seed: int = 0, vocab: int = VOCAB
) -> dict[str, torch.Tensor]:
    """A SAS batch as its collator builds it: ~15% of each row's real tokens (never
    position 0, the [CLS]) replaced by random tokens, one replacement per row equal to the
    original (a "hit", RTD label 0), rows padded with id 0 to lengths s, s-5, s-10, ..."""
    from megatron_taco.models.sas.model import rtd_labels

    g = torch.Generator().manual_seed(seed)
    original = torch.randint(5, vocab, (b, s), generator=g)
    mask = torch.zeros(b, s, dtype=torch.bool)
    ids = original.clone()
    mlm = torch.full((b, s), -100)
    for r in range(b):
        n = s - 5 * r
        mask[r, :n] = True
        ids[r, n:] = 0
        chosen = torch.randperm(n - 1, generator=g)[: max(2, round(0.15 * n))] + 1
        mlm[r, chosen] = original[r, chosen]
        ids[r, chosen] = (
            original[r, chosen] + torch.randint(1, vocab - 5, chosen.shape, generator=g) - 5
        ) % (vocab - 5) + 5
        ids[r, chosen[0]] = original[r, chosen[0]]  # a hit
    return dict(
        input_ids=ids,
        attention_mask=mask,
        mlm_labels=mlm,
        rtd_labels=rtd_labels(ids, mlm, mask),
    )


def build_sas(config, seed: int = 0, rng_tracker=None):
    from megatron_taco.models.sas.model import SasForPretraining

    torch.manual_seed(seed)
    return SasForPretraining(config, single_process_state(), rng_tracker)


# ---------------------------------------------------------------------------------------
# Tiny pretraining runs through the real Trainer and DeepSpeed engine


# Above 128: at tp=2 the vocabulary is padded to 256 and both shards hold real tokens (at 97
# rank 1's would be all padding, and its half of the vocabulary-parallel code untested).
RUN_VOCAB = 200


class TinySamples(torch.utils.data.Dataset):
    """Eight distinct [CLS] ... [SEP] samples of lengths 20..SEQ, repeated: a model memorises
    them, so the loss falls within a few steps. What TacoMaskingCollator and SasCollator
    read."""

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> dict:
        rng = np.random.default_rng(i % 8)
        length = int(rng.integers(20, SEQ + 1))
        tokens = np.zeros(SEQ, dtype=np.int64)
        tokens[0], tokens[length - 1] = 2, 3
        tokens[1 : length - 1] = rng.integers(5, RUN_VOCAB, length - 2)
        special = np.zeros(SEQ, dtype=bool)
        special[[0, length - 1]] = True
        special[length:] = True
        return {
            "tokens": tokens,
            "length": length,
            "word_starts": np.arange(SEQ) < length,
            "special": special,
            "sentence_ids": np.zeros(SEQ, dtype=np.int64),
            "index": i % 8,
        }


def _tiny_model_and_collator(model: str, parallel, tracker):
    """Tiny TACO or SAS (SAS: the paper's model, its first epoch: uniform cold-start
    replacements, no self-augmentation) and its collator, for TinySamples. Dropout off: at
    tp=2 each rank draws its heads' attention-dropout masks, which tp=1 cannot draw alike."""
    if model == "taco":
        from megatron_taco.data.taco_collator import TacoMaskingCollator

        config = tiny_config(max_position_embeddings=SEQ, max_relative_distance=SEQ - 1,
                             hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
        config = config.with_vocab_size(RUN_VOCAB)
        collator = TacoMaskingCollator(mask_id=4, pad_id=0, vocab_size=RUN_VOCAB, seq_length=SEQ,
                                       seed=3)  # fmt: skip
        return TacoForPretraining(config, parallel, tracker), collator
    from megatron_taco.data.sas_collator import (
        ReplacementConfig,
        SasCollator,
        cold_start_probs,
        make_cold_start,
    )
    from megatron_taco.models.sas.model import SasForPretraining

    config = tiny_sas_config(max_position_embeddings=SEQ, hidden_dropout=0.0,
                             attention_dropout=0.0).with_vocab_size(RUN_VOCAB)  # fmt: skip
    replacement = ReplacementConfig(cold_start="uniform")
    probs = cold_start_probs(replacement, [], [], np.arange(RUN_VOCAB) < 5)
    source = make_cold_start(replacement, probs, 3, mask_id=4)
    collator = SasCollator(pad_id=0, seq_length=SEQ, seed=3, config=replacement, source=source,
                           fixed_positions=False)  # fmt: skip
    return SasForPretraining(config, parallel, tracker), collator


def train_tiny(model: str, parallel, tmp: str, ds_file: str, *, device_type: str = "cpu",
               **training) -> tuple[Any, list[dict]]:  # fmt: skip
    """Tiny ``model`` ("taco" or "sas") on TinySamples through the real Trainer and
    DeepSpeed engine (``ds_file``: a ds_configs JSON) at ``parallel``'s tp x dp, on this
    rank's GPU with ``device_type="cuda"`` (fp32 matmuls there: no TF32). ``training``:
    TrainingConfig values over the defaults here. The model is the same full model whatever
    tp is (parallel/layers.py); masking and replacements are seeded per sample, so the
    batches depend only on the global batch. Returns (DeepSpeed engine, rank 0's logged
    records; None on the other ranks)."""
    from megatron_taco.checkpoint.layout import TrainingState
    from megatron_taco.parallel.random import model_parallel_seed
    from megatron_taco.training.config import TrainingConfig
    from megatron_taco.training.deepspeed_config import (
        load_deepspeed_json,
        resolve_deepspeed_config,
    )
    from megatron_taco.training.engine import apply_numerics, initialize_engine
    from megatron_taco.training.loop import Trainer
    from megatron_taco.training.observability.log import TrainingLogger
    from megatron_taco.training.spec import ModelParts

    values = dict(
        micro_batch_size=2, lr=3e-3, lr_warmup_iters=1, lr_decay_style="constant", log_interval=1,
        eval_iters=0, progress_bar=False, tf32=False, metrics_file=os.path.join(tmp, "run.jsonl"),
    )  # fmt: skip
    values.update(training)
    config = TrainingConfig(**values)
    apply_numerics(config)
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    tracker = model_parallel_seed(1234, parallel, device=device)
    network, collator = _tiny_model_and_collator(model, parallel, tracker)
    settings = resolve_deepspeed_config(config, parallel.dp_size, device_type=device_type,
                                        ds_json=load_deepspeed_json(ds_file))  # fmt: skip
    engine = initialize_engine(network, config, settings, parallel)
    logger = TrainingLogger(rank=parallel.rank, train_iters=config.train_iters,
                            metrics_file=config.metrics_file, progress_bar=False)  # fmt: skip
    parts = ModelParts(
        model=network, collate_fn=collator, train_dataset=TinySamples(), tokens_per_sample=SEQ
    )
    Trainer(engine, parallel, config, parts, logger, seed=3, rng_tracker=tracker).train(
        TrainingState()
    )
    logger.close()
    records = read_metrics(config.metrics_file) if parallel.rank == 0 else None
    return engine.model_engine, records


# ---------------------------------------------------------------------------------------
# What the e2e tests share


ZERO1_FP32 = "ds_configs/zero1_fp32.json"
ZERO0_BF16 = "ds_configs/zero0_bf16.json"

# The shared tiny runs: seq 64 on the Botchan dataset, micro-batch 2 x global 4, 4 iterations,
# checkpoints at 2 and 4, dropout off (runs at other layouts compute the same losses).
TINY_RUN = {
    "--model-size": "tiny",
    "--seq-length": "64",
    "--split": "80,10,10",
    "--micro-batch-size": "2",
    "--global-batch-size": "4",
    "--train-iters": "4",
    "--lr": "1e-3",
    "--lr-warmup-iters": "1",
    "--log-interval": "1",
    "--eval-iters": "0",
    "--num-workers": "0",
    "--hidden-dropout": "0",
    "--attention-dropout": "0",
    "--save-interval": "2",
}


def tiny_pretrain_args(dataset: dict, save: Path, *extra: str) -> list[str]:
    """pretrain_taco.py / pretrain_sas.py flags of a TINY_RUN on ``dataset`` into ``save``."""
    flags = {
        **TINY_RUN,
        "--data-path": dataset["prefix"],
        "--tokenizer-model": dataset["tokenizer"],
        "--data-cache-path": str(dataset["dir"] / "cache"),
        "--save": str(save),
    }
    return [x for pair in flags.items() for x in pair] + list(extra)


def demo_evaluate(loads: list, dataset: dict, output: Path) -> list[dict]:
    """examples/demo_evaluate.py on checkpoints, small (40 held-out sentences: no probes, one
    seed, one random twin); its JSON rows."""
    import json

    argv = ["--data-path", dataset["prefix"], "--sentences", "40", "--seeds", "1",
            "--random-twins", "1", "--output", str(output)]  # fmt: skip
    for load in loads:
        argv += ["--load", str(load)]
    launch("examples/demo_evaluate.py", *argv, timeout=240)
    return json.loads(Path(output).read_text())


def assert_pretrained_and_random_rows(rows: list[dict], model: str) -> None:
    """demo_evaluate's rows of one checkpoint: the same held-out batches for both (one
    baseline), different weights (the checkpoint's were loaded), figures in range."""
    pretrained, random = [r for r in rows if r["model"] == model]
    assert (pretrained["init"], random["init"]) == ("pretrained", "random x1")
    assert pretrained["baseline"] == random["baseline"] and 0 < pretrained["baseline"] < 1
    assert pretrained["collapse"] != random["collapse"]
    assert all(0 < r["collapse"] < 0.99 and len(r["zero_shot"]) == 1 for r in (pretrained, random))


def train_records(path) -> dict[int, dict]:
    return {r["iteration"]: r for r in read_metrics(str(path)) if r["split"] == "train"}


# ---------------------------------------------------------------------------------------
# Masking


def masking_sample(rng, seq_length: int = 128, min_length: int = 40, max_word: int = 3):
    """[CLS] A [SEP] B [SEP] [PAD]..., words of 1..MAX_WORD tokens."""
    length = int(rng.integers(min_length, seq_length + 1))
    sep = int(rng.integers(3, length - 3))
    tokens = np.zeros(seq_length, dtype=np.int64)
    tokens[:length] = rng.integers(100, 200, length)
    tokens[[0, sep, length - 1]] = [2, 3, 3]  # [CLS] [SEP] [SEP]
    special = np.ones(seq_length, dtype=bool)
    special[1 : length - 1] = False
    special[sep] = True
    word_starts = np.zeros(seq_length, dtype=bool)
    starts = np.cumsum(rng.integers(1, max_word + 1, seq_length))
    word_starts[starts[starts < length]] = True
    word_starts[:length] |= special[:length]
    return tokens, word_starts, special, length


# ---------------------------------------------------------------------------------------
# Tensor-parallel comparisons


def full_tensor(param: torch.Tensor, tensor: torch.Tensor, group) -> torch.Tensor:
    """``tensor`` (laid out like ``param``: its data or its grad) gathered over tp."""
    from megatron_taco.parallel.layers import gather_full_weight

    return gather_full_weight(param, group, tensor)


def assert_tensors_match(got: dict, want: dict, rtol: float, atol: float = 1e-15) -> None:
    """Per tensor: |got - want| <= rtol * max|want| + atol, elementwise; names the tensors
    that differ."""
    import numpy as np

    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    bad = []
    for name, w in want.items():
        tol = rtol * np.abs(w).max() + atol
        err = np.abs(np.asarray(got[name]) - w).max()
        if not err <= tol:
            bad.append(f"{name}: max error {err:.3g} > {tol:.3g}")
    assert not bad, "tensors differ:\n" + "\n".join(bad)


# ---------------------------------------------------------------------------------------
# Import graphs (tests/unit/test_layer_imports.py, test_recipes_imports.py)


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module ``path`` (a module of ``package``) imports, anywhere in its source (also
    inside functions): absolute names, relative imports resolved against ``package``; for
    ``from A import b`` both A and A.b (b may be a module or a name in A)."""
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # level 1 is ``package`` itself, 2 its parent, ...
                parts = package.split(".")
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found |= {base, *(f"{base}.{a.name}" for a in node.names)}
    return found


# ---------------------------------------------------------------------------------------
# Learnable synthetic downstream tasks, written in the benchmarks' own layouts


def botchan_sentences(min_words: int = 8, max_words: int = 30) -> list[str]:
    import re

    text = (REPO / "tests" / "fixtures" / "text" / "botchan_excerpt.txt").read_text("utf-8")
    text = " ".join(text.split())
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if min_words <= len(s.split()) <= max_words]


def bert_layout(pieces: list[str]) -> list[str]:
    """A WordPiece vocabulary in BERT's vocab.txt layout: [PAD], [unused0..98], then [UNK]
    [CLS] [SEP] [MASK] at 100..103 and the other pieces."""
    specials = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
    rest = [p for p in pieces if p not in specials]
    unused = [f"[unused{i}]" for i in range(99)]
    return ["[PAD]", *unused, "[UNK]", "[CLS]", "[SEP]", "[MASK]", *rest]


def _insert(words: list[str], word: str, rng) -> list[str]:
    i = int(rng.integers(1, len(words)))
    return [*words[:i], word, *words[i:]]


def write_marker_task(directory, *, dev_fraction: float = 0.25, seed: int = 0) -> dict:
    """The custom task's layout (train.tsv/dev.tsv, header "sentence<TAB>label"): every
    sentence twice, once with "happy" and once with "angry" inserted at a random place,
    labelled by the word. Learnable from the tokens alone."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for s in botchan_sentences():
        for word, label in (("happy", "pos"), ("angry", "neg")):
            rows.append((" ".join(_insert(s.split(), word, rng)), label))
    order = rng.permutation(len(rows))
    n_dev = int(len(rows) * dev_fraction)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, idx in (("dev", order[:n_dev]), ("train", order[n_dev:])):
        with open(directory / f"{name}.tsv", "w", encoding="utf-8") as f:
            f.write("sentence\tlabel\n")
            for i in idx:
                f.write(f"{rows[i][0]}\t{rows[i][1]}\n")
    return {"train": len(rows) - n_dev, "dev": n_dev}


def write_similarity_task(directory, *, seed: int = 0) -> None:
    """STS-B's GLUE layout (train.tsv/dev.tsv, header sentence1, sentence2, score): pairs of
    Botchan sentences scored 0-5 (5: the same sentence twice)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    sentences = botchan_sentences()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", sentences[:40]), ("dev", sentences[40:80])):
        with open(directory / f"{name}.tsv", "w", encoding="utf-8") as f:
            f.write("sentence1\tsentence2\tscore\n")
            for i, s in enumerate(part):
                same = i % 2 == 0
                other = s if same else part[(i + 7) % len(part)]
                f.write(f"{s}\t{other}\t{5.0 if same else rng.uniform(0, 2):.3f}\n")


_PLACES = ("Tokyo", "Kyushu", "Kamakura", "Echigo", "Azabu")
_SITES = ("school", "hotel", "garden", "house", "street")


def write_place_squad(directory, *, version: str = "v1.1", copies: int = 1, seed: int = 0) -> None:
    """SQuAD's JSON layout (train-/dev-{version}.json): a sentence with "in <place> <site>"
    inserted (e.g. "in Kamakura hotel"), "Where was it?", and "<place> <site>" as the answer
    (two words, so its end is not its start); each training sentence ``copies`` times with
    other places. v2.0: every third context has none and its question is unanswerable."""
    import json

    import numpy as np

    rng = np.random.default_rng(seed)
    sentences = botchan_sentences()
    split = int(0.75 * len(sentences))
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", sentences[:split] * copies), ("dev", sentences[split:])):
        paragraphs = []
        for i, s in enumerate(part):
            impossible = version == "v2.0" and i % 3 == 2
            answer = f"{rng.choice(_PLACES)} {rng.choice(_SITES)}"
            words = s.split()
            if not impossible:
                at = int(rng.integers(1, len(words)))
                words = [*words[:at], "in", answer, *words[at:]]
            context = " ".join(words)
            qa = {"id": f"{name}-{i}", "question": "Where was it?"}
            qa["answers"] = [] if impossible else [
                {"text": answer, "answer_start": context.index(f" in {answer}") + 4}
            ]  # fmt: skip
            if version == "v2.0":
                qa["is_impossible"] = impossible
                qa["plausible_answers"] = []
            paragraphs.append({"context": context, "qas": [qa]})
        data = {"version": version, "data": [{"title": "botchan", "paragraphs": paragraphs}]}
        with open(directory / f"{name}-{version}.json", "w", encoding="utf-8") as f:
            json.dump(data, f)


def write_place_race(directory, *, questions: int = 2, seed: int = 0) -> None:
    """RACE's layout ({train,dev,test}/{middle,high}/N.txt, one JSON object each): the article
    is a sentence with "in <place>" inserted; each of its ``questions`` asks "Where was it?"
    with the place and three other words of the article as options (learnable from the
    options: the place names are the answers)."""
    import json

    import numpy as np

    rng = np.random.default_rng(seed)
    sentences = botchan_sentences()
    cut = [int(0.7 * len(sentences)), int(0.85 * len(sentences))]
    parts = np.split(np.arange(len(sentences)), cut)
    for split, idx in zip(("train", "dev", "test"), parts):
        for n, i in enumerate(idx):
            place = str(rng.choice(_PLACES))
            words = sentences[i].split()
            at = int(rng.integers(1, len(words)))
            article = " ".join([*words[:at], "in", place, *words[at:]])
            others = sorted({w for w in words if w.isalpha() and w not in _PLACES})
            if len(others) < 3:
                continue
            options, answers = [], []
            for _ in range(questions):
                choice = [place, *(str(p) for p in rng.choice(others, 3, replace=False))]
                order = rng.permutation(4)
                options.append([choice[j] for j in order])
                answers.append("ABCD"[int(np.flatnonzero(order == 0)[0])])
            folder = Path(directory) / split / ("middle" if n % 2 else "high")
            folder.mkdir(parents=True, exist_ok=True)
            record = {
                "id": f"{split}{n}.txt",
                "article": article,
                "questions": ["Where was it?"] * questions,
                "options": options,
                "answers": answers,
            }
            (folder / f"{n}.txt").write_text(json.dumps(record), encoding="utf-8")


# Statistical tests (no scipy: the chi-square tail is torch's regularised incomplete gamma)


def chi2_pvalue(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df), i.e. scipy.stats.chi2.sf: the regularised
    upper incomplete gamma Q(df / 2, statistic / 2)."""
    a = torch.tensor(df / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(a, torch.tensor(statistic / 2.0, dtype=torch.float64)))


def chi2_goodness_of_fit(observed, expected) -> tuple[float, float]:
    """Pearson's chi-square of counts against expected counts (same total): (statistic,
    p-value with len - 1 degrees of freedom)."""
    observed = np.asarray(observed, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    statistic = float(((observed - expected) ** 2 / expected).sum())
    return statistic, chi2_pvalue(statistic, observed.size - 1)


def normal_std_pvalue(values: torch.Tensor, std: float) -> float:
    """Two-sided p-value that zero-mean ``values`` are normal(0, std^2): sum(x^2) / std^2 is
    chi-square(n) under that hypothesis."""
    x = values.detach().to(torch.float64).flatten()
    statistic = float((x * x).sum() / std**2)
    upper = chi2_pvalue(statistic, x.numel())
    return 2 * min(upper, 1 - upper)


# ---------------------------------------------------------------------------------------
# Fine-tuning

FINETUNE_SEQ = 48
FINETUNE_ENCODERS = {
    "TACO": ("TACO", tiny_config),
    "SAS": ("SAS", tiny_sas_config),
    "SAS^DA": ("SAS", lambda: tiny_sas_config(disentangled_attention=True)),
}
FINETUNE_HEADS = {"classification": 3, "regression": 1, "span": 2, "multiple_choice": 4}


def finetune_features(task_kind: str, n: int = 11, seed: int = 0):
    """[CLS] tokens [SEP] [PAD]... of lengths 5..40, padded to FINETUNE_SEQ as the task
    modules pad them."""
    from megatron_taco.tasks.base import FeatureDataset

    rng = np.random.default_rng(seed)
    shape = (n, 4) if task_kind == "multiple_choice" else (n,)
    lengths = rng.integers(5, 41, size=shape).astype(np.int32)
    ids = rng.integers(5, VOCAB, size=(*shape, FINETUNE_SEQ)).astype(np.uint16)
    ids[..., 0] = 2
    cols = np.arange(FINETUNE_SEQ)
    ids[cols >= lengths[..., None]] = 0
    np.put_along_axis(ids, (lengths - 1)[..., None].astype(np.int64), 3, axis=-1)
    if task_kind == "span":
        targets = {"start_positions": rng.integers(0, 4, n), "end_positions": rng.integers(0, 4, n)}
    elif task_kind == "regression":
        targets = {"labels": rng.uniform(0, 5, n).astype(np.float32)}
    else:
        targets = {"labels": rng.integers(0, FINETUNE_HEADS[task_kind], n)}
    return FeatureDataset(ids, lengths, targets)


def finetune_model(encoder: str, task_kind: str, seed: int = 0, vocab_size: int | None = None,
                   num_labels: int | None = None):  # fmt: skip
    from megatron_taco.models.finetune import TaskModel

    kind, make = FINETUNE_ENCODERS[encoder]
    config = make() if vocab_size is None else make().with_vocab_size(vocab_size)
    torch.manual_seed(seed)
    model = TaskModel(kind, config, single_process_state(), task_kind=task_kind,
                      num_labels=num_labels or FINETUNE_HEADS[task_kind]).double().eval()  # fmt: skip
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # every parameter far from its init, 1-D ones too
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


class EngineLike(torch.nn.Module):
    """What predict() needs of a DeepSpeed engine: forward, eval/train and .device."""

    device = torch.device("cpu")

    def __init__(self, model):
        super().__init__()
        self.module = model

    def forward(self, batch):
        return self.module(batch)


def wandb_offline_runs(directory) -> list[dict]:
    """The offline W&B runs under ``directory`` (its wandb/offline-run-*/run-<id>.wandb
    transaction logs, oldest first), read record by record: {"id", "name", "config" (key ->
    JSON text), "history" (step -> {key: value}), "images" ((step, key) of each image)}.

    The file is W&B's LevelDB-style log: a 7-byte ":W&B" header, then 32 KiB blocks of
    records (4-byte checksum, 2-byte little-endian length, 1-byte type: 1 full, 2 first,
    3 middle, 4 last) that carry wandb_internal_pb2.Record messages."""
    import json as _json

    from wandb.proto import wandb_internal_pb2 as pb

    runs = []
    for path in sorted(Path(directory).glob("wandb/offline-run-*/run-*.wandb")):
        data = path.read_bytes()
        assert data[:4] == b":W&B", path
        run: dict[str, Any] = {"id": None, "name": None, "config": {}, "history": {},
                               "images": set()}  # fmt: skip
        pos, pending, block = 7, b"", 32768
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # a block's tail too short for a header: padding
                pos += block - pos % block
                continue
            length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
            pending += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind not in (1, 4):
                continue
            record, pending = pb.Record.FromString(pending), b""
            which = record.WhichOneof("record_type")
            if which == "run":
                run["id"], run["name"] = record.run.run_id, record.run.display_name
                for item in record.run.config.update:
                    run["config"][item.key] = item.value_json
            elif which == "config":
                for item in record.config.update:
                    run["config"][item.key] = item.value_json
            elif which == "history":
                items = {(i.key or "/".join(i.nested_key)): _json.loads(i.value_json)
                         for i in record.history.item}  # fmt: skip
                step = items.pop("_step", record.history.step.num)
                # An image arrives as its fields: "<key>/_type": "image-file", "<key>/path", ...
                images = {k[: -len("/_type")] for k, v in items.items()
                          if k.endswith("/_type") and v == "image-file"}  # fmt: skip
                run["images"] |= {(step, key) for key in images}
                for key, value in items.items():
                    if not key.startswith("_") and key.rsplit("/", 1)[0] not in images:
                        run["history"].setdefault(step, {})[key] = value
        runs.append(run)
    return runs


def assert_close64(got, want, what: str, rtol: float = 1e-10) -> None:
    """float64 on both sides, the error relative to the reference's magnitude (exported
    models against ours)."""
    import torch

    assert got.dtype == want.dtype == torch.float64, what
    scale = want.abs().max().item()
    assert scale > 1e-2, f"{what}: reference too small to test ({scale})"
    err = (got - want).abs().max().item()
    assert err <= rtol * scale, f"{what}: max error {err:.3e} vs scale {scale:.3e}"


def chosen(load, ckpt_step=None, *, fallback=False, models=None, tp_size=None):
    """The iteration checkpoint.plan.plan_resume picks in --load ``load`` (None: a fresh
    start), as a run with these flags would (``tp_size``: a run of that tensor-parallel
    size, whose verification refuses another's checkpoints)."""
    from megatron_taco.checkpoint.config import CheckpointConfig
    from megatron_taco.checkpoint.plan import ResumeRequest, RunLayout, plan_resume

    checkpoint = CheckpointConfig(load=str(load), ckpt_step=ckpt_step, load_fallback=fallback)
    layout = None if tp_size is None else RunLayout(world_size=tp_size, tp_size=tp_size)
    request = ResumeRequest(checkpoint, layout=layout, models=models)
    if layout is not None:  # only the verification's own checks: no layout or RNG checks
        request = dataclasses.replace(
            request,
            checkpoint=dataclasses.replace(checkpoint, no_load_optim=True, no_load_rng=True),
        )
    return plan_resume(request).iteration


def shard_path(root, generation: int, layout, shard: int) -> str:
    """Where the replacement store keeps ``shard`` of ``generation`` (data/replacement_store)."""
    from megatron_taco.data.replacement_store import generation_dir

    return os.path.join(generation_dir(root, generation), layout.shard_file(shard))


def committed_generations(root) -> list[int]:
    """The store's generations with a manifest; a corrupt manifest raises, not skipped."""
    from megatron_taco.data.replacement_store import list_generations, manifest_path, read_manifest

    committed = []
    for generation in list_generations(root):
        if os.path.exists(manifest_path(root, generation)):
            read_manifest(root, generation)
            committed.append(generation)
    return committed


@torch.no_grad()
def vocab_parallel_accuracy(
    local_logits: torch.Tensor,
    target: torch.Tensor,
    group,
    vocab_size: int | None = None,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(number correct, number of non-ignored targets) as int64 scalars, for MLM accuracy.
    Identical on all ranks of ``group``; sum over data-parallel ranks yourself."""
    predicted = vocab_parallel_argmax(local_logits, group, vocab_size)
    valid = target != ignore_index
    correct = (predicted == target) & valid
    return correct.sum(), valid.sum()
