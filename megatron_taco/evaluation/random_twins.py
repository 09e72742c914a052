"""What pretraining bought: each pretrained checkpoint beside randomly initialised twins of
the same architecture, on held-out text (the documents --split keeps out of training), with
evaluations a random encoder cannot win from a labelled set (examples/demo_evaluate.py):

1. held-out MLM accuracy against the most frequent target's share, and the collapse figure
   (mean pairwise cosine of last-layer token vectors), as the training run's validation
   measures them (the same collators, the same metric code);
2. zero-shot word order (word_order.py): does the model's own pretraining head prefer each
   sentence to a shuffle of its words? TACO by its MLM head, SAS by its RTD head and beside
   it its MLM head;
3. the frozen-feature probe (probe.py) on 32, 64 and 128 labelled sentences (each original
   or shuffled), tested on the other half of the sentences in both forms.

Seeds: the shuffles, the probe's sample and the random twins' initialisations; every row
gives the mean and standard deviation over them."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import numpy as np

from megatron_taco.arguments import option, require
from megatron_taco.data.tokenizer import Tokenizer, load_tokenizer
from megatron_taco.errors import ConfigError
from megatron_taco.evaluation.encoders import OurEncoder, twins
from megatron_taco.evaluation.word_order import (
    PROBE_SIZES,
    fitting,
    held_out_sentences,
    word_order,
)


@dataclass(frozen=True)
class TwinsConfig:
    data_path: str = option(help="The dataset prefix (held-out documents).")
    load: tuple[str, ...] = option((), "Pretraining checkpoints.", cli=False)
    split: str | None = option(
        None,
        "Whose validation and test documents are held out (default: the first checkpoint's "
        "--split).",
    )
    tokenizer_model: str | None = option(
        None, "Sentencepiece model of the checkpoints (default: the one each records)."
    )
    sentences: int = option(300, "Held-out sentences used.")
    seeds: int = option(3, "Seeds of the shuffles and the probe's samples.")
    random_twins: int = option(2, "Random initialisations beside each checkpoint.")
    output: str | None = option(None, "Write the rows as JSON here.")

    def __post_init__(self) -> None:
        require(len(self.load) > 0, type(self), "load", "give at least one checkpoint")
        for name in ("sentences", "seeds", "random_twins"):
            value = getattr(self, name)
            require(value >= 1, type(self), name, f"must be >= 1, got {value}")


@dataclass
class Row:
    model: str
    init: str  # "pretrained" or "random (N)"
    mlm_acc: float
    baseline: float
    collapse: float
    zero_shot: list[float]  # the pretraining head's: TACO's MLM, SAS's RTD
    probe: dict[int, list[float]]
    zero_shot_mlm: list[float] | None = None  # SAS: its MLM head's pseudo-log-likelihood


def held_out_metrics(model, info, tokenizer: Tokenizer, batches: int = 8) -> dict:
    """On the checkpoint's own validation documents (its --data-path and --split)."""
    from megatron_taco.data.bert_dataset import build_train_valid_test_datasets
    from megatron_taco.data.config import DataConfig
    from megatron_taco.parallel.state import single_process_state
    from megatron_taco.training.loop import evaluate_batches

    cfg = info.configs
    data = DataConfig(
        **{
            **cfg["data"],
            "data_path": tuple(cfg["data"]["data_path"]),
            "tokenizer_model": tokenizer.model_path,
        }
    )
    micro = cfg["training"]["micro_batch_size"]
    n = batches * micro
    _, valid, _ = build_train_valid_test_datasets(data, tokenizer, (1, n, 0))
    if valid is None:
        raise ConfigError(
            f"--load: {info.iter_dir} was trained with --split {data.split}, which leaves no "
            "validation documents to measure its held-out MLM accuracy on"
        )
    collate = _collator(info, data, tokenizer, model.config)
    stream = (collate([valid[i] for i in range(k, k + micro)]) for k in range(0, n, micro))
    return evaluate_batches(model, stream, single_process_state(), batches)


def _collator(info, data, tokenizer, model_config):
    cfg = info.configs
    if info.model == "TACO":
        from megatron_taco.data.masking import TokenMaskingConfig
        from megatron_taco.data.position_masking import PositionMaskingConfig
        from megatron_taco.data.taco_collator import TacoMaskingCollator

        return TacoMaskingCollator.from_tokenizer(
            tokenizer,
            seq_length=data.seq_length,
            seed=data.seed,
            masking=TokenMaskingConfig(**cfg["masking"]),
            position_masking=PositionMaskingConfig(**cfg["position_masking"]),
            num_positions=model_config.max_position_embeddings,
        )
    from megatron_taco.data.sas_collator import (
        ReplacementConfig,
        SasCollator,
        cold_start_probs,
        make_cold_start,
    )

    replacement = ReplacementConfig(**cfg["replacement"])
    probs = cold_start_probs(replacement, data.prefixes, data.weights, tokenizer.is_special_mask())
    source = make_cold_start(replacement, probs, data.seed, mask_id=tokenizer.mask_id)
    return SasCollator(
        pad_id=tokenizer.pad_id,
        seq_length=data.seq_length,
        seed=data.seed,
        config=replacement,
        source=source,
    )


def mean_std(values: list[float]) -> str:
    """Fractions as "mean ± std" in percent."""
    return f"{100 * np.mean(values):5.1f} ± {100 * np.std(values):4.1f}"


def evaluate_checkpoint(path: str, config: TwinsConfig, sentences: list[str]) -> list[Row]:
    """The pretrained row and the random twins' row of one checkpoint."""
    from megatron_taco.recipes.registry import checkpoint_tokenizer

    info, pretrained, randoms = twins(path, config.tokenizer_model, config.random_twins)
    tok = load_tokenizer(*checkpoint_tokenizer(info, config.tokenizer_model))
    kind = info.model
    limit = pretrained.config.max_position_embeddings
    originals, shuffles = fitting(tok, sentences, config.seeds, limit)
    if len(originals) < len(sentences):
        print(
            f"{kind}: {len(sentences) - len(originals)} of {len(sentences)} sentences are "
            f"longer than its {limit} positions; left out"
        )
    if not originals:
        raise ConfigError(f"--load: no held-out sentence fits the {limit} positions of {path}")
    skipped = [n for n in PROBE_SIZES if n > len(originals) // 2]
    if skipped:
        print(
            f"{kind}: probes on {', '.join(map(str, skipped))} labelled sentences need twice as "
            f"many held-out sentences ({len(originals)}); skipped"
        )
    rows = []
    for name, models in (("pretrained", [pretrained]), (f"random x{len(randoms)}", randoms)):
        held = [held_out_metrics(m, info, tok) for m in models]
        zs, probes = word_order([OurEncoder(m, kind) for m in models], originals, shuffles, tok)
        first = next(iter(zs))
        keys = ("mlm_acc", "mlm_baseline_acc", "collapse_cosine")
        means = [float(np.mean([h[k] for h in held])) for k in keys]
        pll = zs.get("mlm") if first != "mlm" else None
        rows.append(Row(kind, name, *means, zs[first], probes, pll))
    return rows


def evaluate(config: TwinsConfig) -> list[Row]:
    """Every checkpoint's rows on the same held-out sentences: printed as a table, written
    to ``config.output`` as JSON."""
    from megatron_taco.checkpoint.plan import find_checkpoint
    from megatron_taco.recipes.registry import checkpoint_tokenizer

    first = find_checkpoint(config.load[0])
    tok_file = checkpoint_tokenizer(first, config.tokenizer_model)
    split = config.split or (first.configs.get("data") or {}).get("split")
    if split is None:
        raise ConfigError(f"--split: {config.load[0]} records none; give the one it trained with")
    sentences = held_out_sentences(config.data_path, load_tokenizer(*tok_file), split)
    if not sentences:
        raise ConfigError(
            f"--data-path: {config.data_path} has no held-out sentence of 8-40 words in the "
            f"validation and test documents of --split {split}"
        )
    rng = np.random.default_rng(0)
    if len(sentences) > config.sentences:
        chosen = sorted(rng.choice(len(sentences), config.sentences, replace=False))
        sentences = [sentences[i] for i in chosen]
    print(
        f"{len(sentences)} held-out sentences; {config.seeds} seeds; "
        f"{config.random_twins} random twins"
    )
    rows = [row for path in config.load for row in evaluate_checkpoint(path, config, sentences)]
    print_table(rows)
    if config.output:
        with open(config.output, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)
    return rows


def print_table(rows: list[Row]) -> None:
    sizes = [n for n in PROBE_SIZES if any(n in r.probe for r in rows)]
    print(
        f"\n{'model':<6} {'init':<12} {'MLM acc':>8} {'baseline':>8} {'collapse':>8} "
        f"{'zero-shot order %':>18} {'(SAS: MLM head)':>16} "
        + " ".join(f"{f'probe n={n} %':>15}" for n in sizes)
    )
    for r in rows:
        pll = mean_std(r.zero_shot_mlm) if r.zero_shot_mlm else "-"
        print(
            f"{r.model:<6} {r.init:<12} {100 * r.mlm_acc:8.2f} {100 * r.baseline:8.2f} "
            f"{r.collapse:8.3f} {mean_std(r.zero_shot):>18} {pll:>16} "
            + " ".join(f"{mean_std(r.probe[n]) if n in r.probe else '-':>15}" for n in sizes)
        )
    print(
        "\n(MLM acc and baseline in %: the held-out accuracy of the pretraining head and the "
        "most frequent target's share; zero-shot: a random encoder is at 50 by construction)"
    )
